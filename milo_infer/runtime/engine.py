"""Batched execution: many queries per forward, each row with its own retrieved blocks (FlexGen-style).

A batch takes `QueryPlan`s (``milo_infer.runtime.planning``). For each store it fetches the union of its rows'
blocks once (a block several rows retrieved crosses the link once per batch), streams those factors a
layer ahead (`LayerPrefetcher`), and rebuilds each row's [anchor][blocks] at that row's own positions
into one `BatchCache` (keys are pre-RoPE in the store, so one fetched block serves rows that place it
at different positions). Rows' queries are left-padded into one prefill forward, with explicit
position ids and a 4-D mask built from the cache's per-row column mask (a row that recomputes tokens
of its prefix feeds them first, at their own positions, and its rebuilt columns of them are masked
out for good; in that first forward a token sees only the prefix columns before its own position);
then every row decodes one token per forward, each with its own stopping (`LabelDecoder`,
`GreedyDecoder`), and a finished row leaves the batch. A running `Batch` also admits new rows between steps (continuous batching): they
are rebuilt and prefilled as a small batch of their own and merged into the running cache.

Nothing per query is written on a long-lived object: a batch's stage seconds and fetch statistics
live on the batch and its rows; each row's ``Answer.seconds`` is its share of the stages it was part
of (its own retrieval, an equal share of its admission's read/rebuild/prefill and of every decode
step it took part in), so the seconds of a run's answers add up to the run.
"""
from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import transformers

from milo_store import MiloStore

from ..models import LoadedModel, check_compatible, rope_tables
from .cache import BatchCache
from .decoding import GreedyDecoder, LabelDecoder
from .device_tier import DeviceTier
from .errors import AdmissionOutOfMemory, BlockLoadError, RowFailed
from .interface import Answer, RowEvent
from .planning import STOP_STRINGS, EngineSettings, MountedStore, QueryPlan, Request
from .prefetch import TransferPool
from .prefix import UNREADABLE, PrefixRebuild, rebuild_layer
from .timing import StageClock

log = logging.getLogger("milo.engine")
LOAD_ERROR_POLICIES = ("recompute", "fail")
Rebuild = Callable[..., None]  # (factors, segments, out_k, out_v, cos, sin, *, interleaved, quant, plan)


class Engine:
    """The model and the stores it answers from (a `ServingEngine`); ``plan`` queries, ``answer`` a batch of
    plans, or keep a running ``batch()``. ``settings`` are what requests default to; ``rebuild`` replaces the
    kernels' reconstruction (the benchmark's full-KV copy); ``device_cache_bytes`` keeps that many bytes of
    blocks' factors on the device (`DeviceTier`). ``on_load_error``: a block that cannot be read (checksum,
    a read that failed after its retries) ends the rows that need it with a `BlockLoadError` ("fail", the
    default: an evaluation or a one-off query reports a damaged store rather than answer around it), or is
    computed by the model from the token ids the store keeps for it ("recompute", `milo serve`'s default);
    other rows never notice either way."""

    def __init__(self, loaded: LoadedModel, stores: dict[str, MiloStore], settings: EngineSettings = EngineSettings(),
                 *, device=None, prefetch_depth: int = 2, rebuild: Rebuild = rebuild_layer,
                 device_cache_bytes: int = 0, on_load_error: str = "fail"):
        if on_load_error not in LOAD_ERROR_POLICIES:
            raise ValueError(f"on_load_error must be one of {', '.join(LOAD_ERROR_POLICIES)}, got {on_load_error!r}")
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.cache_kwarg = cache_keyword(self.model)
        model_device = next(self.model.parameters()).device
        self.device = torch.device(device) if device is not None else model_device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device != model_device:
            raise ValueError(f"the model is on {model_device} but the session was asked to run on {self.device}: "
                             f"move the model first (milo_infer.runtime.session.place_model)")
        if not stores:
            raise ValueError("an engine needs at least one store")
        self.dtype = next(self.model.parameters()).dtype
        self.settings, self.prefetch_depth, self.rebuild = settings, prefetch_depth, rebuild
        self.on_load_error = on_load_error
        self.unreadable_logged: set[tuple[str, int]] = set()  # each unreadable block is logged once
        for store in stores.values():
            check_compatible(store, loaded.identity)
        self.max_positions = min(s.meta["model"]["max_position_embeddings"] for s in stores.values())
        self.cos, self.sin = rope_tables(self.model, self.max_positions, device=self.device)
        self.stores = {name: MountedStore(name, store, self.tokenizer, self.cos, self.sin, self.device, self.dtype,
                                          settings.aggregate) for name, store in stores.items()}
        self.prefixes = {name: m.prefix for name, m in self.stores.items()}
        self.device_tier = DeviceTier(device_cache_bytes, self.device) if device_cache_bytes else None
        # one side stream and buffer set per store: a batch may stream from several stores at once
        self.transfers = {name: TransferPool(self.device) for name in stores} if self.device.type == "cuda" else {}
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)

    def plan(self, store: str, request: Request, block_ids: list[int] | None = None) -> QueryPlan:
        """Host-only and read-only: safe from any thread. Raises KeyError for an unknown store."""
        if store not in self.stores:
            raise KeyError(f"no store named {store!r} is mounted (mounted: {', '.join(self.stores)})")
        return self.stores[store].plan(request, self.settings, self.max_positions, block_ids)

    def batch(self) -> "Batch":
        return Batch(self)

    @torch.inference_mode()
    def answer(self, plans: list[QueryPlan], stats: dict | None = None) -> list[Answer]:
        """Answer these plans as one batch, to completion; answers in the plans' order (a row that ends with an
        error raises it). ``stats`` (a dict the caller owns) gains the batch's fetch statistics, summed, and its peak K/V bytes, maxed."""
        batch = self.batch()
        done = {}
        events = batch.admit(plans)
        while True:
            for event in events:
                if event.error is not None:
                    raise event.error
                if event.finished:
                    done[id(event.plan)] = event.answer
            if not len(batch):
                break
            events = batch.step()
        if stats is not None:
            for name, value in batch.fetch_stats.items():
                stats[name] = stats.get(name, 0) + value
            stats["peak_kv_bytes"] = max(stats.get("peak_kv_bytes", 0), batch.peak_kv_bytes)
        return [done[id(p)] for p in plans]

    def report_unreadable(self, store: str, block: int, error: Exception) -> None:
        if (store, block) not in self.unreadable_logged:
            self.unreadable_logged.add((store, block))
            log.error("store %r: block %d cannot be read (%s); rows that need it are %s", store, block, error,
                      "answered by computing it" if self.on_load_error == "recompute" else "failed")

    @torch.inference_mode()
    def logits(self, plans: list[QueryPlan]) -> list[torch.Tensor]:
        """Each plan's query logits [T_query, vocab] (fp32) from one batched prefill, for exactness checks."""
        return Batch(self).prefill_logits(plans)


@dataclass(eq=False)
class Row:
    plan: QueryPlan
    decoder: LabelDecoder | GreedyDecoder
    next_position: int  # RoPE position of the next token fed
    seconds: dict
    moved: int = 0  # its share of the bytes its admission moved
    first_token_seconds: float = 0.0
    prefill_tokens: int = 0  # tokens its admission's forward computed for it
    recomputed_blocks: list[int] = field(default_factory=list)  # unreadable blocks the model computed instead
    last_token: int = -1
    sent: int = 0  # characters of text already given out as deltas
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        return self.decoder.done or self.cancelled


class Batch:
    """A running batch, used from one thread. ``admit`` adds rows (rebuild + prefill), ``step`` decodes one
    token for every row; a finished or cancelled row leaves. ``fetch_stats`` describes the last admission,
    ``peak_kv_bytes`` the most K/V it held at once: the cache's buffers, and while prefixes are rebuilt
    the factors staged for it (the transfer buffers on CUDA, a layer of gathered factors on CPU)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.rows: list[Row] = []
        self.cache: BatchCache | None = None
        self.valid: torch.Tensor | None = None  # bool [rows, capacity]: columns each row attends to
        self.fetch_stats: dict = {}
        self.unreadable_blocks = 0  # blocks the last admission could not read
        self.peak_kv_bytes = 0

    def __len__(self) -> int:
        """Rows still decoding (finished rows may still hold their place until the batch is compacted)."""
        return sum(not row.finished for row in self.rows)

    # -- admission -----------------------------------------------------------------------------
    def _fetch(self, plans: list[QueryPlan], clock: StageClock) -> PrefixRebuild:
        """Read these plans' blocks: the union of each store's once (raises what an unreadable block raises)."""
        e = self.engine
        return PrefixRebuild(e.prefixes, [p.placement for p in plans], e.cos, e.sin, e.device, depth=e.prefetch_depth,
                             tier=e.device_tier, pools=e.transfers, rebuild=e.rebuild, clock=clock)

    def _readable(self, plans: list[QueryPlan], clock: StageClock):
        """``plans`` with their blocks read: (submitted, executed) pairs, the rebuild, and an error event for
        each row that cannot run. Where the union cannot be read, its blocks are read one by one to find the
        unreadable ones; a row needing one recomputes it (`MountedStore.without_blocks`) or fails with
        `BlockLoadError`, as the engine's ``on_load_error`` says; the other rows load as planned."""
        e = self.engine
        try:
            return [(p, p) for p in plans], self._fetch(plans, clock), []
        except UNREADABLE:
            pass
        unreadable = {name: e.prefixes[name].unreadable([b for p in plans if p.store == name for b in p.blocks])
                      for name in dict.fromkeys(p.store for p in plans)}
        pairs, failed = [], []
        for p in plans:
            bad = {b: err for b, err in unreadable[p.store].items() if b in p.blocks}
            for b, err in bad.items():
                e.report_unreadable(p.store, b, err)
            try:
                if bad and e.on_load_error == "fail":
                    b, err = next(iter(bad.items()))
                    raise BlockLoadError(f"store {p.store!r}: block {b} cannot be read ({err})") from err
                pairs.append((p, e.stores[p.store].without_blocks(p, set(bad)) if bad else p))
            except BlockLoadError as err:
                failed.append(RowEvent(p, "", True, "error", error=err))
        self.unreadable_blocks = sum(len(bad) for bad in unreadable.values())
        return pairs, (self._fetch([x for _, x in pairs], clock) if pairs else None), failed

    def _rebuilt(self, plans: list[QueryPlan], rebuild: PrefixRebuild) -> tuple[BatchCache, torch.Tensor, int, int]:
        """A cache for these plans whose first forward rebuilds every row's prefix (``rebuild``), its column
        mask, and the column where the queries start and end."""
        e = self.engine
        self.fetch_stats = {**rebuild.fetch_stats, "unreadable_blocks": self.unreadable_blocks,
                            "bytes_without_union": sum(p.placement.kv_bytes_stored for p in plans)}
        prefix_end = max(p.prefix_tokens for p in plans)
        query_len = max(len(p.query_ids) for p in plans)
        start, end = prefix_end, prefix_end + query_len
        capacity = end + max(p.max_new_tokens for p in plans)
        layout = e.prefixes[plans[0].store].layout
        cache = BatchCache(layout.num_layers, len(plans), start, capacity, (layout.num_kv_heads, layout.head_dim),
                           e.dtype, e.device, rebuild.fill)
        valid = torch.zeros(len(plans), capacity, dtype=torch.bool)
        for r, p in enumerate(plans):
            valid[r, :p.prefix_tokens] = True
            valid[r, torch.from_numpy(p.recompute)] = False  # stale: their fresh K/V come in the query's columns
            valid[r, end - len(p.query_ids):end] = True
        return cache, valid.to(e.device), start, end

    def _forward(self, cache: BatchCache, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                 keep_all: bool = False) -> torch.Tensor:
        """One model call over ``ids`` [B, q] at ``positions`` with ``cache``; a query token attends to the
        valid columns before the new ones and causally among the new ones. In the first forward the columns
        before the new ones are the rebuilt prefixes, whose column is their position: a token attends only to
        those before its own position (a no-op for the query; a recomputed prefix token sees what precedes
        it in the context, never what follows). Returns logits [B, q or 1, V]."""
        e = self.engine
        first = not cache.layers[0].is_initialized
        n, q = cache.length, ids.shape[1]
        new = torch.arange(q, device=e.device)
        allowed = valid[:, None, :n + q].expand(-1, q, -1).clone()
        allowed[:, :, n:] &= new[None, None, :] <= new[None, :, None]
        if first:
            allowed[:, :, :n] &= torch.arange(n, device=e.device)[None, None, :] < positions[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=e.dtype, device=e.device)
        mask.masked_fill_(~allowed, torch.finfo(e.dtype).min)
        out = e.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None], use_cache=True,
                      logits_to_keep=0 if keep_all else 1, **{e.cache_kwarg: cache})
        if first and not all(layer.is_initialized for layer in cache.layers):
            raise RuntimeError(f"the model did not use the milo cache (transformers {transformers.__version__} "
                               f"ignored {e.cache_kwarg}=): the answer would have no retrieved context")
        held = cache.bytes() + (self.cache.bytes() if self.cache is not None and self.cache is not cache else 0)
        self.peak_kv_bytes = max(self.peak_kv_bytes, held + (self.fetch_stats["buffer_bytes"] if first else 0))
        return out.logits

    def _prefill(self, plans: list[QueryPlan], keep_all: bool, clock: StageClock,
                 rebuild: PrefixRebuild | None = None):
        cache, valid, start, end = self._rebuilt(plans, rebuild or self._fetch(plans, clock))
        e = self.engine
        ids = torch.full((len(plans), end - start), e.pad_id, dtype=torch.long)
        positions = torch.zeros_like(ids)
        for r, p in enumerate(plans):
            q = len(p.query_ids)
            ids[r, end - start - q:] = torch.tensor(p.query_ids)
            positions[r] = p.prefix_tokens  # padding: masked for every row, position immaterial
            positions[r, end - start - q:] = torch.from_numpy(p.positions)
        with clock.device_stage("forwards"):
            logits = self._forward(cache, ids.to(e.device), positions.to(e.device), valid, keep_all)
        return cache, valid, logits

    def prefill_logits(self, plans: list[QueryPlan]) -> list[torch.Tensor]:
        """Each plan's logits over what its forward fed (recomputed tokens, then the query), through the same
        reads as an admission; a row that cannot run raises its error."""
        clock = StageClock(self.engine.device)
        pairs, rebuild, failed = self._readable(plans, clock)
        if failed:
            raise failed[0].error
        executed = [x for _, x in pairs]
        _, _, logits = self._prefill(executed, True, clock, rebuild)
        return [logits[r, logits.shape[1] - len(x.query_ids):].float() for r, x in enumerate(executed)]

    @torch.inference_mode()
    def admit(self, plans: list[QueryPlan]) -> list[RowEvent]:
        """Add rows: rebuild their prefixes and prefill their queries in one forward; each new row's first event,
        or the error that ended it (a block that could not be read, no device memory even alone). An
        admission the device has no memory for is tried again in halves; the batch is unchanged by one that
        fails."""
        if not plans:
            return []
        e = self.engine
        clock = StageClock(e.device)
        t = time.perf_counter()
        pairs, rebuild, events = self._readable(plans, clock)
        if not pairs:
            return events
        executed = [x for _, x in pairs]
        try:
            cache, valid, logits = self._prefill(executed, False, clock, rebuild)
        except torch.OutOfMemoryError:
            del rebuild
            submitted = [p for p, _ in pairs]
            if len(submitted) == 1:
                error = AdmissionOutOfMemory(f"the device ({e.device}) has no memory for this request's "
                                             f"{submitted[0].prompt_tokens}-token context now")
                return events + [RowEvent(submitted[0], "", True, "error", error=error)]
            half = len(submitted) // 2
            return events + self.admit(submitted[:half]) + self.admit(submitted[half:])
        last = logits[:, -1].float().cpu()
        admission = time.perf_counter() - t
        seconds = clock.read()
        seconds["model"] = max(0.0, seconds.pop("forwards") - seconds.get("wait", 0.0) - seconds.get("rebuild", 0.0))
        share = {stage: s / len(pairs) for stage, s in seconds.items()}
        rows = []
        for p, x in pairs:
            trie = e.stores[p.store].queries.trie
            decoder = (LabelDecoder(trie, e.tokenizer, p.max_new_tokens) if trie is not None else
                       GreedyDecoder(e.tokenizer, STOP_STRINGS + tuple(p.request.stop), p.max_new_tokens))
            rows.append(Row(p, decoder, p.prompt_tokens, {"retrieve": p.retrieve_seconds, **share},
                            moved=self.fetch_stats["bytes"] // len(pairs),
                            first_token_seconds=p.retrieve_seconds + admission, prefill_tokens=len(x.query_ids),
                            recomputed_blocks=[b for b in p.blocks if b not in x.blocks]))
        if self.cache is None:
            self.cache, self.valid = cache, valid
        else:  # the running rows' cache is copied anyway: finished rows leave now
            alive = [r for r, row in enumerate(self.rows) if not row.finished]
            self._regroup(torch.tensor(alive, dtype=torch.long), cache, valid, rows)
            self.rows = [self.rows[r] for r in alive]
        self.rows += rows
        events += [self._advance(row, last[r]) for r, row in enumerate(rows)]
        self._drop_finished()
        return events

    # -- decoding ------------------------------------------------------------------------------
    def cancel(self, plan: QueryPlan) -> None:
        """The row of ``plan`` leaves before the next forward (a client that went away)."""
        for row in self.rows:
            if row.plan is plan:
                row.cancelled = True
        self._drop_finished()

    @torch.inference_mode()
    def step(self) -> list[RowEvent]:
        """One decode forward for every row still decoding: one event each. A finished row that still holds
        its place is fed padding and gets no event."""
        if not len(self):
            return []
        e = self.engine
        t = time.perf_counter()
        n = self.cache.length
        if n + 1 > self.valid.shape[1]:  # a merged row can outlive the capacity its batch was made with
            self._regroup(torch.arange(len(self.rows)), None, None, [])
        self.valid[:, n] = True
        ids = torch.tensor([[e.pad_id if row.finished else row.last_token] for row in self.rows], device=e.device)
        positions = torch.tensor([[row.next_position] for row in self.rows], device=e.device)
        logits = self._forward(self.cache, ids, positions, self.valid)[:, -1].float().cpu()
        share = (time.perf_counter() - t) / len(self)
        events = []
        for r, row in enumerate(self.rows):
            if row.finished:
                continue
            row.seconds["model"] = row.seconds.get("model", 0.0) + share
            row.next_position += 1
            events.append(self._advance(row, logits[r]))
        self._drop_finished()
        return events

    def _advance(self, row: Row, logits: torch.Tensor) -> RowEvent:
        """The row's next token and its event; a row whose own work raises ends alone, with `RowFailed`."""
        try:
            row.last_token = row.decoder.push(logits)
            text = row.decoder.text()
        except Exception as err:  # a decoder's fault is this row's alone: the batch and the others go on
            row.cancelled = True
            failure = RowFailed(f"decoding this request failed: {type(err).__name__}: {err}")
            failure.__cause__ = err
            return RowEvent(row.plan, "", True, "error", error=failure)
        delta, row.sent = text[row.sent:], len(text)
        if not row.decoder.done:
            return RowEvent(row.plan, delta, False)
        p, reason = row.plan, "length" if row.decoder.stop == "length" else "stop"
        answer = Answer(text=row.decoder.result().text.strip(), blocks=p.blocks, groups=p.groups,
                        prefix_tokens=p.prefix_tokens, kv_bytes_full=p.placement.kv_bytes_full,
                        kv_bytes_stored=p.placement.kv_bytes_stored, seconds=dict(row.seconds), kv_bytes_moved=row.moved,
                        completion_tokens=len(row.decoder.ids), finish_reason=reason,
                        first_token_seconds=row.first_token_seconds, prefill_tokens=row.prefill_tokens,
                        recomputed_blocks=row.recomputed_blocks)
        return RowEvent(p, delta, True, reason, answer)

    def _drop_finished(self) -> None:
        """Compact the batch once at least half its rows have finished (or all have): until then a finished
        row costs one padded token per step, while compacting copies every remaining row's cache, so rows
        that finish a step apart (labels) are dropped together and the copies stay few."""
        keep = [r for r, row in enumerate(self.rows) if not row.finished]
        if 2 * (len(self.rows) - len(keep)) < len(self.rows):
            return
        if keep:
            self._regroup(torch.tensor(keep, dtype=torch.long), None, None, [])
        else:
            self.cache = self.valid = None
        self.rows = [self.rows[r] for r in keep]

    def _regroup(self, keep: torch.Tensor, other: BatchCache | None, other_valid: torch.Tensor | None,
                 joining: list[Row]) -> None:
        """Rebuild the cache's buffers for rows ``keep`` then ``other``'s rows, sized for every remaining
        row's budget (a copy, once per change of the batch's rows)."""
        kept = [self.rows[i] for i in keep.tolist()]
        length = max(self.cache.length, other.length if other is not None else 0)
        # columns are shared: only rows still decoding decide how many more steps the batch takes
        room = max((row.plan.max_new_tokens - len(row.decoder.ids) for row in kept + joining if not row.finished),
                   default=0)
        capacity = length + room + 1
        keep_dev = keep.to(self.engine.device)
        self.cache.regroup(keep_dev, other, capacity)
        valid = torch.zeros(len(kept) + len(joining), capacity, dtype=torch.bool, device=self.engine.device)
        old = self.valid.index_select(0, keep_dev)
        valid[:len(kept), :min(old.shape[1], capacity)] = old[:, :capacity]
        if other_valid is not None:
            valid[len(kept):, :min(other_valid.shape[1], capacity)] = other_valid[:, :capacity]
        self.valid = valid


def cache_keyword(model) -> str:
    """The name under which this model's forward takes a cache: transformers 5 renamed
    ``past_key_values`` to ``cache`` between 5.17 and 5.24, and passes an unknown name on silently."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
