"""Batched execution: many queries per forward, each row with its own retrieved blocks (FlexGen-style).

A batch takes `QueryPlan`s (``milo_infer.runtime.planning``) and seats each in pages of its `PagedCache`
(``milo_infer.runtime.cache``): every page its prompt and answer budget will ever need, taken from the engine's
KV budget when it is seated (``milo_infer.runtime.pages``; plans beyond the free pages, or beyond ``max_rows``,
wait, oldest first). For each admission it fetches the union of
its rows' blocks once per store (a block several rows retrieved crosses the link once), and the first
forward that feeds any of its rows streams those factors a layer ahead (`LayerPrefetcher`) and rebuilds
each row's [anchor][blocks] into that row's pages, at its own positions (keys are pre-RoPE in the
store, so one fetched block serves rows that place it at different positions). Every step is one forward
over a packed sequence: each running row's last token and the next chunk of the rows being prefilled (a
row that recomputes tokens of its prefix feeds them first, at their own positions, then its query), at
most ``EngineSettings.prefill_chunk`` prompt tokens in all; a row decodes its first token after its last
chunk, then one per step, each with its own decoder (`LabelDecoder`, `FreeDecoder`, `GrammarDecoder`: which
tokens may come, when it stops) and sampling (`sampling.choose`: greedy, or drawn with its request's settings and
seed), and a finished or cancelled row gives its pages back at once. No join or leave copies another row's K/V.

Nothing per query is written on a long-lived object: a batch's stage seconds and fetch statistics
live on the batch and its rows; each row's ``Answer.seconds`` is its share of the stages it was part
of (its own retrieval, an equal share of its admission's read/transfer/wait/rebuild and of the model time
of every forward it took part in), so the seconds of a run's answers add up to the run.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
import transformers

from milo_store import IncompatibleStoreError, MiloStore, StoreError
from milo_store.layers import LATENT

from ..models import FAMILIES, LoadedModel, check_compatible, layer_rope_tables, media_tokens
from .attention import ATTENTION, choose_attention, flex_pool_pages
from .cache import HeldQueries, Pack, PagedCache, PrefixFill, Segment, column_bytes, pool_columns
from .decoding import FreeDecoder
from .device_tier import DeviceTier
from .errors import AdmissionOutOfMemory, BlockLoadError, RequestError, RowFailed
from .interface import Answer, RowEvent
from .linear_rows import RowState, install as install_row_forwards
from .pages import (FULL, PAGE_TOKENS, WINDOW, PageGroups, kv_budget_bytes, pages_for, split_budget,
                    window_pages_needed, window_skip)
from .planning import HYBRID_RECOMPUTE, STOP_STRINGS, EngineSettings, MountedStore, QueryPlan, Request
from .prefetch import TransferPool
from .sampling import RowSampler, TokenLogprob, choose
from .prefix import FETCH_STATS, UNREADABLE, BlockPlacement, PrefixRebuild, rebuild_layer
from .shared_blocks import Build, HeldBlock, HeldBlocks, layers_reached, own_run, own_table
from .timing import StageClock

log = logging.getLogger("milo.engine")
LOAD_ERROR_POLICIES = ("recompute", "fail")
Rebuild = Callable[..., None]  # (factors, segments, out_k, out_v, cos, sin, *, interleaved, rotary_dim, quant, plan)


class Engine:
    """The model and the stores it answers from (a `ServingEngine`); ``plan`` queries, ``answer`` a batch of
    plans, or keep a running ``batch()``. ``settings`` are what requests default to; ``rebuild`` replaces the
    kernels' reconstruction (the benchmark's full-KV copy); ``device_cache_bytes`` keeps that many bytes of
    blocks' factors on the device (`DeviceTier`). ``on_load_error``: a block that cannot be read (checksum,
    a read that failed after its retries) ends the rows that need it with a `BlockLoadError` ("fail", the
    default: an evaluation or a one-off query reports a damaged store rather than answer around it), or is
    computed by the model from the token ids the store keeps for it ("recompute", `milo serve`'s default);
    other rows never notice either way. ``kv_cache_memory``: the KV budget of a batch's pages, in bytes (an
    int) or as a share of the device memory free once the model is loaded, less the device cache (a float
    in (0, 1]; default: `pages.DEFAULT_SHARE`); a row is seated only when its pages fit, and a request that
    cannot fit even alone is refused when planned. ``max_rows``: rows answered at once at most (more wait).
    ``attention``: "flex" (one FlexAttention call per layer for every row), "rows" (one SDPA call per row) or
    "auto" (flex on CUDA, rows on the CPU: `milo_infer.runtime.attention`). ``window_reach``: a model with
    sliding-window layers reads and rebuilds, at each window layer, only the blocks its window reaches from a row's
    first fed token, and holds pages there only from the first its windows reach (False: every block and page at
    every layer, the same answers; what `tools/bench_windows.py` compares against). ``shared_blocks``: a block that
    enough rows place is held once and attended by each of them at its own offset, by turning its query
    (`milo_infer.runtime.shared_blocks`; a row's other blocks stay in its own pages); False: every row holds and
    attends its own copy of its whole prefix, the same answers (what `tools/bench_serve.py --shared-blocks off`
    compares against). A family whose keys are not a rotation of what the store keeps always takes the per-row path
    (`families.Attention.query_turns`)."""

    def __init__(self, loaded: LoadedModel, stores: dict[str, MiloStore], settings: EngineSettings = EngineSettings(),
                 *, device=None, prefetch_depth: int = 2, rebuild: Rebuild = rebuild_layer,
                 device_cache_bytes: int = 0, on_load_error: str = "fail", max_rows: int = 16,
                 kv_cache_memory: int | float | None = None, attention: str = "auto", window_reach: bool = True,
                 shared_blocks: bool = True):
        if on_load_error not in LOAD_ERROR_POLICIES:
            raise ValueError(f"on_load_error must be one of {', '.join(LOAD_ERROR_POLICIES)}, got {on_load_error!r}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.model, self.tokenizer, self.max_rows = loaded.model, loaded.tokenizer, max_rows
        self.model_config = loaded.model.config  # the model's own, even when a wrapper replaces ``model``
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
        self.unreadable_logged: set[tuple[str, str, int]] = set()  # each unreadable block is logged once
        for store in stores.values():
            check_compatible(store, loaded.identity)
        self.max_positions = min(s.meta["model"]["max_position_embeddings"] for s in stores.values())
        self.rope = layer_rope_tables(self.model, self.max_positions, device=self.device)  # each layer's tables
        self.identity, self.swapping = loaded.identity, threading.Lock()
        self.windows = model_windows(self.model_config) if window_reach else None
        # what each layer holds: the one description the pools, the rebuild and the page bytes read (stores mounted
        # together are of this model: `check_compatible`)
        self.layers = next(iter(stores.values())).layout.layers
        # a hybrid's linear layers run each row alone from its own state (`linear_rows`); its rows hold their own copies
        # of their blocks, since a row composes its state from its own read of each block's pairs
        self.linear = any(spec.state_values for spec in self.layers)
        if self.linear:
            if settings.recompute:
                raise RequestError(HYBRID_RECOMPUTE)
            install_row_forwards(self.model)
        self.shared_blocks = shared_blocks and query_turns(self.model_config) and not self.linear
        # a row sharing some blocks keeps its others in its own pages, packed before its query: only where no layer
        # masks by the distance between positions (a window's mask reads a column as its position)
        self.holds_what_pays = self.shared_blocks and model_windows(self.model_config) is None
        self.stores = {name: self.mount(name, store) for name, store in stores.items()}
        self.device_tier = DeviceTier(device_cache_bytes, self.device) if device_cache_bytes else None
        # an MLA model's layers attend per row whatever is chosen: "auto" takes rows, whose pools need no flex sizes
        latent = any(spec.kind == LATENT for spec in self.layers)
        self.attention = choose_attention("rows" if latent and attention == "auto" else attention, self.device)
        self.page_bytes = PAGE_TOKENS * column_bytes(self.layers, self.dtype)
        # window layers hold pages of their own, from the first their windows reach (`cache`, `Batch._seat`); a shared
        # layer attends its source's, of its own layer type and window
        self.window_layers = frozenset(l for l, w in enumerate(self.windows or ()) if w is not None)
        self.window_span = max((w for w in self.windows or () if w is not None), default=0)
        # each page group's bytes a page (`pages.PageGroups`): the full layers', and the window layers' where they hold
        # pages of their own, of the layers holding K/V in each
        self.group_page_bytes = {group: PAGE_TOKENS * column_bytes(
            [spec for l, spec in enumerate(self.layers) if (l in self.window_layers) == (group == WINDOW)], self.dtype)
            for group in (FULL, WINDOW) if group == FULL or self.window_layers}
        self.kv_budget = kv_budget_bytes(kv_cache_memory, self.device, reserved=device_cache_bytes)
        self.kv_pages = self.kv_budget // self.page_bytes
        if not self.kv_pages:
            raise ValueError(f"a KV budget of {self.kv_budget} bytes holds no page: one page ({PAGE_TOKENS} columns "
                             f"of every layer's K and V) takes {self.page_bytes} bytes")
        # each page group's pages of the budget, which every batch's pools hold from its first row on
        self.group_pages = split_budget(self.group_page_bytes, self.kv_budget, self.typical_row()[2])
        # one side stream and buffer set per store: a batch may stream from several stores at once
        self.transfers = {name: TransferPool(self.device) for name in stores} if self.device.type == "cuda" else {}
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)

    def typical_row(self) -> tuple[str, int, dict]:
        """The longest of the mounted stores' typical rows: the store, its columns (its anchor, ``settings.k`` groups of
        its mean tokens, or its token budget, and the answer budget; no query) and each page group's pages of it."""
        def prefix(mounted: MountedStore) -> int:
            groups = mounted.store.group_tokens() if mounted.store.num_blocks else np.zeros(1)
            tokens = self.settings.k * float(groups.mean())
            return mounted.prefix.anchor_len + int(min(tokens, self.settings.token_budget or tokens))
        name, longest = max(((name, prefix(mounted)) for name, mounted in self.stores.items()), key=lambda p: p[1])
        columns = longest + self.settings.max_new_tokens
        pages = pages_for(columns)
        window = window_pages_needed(pages, window_skip(longest, self.window_span)) if self.window_layers else 0
        return name, columns, {FULL: pages, WINDOW: window}

    def budget_summary(self) -> str:
        """What the KV budget holds, in one line (`milo serve` says it at start)."""
        name, columns, row = self.typical_row()
        pages = self.group_pages
        rows = min(pages[group] // max(1, row[group]) for group in pages)
        window = f" (and {pages[WINDOW]:,} of the window layers')" if WINDOW in pages else ""
        return (f"K/V budget {self.kv_budget / 2**30:.1f} GiB: {pages[FULL]:,} pages of {PAGE_TOKENS} columns{window}, "
                f"up to {rows:,} rows of store {name!r}'s prefix ({self.settings.k} groups and the answer budget: "
                f"{columns:,} columns, queries aside)")

    def mount(self, name: str, store: MiloStore) -> MountedStore:
        """``store`` ready to answer from. Its token ids (what unreadable blocks and recompute are computed
        from) are read now: a directory's path holds the next version once an update commits, and this
        mount must never read that one's."""
        check_compatible(store, self.identity)
        if store.num_blocks:
            try:
                store.token_ids(0)
            except StoreError as e:  # damaged: a query that needs none still answers; one that does fails then
                log.warning("store %r: its token ids cannot be read (%s): no block of it can be computed instead "
                            "of read", name, e)
        return MountedStore(name, store, self.tokenizer, self.rope, self.device, self.dtype,
                            self.settings.aggregate, self.windows, media_tokens(self.model_config))

    def swap(self, name: str, store: MiloStore) -> MountedStore:
        """Answer new plans for ``name`` from ``store`` (a newer version of it, already opened) from now on;
        returns the version it replaces. Safe from any thread while the engine runs: a plan made before
        is still answered from the version it was planned against (`QueryPlan.mount`), and once no plan
        holds the old version any more its store is closed (logged). Raises what mounting raises (a
        store of another model: `IncompatibleStoreError`); the old version then keeps serving."""
        if name not in self.stores:
            raise KeyError(f"no store named {name!r} is mounted (mounted: {', '.join(self.stores)})")
        positions = store.meta["model"]["max_position_embeddings"]
        if positions < self.max_positions:
            raise IncompatibleStoreError(f"{store.path}: its model has {positions} positions, the engine was "
                                         f"started for {self.max_positions}")
        new = self.mount(name, store)
        with self.swapping:
            old = self.stores[name]
            self.stores = {**self.stores, name: new}  # one rebinding: a planner sees the old dict or the new one
        weakref.finalize(old, release_version, old.store, name, old.version)
        return old

    def plan(self, store: str, request: Request, block_ids: list[int] | None = None) -> QueryPlan:
        """Host-only and read-only: safe from any thread. Raises KeyError for an unknown store."""
        mounted = self.stores.get(store)
        if mounted is None:
            raise KeyError(f"no store named {store!r} is mounted (mounted: {', '.join(self.stores)})")
        plan = mounted.plan(request, self.settings, self.max_positions, block_ids)
        self.check_fits(plan)
        return plan

    def check_fits(self, plan: QueryPlan) -> None:
        """Refuse a plan whose pages exceed the whole KV budget: it could never be seated."""
        columns = plan.prompt_tokens + plan.max_new_tokens
        if pages_for(columns) > self.kv_pages:
            raise RequestError(f"this request needs {columns} KV columns ({plan.prompt_tokens} of context and "
                               f"{plan.max_new_tokens} for the answer: {pages_for(columns) * self.page_bytes} bytes "
                               f"in pages of {PAGE_TOKENS}), more than the whole KV budget of {self.kv_budget} bytes "
                               f"({self.kv_pages} pages); lower k, set a token budget or raise the KV cache memory")

    def batch(self) -> "Batch":
        return Batch(self)

    @contextlib.contextmanager
    def paged_attention(self):
        """The model attends through the paged cache (`milo_infer.runtime.attention.paged_attention`) for the
        forwards inside only: other users of the same model object keep their attention implementation."""
        before = self.model_config._attn_implementation
        self.model_config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            self.model_config._attn_implementation = before

    @torch.inference_mode()
    def answer(self, plans: list[QueryPlan], stats: dict | None = None) -> list[Answer]:
        """Answer these plans as one batch, to completion; answers in the plans' order (a row that ends with an
        error raises it). ``stats`` (a dict the caller owns) gains the batch's fetch statistics, summed, and its
        peak K/V bytes (its rows' columns and the staged factors), the most its rows' columns took, the pages its
        rows reached (``kv_bytes_allocated``: what of the pools was written) and the most pages it held
        (``kv_bytes_held``), the most distinct blocks it held, the block placements of its rows and those attended
        in a held copy (``held_blocks``, ``placed_blocks``, ``held_placements``), each maxed, and its forwards
        (``steps``), summed."""

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
            stats["kv_bytes_allocated"] = max(stats.get("kv_bytes_allocated", 0), batch.kv_bytes_allocated)
            stats["kv_bytes_needed"] = max(stats.get("kv_bytes_needed", 0), batch.kv_bytes_needed)
            stats["kv_bytes_held"] = max(stats.get("kv_bytes_held", 0), batch.kv_bytes_held)
            for name in ("held_blocks", "placed_blocks", "held_placements"):  # each at its most
                stats[name] = max(stats.get(name, 0), batch.most_held[name])
            stats["steps"] = stats.get("steps", 0) + batch.steps
        return [done[id(p)] for p in plans]

    def report_unreadable(self, store: str, version: str, block: int, error: Exception) -> None:
        if (store, version, block) not in self.unreadable_logged:
            self.unreadable_logged.add((store, version, block))
            log.error("store %r: block %d cannot be read (%s); rows that need it are %s", store, block, error,
                      "answered by computing it" if self.on_load_error == "recompute" else "failed")

    @torch.inference_mode()
    def logits(self, plans: list[QueryPlan]) -> list[torch.Tensor]:
        """Each plan's query logits [T_query, vocab] (fp32) from one batched prefill, for exactness checks."""
        return Batch(self, keep_all=True).prefill_logits(plans)


def release_version(store: MiloStore, name: str, version: str) -> None:
    """Close a replaced version once nothing holds its `MountedStore` (no plan, no row)."""
    store.close()
    log.info("store %r: version %s released (no request uses it any more)", name, version)


@dataclass(eq=False)
class Row:
    plan: QueryPlan  # as submitted
    executed: QueryPlan  # as run: unreadable blocks computed instead (`MountedStore.without_blocks`)
    decoder: object  # a `decoding` decoder: allowed(), accept(token), done, text(), result()
    pages: list[int]  # its page table: column c lives at pages[c // PAGE_TOKENS]
    window_pages: list[int] | None  # its window layers' page table (None: they use ``pages``)
    admission: "Admission"
    seconds: dict
    fed: int = 0  # tokens of executed.query_ids fed so far
    next_position: int = 0  # RoPE position (and column) of the next decoded token fed
    first_token_seconds: float = 0.0
    last_token: int = -1
    sent: int = 0  # characters of text already given out as deltas
    cancelled: bool = False
    device_pages: dict = field(default_factory=dict, repr=False)
    held: list[tuple[HeldBlock, int]] = field(default_factory=list)  # the held blocks it places, each at its offset
    # (none: it holds its own copy of its whole prefix)
    own_from: int = 0  # its first own column: where its own blocks, packed before its query, start when it places
    # held blocks (its prefix's end when it holds none of its own)
    rebuilt: BlockPlacement | None = None  # what its admission rebuilds into its own pages (None: nothing)
    sampler: RowSampler = field(default_factory=RowSampler)  # how it chooses its tokens (its own generator)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its chosen tokens', where its request asks
    linear: RowState = field(default_factory=RowState)  # a hybrid's linear layers' state for it (`linear_rows`)

    def waits_for(self) -> list["Admission"]:
        """The admissions whose rebuilds must fill before its first forward: its own, and its held blocks' builders."""
        return [self.admission, *(a for block, _ in self.held for a in block.builders)]

    def pages_on_device(self, device, window: bool = False) -> torch.Tensor:
        if window not in self.device_pages:
            pages = self.window_pages if window else self.pages
            self.device_pages[window] = torch.tensor(pages, dtype=torch.long, device=device)
        return self.device_pages[window]

    def window_pages_held(self) -> list[int]:
        """Every page of its window layers' table once (the spill page among them)."""
        return list(dict.fromkeys(self.window_pages or ()))

    @property
    def finished(self) -> bool:
        return self.decoder.done or self.cancelled

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.executed.query_ids)


@dataclass(eq=False)
class Admission:
    """Rows seated together: their blocks were read as one union, and what they need rebuilt (the prefixes of rows
    holding their own, then the held blocks new to the batch: ``blocks``) is rebuilt into its pages by the first
    forward that feeds any row that waits for it (None: nothing to rebuild). Once rebuilt (or given up) it lets go
    of its rows, blocks and rebuild (`settle`): its rows still point at it, and a cycle would keep them, their plans
    (an old store version among them) and the staged factors alive until the garbage collector ran."""
    rebuild: PrefixRebuild | None
    rows: list[Row]
    clock: StageClock
    started: float
    filled: bool = False
    bytes_moved_each: int = 0  # each row's share of the bytes its fetch moved
    builds: list["Build"] = field(default_factory=list)  # the held blocks (or their layers) it writes

    def fill(self, windowed: bool) -> PrefixFill:
        """Its rebuild's destinations, in its placements' order: rows holding their own prefixes, then held blocks."""
        own = [row for row in self.rows if row.rebuilt is not None]
        blocks = [build.block for build in self.builds]
        rows = ([(row.pages, row.executed.prefix_tokens, row.rebuilt.block_positions() if row.own_from else None)
                 for row in own] + [(b.pages, b.tokens, None) for b in blocks])
        window = ([(row.window_pages, row.executed.prefix_tokens, None) for row in own]
                  + [(b.window_pages, b.tokens, None) for b in blocks]) if windowed else None
        linear = [row.linear for row in own] + [None] * len(blocks) if self.rebuild is not None else []
        return PrefixFill(self.rebuild, rows, window, linear)

    def settle(self) -> None:
        if self.rows and self.rebuild is not None:
            self.bytes_moved_each = self.rebuild.fetch_stats["bytes"] // len(self.rows)
        for build in self.builds:
            build.block.builders.remove(self)
        self.rows, self.rebuild, self.builds = [], None, []


@dataclass(frozen=True)
class Seat:
    """A waiting plan given pages: submitted and as executed, its page tables, the held blocks it places and, when it
    places any, which of its blocks (indices into ``executed.blocks``) it keeps in its own pages."""
    plan: QueryPlan
    executed: QueryPlan
    pages: list[int]
    window_pages: list[int] | None
    held: list[tuple[HeldBlock, int]]
    own: tuple[int, ...] = ()

    @property
    def own_from(self) -> int:
        """Its first own column: 0 holding its whole prefix, else where its own blocks start, before its query."""
        return own_start(self.executed, self.own) if self.held else 0

    @functools.cached_property
    def rebuilt(self) -> BlockPlacement | None:
        """What its admission rebuilds into its own pages: its whole prefix, its own blocks, or nothing."""
        if not self.held:
            return self.executed.placement
        return self.executed.placement.only(list(self.own)) if self.own else None


class Batch:
    """A running batch, used from one thread, over a `PagedCache` of ``engine.group_pages`` pages, made when its first
    row is seated and kept (no pool is ever copied or resized: pages are taken and given back). ``admit``
    seats rows whose pages fit (at most ``engine.max_rows`` rows) and reads their blocks (plans that do not
    fit wait, oldest first; one that could never fit ends at once with a `RequestError`); ``step`` runs one
    forward that feeds every running row's next token and the next chunk (at most ``settings.prefill_chunk``
    tokens in all) of the rows being prefilled, rebuilding the prefixes of rows fed for the first time; a
    finished or cancelled row gives its pages back at once. With ``engine.shared_blocks`` the blocks worth it and the
    store's anchor are held once for every row that places them (``held``: `milo_infer.runtime.shared_blocks`) and
    a row's own pages hold its other blocks, its query and its answer. ``fetch_stats`` describes the last admission,
    ``peak_kv_bytes`` the most K/V it needed at once: the columns its seated rows need (each row's context and
    answer budget, a held block's once) and, in a forward that rebuilds prefixes, the factors staged for it (the
    transfer buffers on CUDA, a layer of gathered factors on CPU), ``kv_bytes_needed`` the columns alone;
    ``kv_bytes_allocated`` the bytes of the pages its rows reached (up to the highest page handed out: on a CPU, what
    of its pools, made at the budget, was ever written and so is resident), ``kv_bytes_held`` the most its pages in
    use took (held blocks no row holds any more among them); ``most_held`` the most distinct blocks it held at once
    and the most block placements its rows made at once; ``steps`` counts its forwards.
    ``keep_all`` keeps the logits of every fed query token (``query_logits``)."""

    def __init__(self, engine: Engine, keep_all: bool = False):
        self.engine, self.keep_all = engine, keep_all
        self.rows: list[Row] = []  # rows holding pages
        self.waiting: list[QueryPlan] = []  # plans admitted that did not fit yet
        self.executing: dict[int, QueryPlan] = {}  # id(waiting plan) -> what it executes, where not the plan itself
        # the full layers' pages (every layer's without windows) and the window layers' (each its share of the budget)
        self.pages = PageGroups(engine.group_page_bytes, engine.group_pages)
        self.cache: PagedCache | None = None
        self.admissions: list[Admission] = []  # not yet rebuilt
        self.held = HeldBlocks(self.pages, engine.window_layers)
        self.seatings = 0  # `_seat` calls so far: when a held block was last placed
        self.fetch_stats: dict = {}
        self.unreadable_blocks = 0  # blocks the last admission could not read
        self.peak_kv_bytes = 0
        self.kv_bytes_allocated = 0
        self.kv_bytes_needed = 0
        self.kv_bytes_held = 0
        self.most_held = {"held_blocks": 0, "placed_blocks": 0, "held_placements": 0}
        self.steps = 0
        self.query_logits: dict[int, torch.Tensor] = {}  # id(plan) -> [T_query, vocab] fp32, with keep_all

    def __len__(self) -> int:
        """Rows not finished, including those still waiting for pages or for their prefill."""
        return len(self.waiting) + sum(not row.finished for row in self.rows)

    # -- admission -----------------------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, plans: list[QueryPlan]) -> list[RowEvent]:
        """Seat rows whose pages fit and read their blocks (their prefixes are rebuilt and their queries
        prefilled by the next steps); the others wait for pages. Returns the error events of rows that cannot
        run (a block that could not be read; more pages than the whole budget)."""
        events = []
        for p in plans:
            try:
                self.engine.check_fits(p)
                self.waiting.append(p)
            except RequestError as err:
                events.append(RowEvent(p, "", True, "error", error=err))
        return events + self._seat()

    def _seat(self) -> list[RowEvent]:
        """Give pages to waiting plans, oldest first while they fit, and read what they need rebuilt as one union."""
        e = self.engine
        seated: list[Seat] = []
        builds: dict[HeldBlock, Build] = {}
        self.seatings += 1
        placing = Counter((x.placement.prefix, b) for x in map(self._executed, self.waiting) for b in set(x.blocks))
        while self.waiting and len(self.rows) + len(seated) < e.max_rows:
            plan = self.waiting[0]
            seat = self._take(plan, self._executed(plan), builds, placing)
            if seat is None:
                break
            self.executing.pop(id(self.waiting.pop(0)), None)
            seated.append(seat)
        if not seated:
            return []
        clock, started = StageClock(e.device), time.perf_counter()
        seated, rebuild, events = self._read(seated, builds, clock)
        if not seated:
            return events
        self._ready_pools()
        admission = Admission(rebuild, [], clock, started, filled=rebuild is None, builds=list(builds.values()))
        for build in admission.builds:
            build.block.builders.append(admission)
        for seat in seated:
            p, x = seat.plan, seat.executed
            decoder = (p.form.decoder(e.tokenizer, p.max_new_tokens) if p.form is not None else
                       FreeDecoder(e.tokenizer, p.request.stop, p.max_new_tokens, p.request.ending, STOP_STRINGS))
            admission.rows.append(Row(p, x, decoder, seat.pages, seat.window_pages, admission,
                                      {"retrieve": p.retrieve_seconds}, next_position=x.prompt_tokens,
                                      held=seat.held, own_from=seat.own_from, rebuilt=seat.rebuilt,
                                      sampler=RowSampler(p.request.sampling, prompt=p.prompt_ids)))
        placed = [b for s in seated for b in s.executed.blocks]
        self.fetch_stats = {**(rebuild.fetch_stats if rebuild is not None else dict.fromkeys(FETCH_STATS, 0)),
                            "rows": len(seated), "blocks": len(placed),
                            "unique_blocks": len({(s.executed.mount, b) for s in seated for b in s.executed.blocks}),
                            "unreadable_blocks": self.unreadable_blocks,
                            "bytes_without_union": sum(s.executed.placement.kv_bytes_stored for s in seated)}
        self.rows += admission.rows
        if rebuild is not None:
            self.admissions.append(admission)
        else:  # every block it places is held and written already
            admission.settle()
        return events

    def _executed(self, plan: QueryPlan) -> QueryPlan:
        """What a waiting plan executes: itself, or it computing blocks that could not be read."""
        return self.executing.get(id(plan), plan)

    def _take(self, plan: QueryPlan, executed: QueryPlan, builds: dict, placing: Counter) -> "Seat | None":
        """Pages for ``executed``'s row and the held blocks it places (those new to the batch, or new at some window
        layer, join ``builds``), or None when they do not fit even once the blocks no row holds are let go.
        ``placing``: how many waiting plans place each (store prefix, block)."""
        need = pages_for(executed.prompt_tokens + executed.max_new_tokens)
        kept = self._kept(executed, placing) if self._may_share(executed) else set()
        if kept:
            own = tuple(i for i in range(len(executed.blocks)) if i not in kept)
            wanted = self._placed_blocks(executed, kept)
            skip = own_start(executed, own) // PAGE_TOKENS  # pages wholly before its own columns: none of them its own
            if self.held.fits(need - skip, wanted):
                pages = self.pages.take(FULL, need - skip)
                window = own_table(self.pages.take(WINDOW, need - skip), skip) if self.pages.windowed else None
                return Seat(plan, executed, own_table(pages, skip), window,
                            self.held.hold(wanted, builds, self.seatings), own)
            if self.held.fits(need - skip, wanted, now=False):  # fits the budget, not now: it waits
                return None
            # more than the budget holds as blocks in pages: as a row of its own (that fits: `check_fits`)
        skip = self._window_skip(executed)
        while not self.pages.fits(self.pages.row_pages(need, skip)):
            if not self.held.let_go(set()):
                return None
        return Seat(plan, executed, self.pages.take(FULL, need), self.pages.take_window(need, skip), [])

    def _may_share(self, plan: QueryPlan) -> bool:
        """Its row may place held blocks: sharing is on and it recomputes none of its prefix. It does where a block of
        it is worth holding once (`_kept`); a row that would share none holds its own copy, as every row did before: a
        lone query (or one whose blocks no other row has) is answered exactly as before, one attention call a layer
        over its own columns, not one per block (docs/benchmarks.md, issue 54)."""
        return (self.engine.shared_blocks and plan.prefix_tokens > 0 and plan.mount is not None
                and not len(plan.recompute))

    def _kept(self, plan: QueryPlan, placing: Counter) -> set[int]:
        """Which of ``plan``'s blocks (indices into its blocks) its row attends held once: those held already, and
        those the waiting plans place often enough to be worth it (`HeldBlocks.worth_holding`). A model with window
        layers holds all of a row's blocks once one is held or another row places it (its own columns are its
        positions there: none can be packed)."""
        prefix = plan.placement.prefix
        if not self.engine.holds_what_pays:
            shares = any((prefix, b) in self.held or placing[prefix, b] > 1 for b in plan.blocks)
            return set(range(len(plan.blocks))) if shares else set()
        tokens = plan.placement.block_tokens()
        return {i for i, b in enumerate(plan.blocks)
                if (prefix, b) in self.held or self.held.worth_holding(placing[prefix, b], int(tokens[i]))}

    def _placed_blocks(self, plan: QueryPlan, kept) -> list[tuple[tuple, int, int, frozenset]]:
        """(held key, offset, tokens, layers its row attends it at) of the anchor and each block of ``plan`` its row
        attends held (``kept``: indices into its blocks), in context order. The anchor is held at every layer (a page
        or so): a fill always finds its destination."""
        e, prefix = self.engine, plan.placement.prefix
        ends = plan.placement.block_ends()
        L = len(e.layers)
        return [((prefix, None), 0, prefix.anchor_len, frozenset(range(L)))] + [
            ((prefix, b), int(dst), int(end - dst), layers_reached(e.windows, L, int(dst), int(end - dst),
                                                                   plan.prefix_tokens))
            for i, (b, dst, end) in enumerate(zip(plan.blocks, plan.placement.dst_rows, ends)) if i in kept]

    def _release(self, seat: "Seat") -> None:
        """A seat taken and not run: its pages back, its blocks one row fewer."""
        self.pages.give(FULL, seat.pages)
        self.pages.give(WINDOW, seat.window_pages)
        for block, _ in seat.held:
            block.rows -= 1

    def _read(self, seated: list["Seat"], builds: dict, clock: StageClock):
        """Read what ``seated`` need rebuilt as one union: rows holding their own prefixes, then the held blocks in
        ``builds``. Where it cannot be read, its blocks are read one by one to find the unreadable ones; a row needing
        one recomputes it (`MountedStore.without_blocks`: a row holding its own prefix keeps its seat; a row placing
        held blocks lets them go and is seated as one holding its own, or waits first in line where that does not fit
        now) or fails with `BlockLoadError`, as the engine's ``on_load_error`` says; the other rows load as planned.
        Returns the seats left, the rebuild (None: nothing to rebuild) and an error event per row that cannot run."""
        e = self.engine
        self.unreadable_blocks = 0
        try:
            return seated, self._fetch(seated, builds, clock), []
        except UNREADABLE:
            pass
        wanted: dict[MountedStore, list[int]] = {}  # each mounted version's blocks
        for s in seated:
            wanted.setdefault(s.executed.mount, []).extend(s.executed.blocks)
        unreadable = {mounted: mounted.prefix.unreadable(blocks) for mounted, blocks in wanted.items()}
        kept, failed, own = [], [], []
        for s in seated:
            p = s.executed
            bad = {b: err for b, err in unreadable[p.mount].items() if b in p.blocks}
            for b, err in bad.items():
                e.report_unreadable(p.store, p.mount.version, b, err)
            if not bad:
                kept.append(s)
            elif e.on_load_error == "fail":
                self._release(s)
                b, err = next(iter(bad.items()))
                error = BlockLoadError(f"store {p.store!r}: block {b} cannot be read ({err})")
                error.__cause__ = err
                failed.append(RowEvent(s.plan, "", True, "error", error=error))
            elif s.held:  # a row of its own from now on, which computes them
                self._release(s)
                own.append((s.plan, p.mount.without_blocks(p, set(bad))))
            else:
                kept.append(self._recomputing(s, p.mount.without_blocks(p, set(bad))))
        bad_keys = {(mounted.prefix, b) for mounted, found in unreadable.items() for b in found}
        for block, build in list(builds.items()):  # never written: gone, or back to the layers it had
            if block.key in bad_keys or (build.created and not block.rows):
                del builds[block]
                if build.created:
                    self.held.drop(block)
                else:
                    block.layers -= build.layers
        again = []
        for plan, executed in own:  # seated now where its pages fit, else first in line
            seat = self._take(plan, executed, builds, Counter())
            if seat is not None:
                kept.append(seat)
            else:
                again.append((plan, executed))
        self.waiting[:0] = [plan for plan, _ in again]
        self.executing.update((id(plan), executed) for plan, executed in again)
        self.unreadable_blocks = sum(len(found) for found in unreadable.values())
        return kept, (self._fetch(kept, builds, clock) if kept else None), failed

    def _recomputing(self, seat: "Seat", executed: QueryPlan) -> "Seat":
        """``seat`` (a row holding its own prefix) executing ``executed``, which computes blocks instead of reading
        them: that moves the row's first fed token back, so its window layers' pages start where it reaches."""
        skip = self._window_skip(executed)
        if self.pages.windowed and skip < self._window_skip(seat.executed):
            self.pages.give(WINDOW, seat.window_pages)
            return replace(seat, executed=executed, window_pages=self.pages.take_window(len(seat.pages), skip))
        return replace(seat, executed=executed)

    def _fetch(self, seated: list["Seat"], builds: dict, clock: StageClock) -> PrefixRebuild | None:
        """Read the union of the blocks to rebuild (raises what an unreadable block raises): each own row's prefix,
        then each held block in ``builds``, in that order (`Admission.fill`)."""
        e = self.engine
        placements = ([s.rebuilt for s in seated if s.rebuilt is not None]
                      + [build.block.placement(build.layers, len(e.layers)) for build in builds.values()])
        if not placements:
            return None
        return PrefixRebuild(placements, e.rope, e.device, depth=e.prefetch_depth, tier=e.device_tier,
                             pools=e.transfers, rebuild=e.rebuild, clock=clock)

    def _ready_pools(self) -> None:
        """The pools, made at the budget's pages for the first row (never again: rows only take and give pages), with
        the pages handed out for the first time zeroed. A flex batch's attention is handed the pages up to the
        highest handed out, in powers of two (`flex_pool_pages`): few compiled shapes, and block masks no wider than
        the rows reach."""
        e, reached = self.engine, self.pages.reached()
        if self.cache is None:
            self.cache = PagedCache(e.layers, e.dtype, e.device, self.pages.capacities(), e.window_layers)
        self.cache.zero_reached(reached)
        if e.attention == "flex":
            self.cache.attended = {group: flex_pool_pages(pages, self.pages[group].capacity) * PAGE_TOKENS
                                   for group, pages in reached.items()}
        self.kv_bytes_allocated = max(self.kv_bytes_allocated, self.pages.bytes_of(reached))

    def _window_skip(self, plan: QueryPlan) -> int:
        """Pages of ``plan``'s row its window layers never attend (0 without window layers of their own)."""
        if not self.pages.windowed:
            return 0
        return window_skip(int(plan.positions[0]) if len(plan.query_ids) else 0, self.engine.window_span)

    # -- the step ------------------------------------------------------------------------------
    def cancel(self, plan: QueryPlan) -> None:
        """The row of ``plan`` leaves now, giving its pages back (a client that went away)."""
        self.waiting = [p for p in self.waiting if p is not plan]
        self.executing.pop(id(plan), None)
        for row in self.rows:
            if row.plan is plan:
                row.cancelled = True
        self._free_finished()

    def _pack(self, held: set) -> tuple[Pack, list[tuple[Row, int, int]]]:
        """This forward's tokens: each running row's last token, then rows being prefilled, oldest first, while
        the prefill chunk lasts. Returns the pack and (row, tokens fed, where they start in it)."""
        e = self.engine
        budget, at = e.settings.prefill_chunk, 0
        segments, columns, fed = [], [], []
        window_segments, window_columns = [], []
        placing: list[tuple[Row, torch.Tensor, int, int]] = []  # rows placing held blocks: tokens' places there
        shared = 0
        for row in self.rows:
            if row.finished or row in held:
                continue
            if row.prefilling:
                n = min(budget, len(row.executed.query_ids) - row.fed)
                if not n:
                    continue
                budget -= n
                span = row.executed.positions[row.fed:row.fed + n]
                positions, keys = torch.from_numpy(span), int(span[-1]) + 1
            else:  # the keys from the host's own count: reading a tensor back is a sync where it is on a device
                n, positions, keys = 1, torch.tensor([row.next_position]), row.next_position + 1
            # a token sees the columns up to its own position: the prefix before it (recomputed columns already
            # hold their fresh K/V when it comes) and the row's tokens fed before it
            mask = None if n == 1 else (torch.arange(keys)[None, :] <= positions[:, None]).to(e.device)
            shared_at = None
            if row.held:
                shared_at, shared = shared, shared + n
                placing.append((row, positions, at, shared_at))
            segments.append(Segment(row.pages, row.pages_on_device(e.device), own_run(row.pages, row.own_from), at,
                                    at + n, keys, positions, mask, row.own_from, shared_at))
            columns.append(pool_columns(row.pages, positions))
            if row.window_pages is not None:
                window_segments.append(Segment(row.window_pages, row.pages_on_device(e.device, window=True),
                                               own_run(row.window_pages, row.own_from), at, at + n, keys, positions,
                                               mask, row.own_from, shared_at))
                window_columns.append(pool_columns(row.window_pages, positions))
            fed.append((row, n, at))
            at += n

        def pack_of(segments, columns, window: bool) -> Pack:
            return Pack(segments, torch.cat(columns).to(e.device) if columns else torch.zeros(0, dtype=torch.long),
                        attention=e.attention, held=self._held_queries(placing, window) if placing else None)
        pack = pack_of(segments, columns, False)
        if e.linear:
            pack.linear = [(row.linear, at, at + n) for row, n, at in fed]
        if self.pages.windowed:
            pack.window, pack.window_layers = pack_of(window_segments, window_columns, True), e.window_layers
        return pack, fed

    def _held_queries(self, placing, window: bool) -> HeldQueries:
        """Every (token, held block) pair of ``placing``'s rows, grouped by block: what their attention at one page
        group's layers reads (at the window layers' only the blocks held there)."""
        e = self.engine
        uses: dict[HeldBlock, list] = {}
        for row, positions, _, shared_at in placing:
            for block, offset in row.held:
                if not window or block.window_pages is not None:
                    uses.setdefault(block, []).append((shared_at, offset, positions))
        token, offset, position, blocks, start = [], [], [], [], 0
        for block, pairs in uses.items():
            for shared_at, p, positions in pairs:
                n = len(positions)
                token.append(np.arange(shared_at, shared_at + n))
                offset.append(np.full(n, p))
                position.append(positions.numpy())
            stop = start + sum(len(positions) for _, _, positions in pairs)
            blocks.append(block.columns(window, start, stop, e.device))
            start = stop
        packed = np.concatenate([np.arange(at, at + len(positions)) for _, positions, at, _ in placing])
        offset_host = torch.from_numpy(np.concatenate(offset) if offset else np.zeros(0, np.int64))
        return HeldQueries(packed=torch.from_numpy(packed).to(e.device), blocks=blocks,
                           token=torch.from_numpy(np.concatenate(token) if token else np.zeros(0, np.int64)).to(e.device),
                           offset=offset_host.to(e.device), offset_host=offset_host,
                           position_host=torch.from_numpy(np.concatenate(position) if position else np.zeros(0, np.int64)),
                           rope=e.rope, layers=e.layers)

    def _forward(self, pack: Pack, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 joining: list[Row]) -> torch.Tensor:
        """One model call over the packed ``ids`` [1, T] at ``positions`` through the paged cache, rebuilding the
        prefixes of ``joining`` rows' admissions first; logits [K, V] at the ``keep`` indices."""
        e = self.engine
        todo = list(dict.fromkeys(a for row in joining for a in row.waits_for() if not a.filled))
        pack.fills = [a.fill(self.pages.windowed) for a in todo]
        staged = sum(a.rebuild.fetch_stats["buffer_bytes"] for a in todo)
        self._count_held(staged)
        self.cache.pack, self.cache.updated = pack, 0
        for state, _, _ in pack.linear:  # what a failed forward left is not kept
            state.pending = {}
        try:
            with e.paged_attention():
                out = e.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=keep,
                              milo_pack=pack, **{e.cache_kwarg: self.cache})
        finally:
            self.cache.pack = None
        for state, _, _ in pack.linear:
            state.commit()
        self.steps += 1
        if self.cache.updated != self.cache.writers:
            raise RuntimeError(f"the model did not use the milo cache (transformers {transformers.__version__} "
                               f"ignored {e.cache_kwarg}=): the answer would have no retrieved context")
        for a in todo:
            a.filled = True
        return out.logits[0]

    @torch.inference_mode()
    def step(self) -> list[RowEvent]:
        """One forward: every running row's next token and the next prefill chunk; an event for each row that
        chose a token (or ended). Rows joining in it whose rebuild the device has no memory for are put off
        to a later step in halves; one that fails alone ends with `AdmissionOutOfMemory`."""
        events = self._seat()
        e = self.engine
        held: set = set()
        while True:
            pack, fed = self._pack(held)
            if not fed:
                self._free_finished()
                return events
            ids = torch.tensor([t for row, n, _ in fed for t in self._feed(row, n)], device=e.device)[None]
            positions = torch.cat([s.positions for s in pack.segments]).to(e.device)[None]
            keep, kept = [], []
            for row, n, at in fed:
                ends = not row.prefilling or row.fed + n == len(row.executed.query_ids)
                rows_keep = (list(range(at, at + n)) if self.keep_all and row.prefilling else [at + n - 1] if ends else [])
                kept.append((len(keep), len(rows_keep), ends))
                keep += rows_keep
            joining = [row for row, _, _ in fed if row.fed == 0]
            t = time.perf_counter()
            try:
                logits = self._forward(pack, ids, positions, torch.tensor(keep, dtype=torch.long, device=e.device),
                                       joining).float().cpu()
                break
            except torch.OutOfMemoryError:
                if not joining:
                    raise
                if len(joining) == 1:
                    row = joining[0]
                    row.cancelled = True
                    error = AdmissionOutOfMemory(f"the device ({e.device}) has no memory for this request's "
                                                 f"{row.plan.prompt_tokens}-token context now")
                    events.append(RowEvent(row.plan, "", True, "error", error=error))
                else:
                    held |= set(joining[len(joining) // 2:])
        now = time.perf_counter()
        rebuilt = [a for a in dict.fromkeys(row.admission for row, _, _ in fed) if a.filled and a in self.admissions]
        prefix_seconds = 0.0
        for a in rebuilt:  # the admission's read, transfer, wait and rebuild, shared by its rows
            self.admissions.remove(a)
            seconds = a.clock.read()
            prefix_seconds += seconds.get("wait", 0.0) + seconds.get("rebuild", 0.0)
            for row in a.rows:
                for stage, s in seconds.items():
                    row.seconds[stage] = row.seconds.get(stage, 0.0) + s / len(a.rows)
            a.settle()
        model_share = max(0.0, now - t - prefix_seconds) / len(fed)
        for (row, n, _), (first, count, ends) in zip(fed, kept):
            row.seconds["model"] = row.seconds.get("model", 0.0) + model_share
            if not row.prefilling:
                row.next_position += 1
            else:
                if self.keep_all:
                    self.query_logits.setdefault(id(row.plan), []).append(logits[first:first + count])
                row.fed += n
                if ends:
                    row.first_token_seconds = row.plan.retrieve_seconds + now - row.admission.started
            if ends:
                events.append(self._advance(row, logits[first + count - 1]))
        self._free_finished()
        return events

    def _needed_bytes(self, row: Row) -> int:
        """Bytes of K/V ``row``'s columns take: its context and answer budget at every full layer, and at each
        window layer those from the first page its windows reach (and its spill page)."""
        columns = row.executed.prompt_tokens + row.executed.max_new_tokens
        if row.own_from:  # its own blocks, query and answer: the others are counted once, with the held blocks
            return self.pages.bytes_of(dict.fromkeys(self.pages.groups, columns - row.own_from)) // PAGE_TOKENS
        return self.pages.bytes_of(self.pages.row_columns(columns, self._window_skip(row.executed))) // PAGE_TOKENS

    @staticmethod
    def _feed(row: Row, n: int) -> list[int]:
        return row.executed.query_ids[row.fed:row.fed + n] if row.prefilling else [row.last_token]

    def prefill_logits(self, plans: list[QueryPlan]) -> list[torch.Tensor]:
        """Each plan's logits over what its forward fed (recomputed tokens, then the query), through the same
        reads and steps as an admission; a row that cannot run raises its error."""
        failed = self.admit(plans)
        if failed:
            raise failed[0].error
        while self.waiting or any(row.prefilling for row in self.rows):
            for event in self.step():
                if event.error is not None:
                    raise event.error
        return [torch.cat(self.query_logits[id(p)]) for p in plans]

    def _advance(self, row: Row, logits: torch.Tensor) -> RowEvent:
        """The row's next token, chosen from its ``logits`` among those its decoder allows as its sampler says, and
        its event; a row whose own work raises ends alone, with `RowFailed`."""
        try:
            (token,), (logprob,) = choose(logits[None], [row.sampler], [row.decoder.allowed()], [row.decoder.ids])
            row.decoder.accept(token)
            row.last_token, text = token, row.decoder.text()
        except Exception as err:  # a decoder's fault is this row's alone: the batch and the others go on
            row.cancelled = True
            failure = RowFailed(f"decoding this request failed: {type(err).__name__}: {err}")
            failure.__cause__ = err
            return RowEvent(row.plan, "", True, "error", error=failure)
        delta, row.sent = text[row.sent:], len(text)
        logprobs = [logprob] if logprob is not None else None
        if logprob is not None:
            row.logprobs.append(logprob)
        if not row.decoder.done:
            return RowEvent(row.plan, delta, False, logprobs=logprobs)
        p, x, reason = row.plan, row.executed, "length" if row.decoder.stop == "length" else "stop"
        answer = Answer(text=row.decoder.result().text.strip(), blocks=p.blocks, groups=p.groups,
                        prefix_tokens=p.prefix_tokens, kv_bytes_full=p.placement.kv_bytes_full,
                        kv_bytes_stored=p.placement.kv_bytes_stored, seconds=dict(row.seconds),
                        kv_bytes_moved=row.admission.bytes_moved_each,
                        completion_tokens=len(row.decoder.ids), finish_reason=reason,
                        first_token_seconds=row.first_token_seconds, prefill_tokens=len(x.query_ids),
                        recomputed_blocks=[b for b in p.blocks if b not in x.blocks],
                        logprobs=row.logprobs if p.request.sampling.logprobs is not None else None)
        return RowEvent(p, delta, True, reason, answer, logprobs=logprobs)

    def held_counts(self) -> dict:
        """Now: the K/V bytes of the pages rows hold (``kv_bytes_held``: their own, and the held blocks they place,
        each once), of the held blocks no row holds any more, kept for the next rows until their pages are needed
        (``kv_bytes_kept``), the distinct blocks rows hold (``held_blocks``, anchors not counted), the blocks the
        running rows place (``placed_blocks``: rows × k) and how many of those placements they attend in a held copy
        (``held_placements``; the others are in the rows' own pages)."""
        kept = self.held.kept_bytes()
        running = [r for r in self.rows if not r.finished]
        return {"kv_bytes_held": self.pages.in_use_bytes() - kept, "kv_bytes_kept": kept,
                "held_blocks": self.held.held_blocks(),
                "placed_blocks": sum(len(r.executed.blocks) for r in running),
                "held_placements": sum(block.block is not None for r in running for block, _ in r.held)}

    def _count_held(self, staged: int) -> None:
        """The most K/V bytes this batch needed and held, and blocks it held and placed, counted at this step: the
        columns rows need (each held block's once), with the factors ``staged`` for this step's rebuilds."""
        needed = sum(self._needed_bytes(r) for r in self.rows) + self.held.held_bytes()
        self.kv_bytes_needed = max(self.kv_bytes_needed, needed)
        self.peak_kv_bytes = max(self.peak_kv_bytes, needed + staged)
        now = self.held_counts()
        self.kv_bytes_held = max(self.kv_bytes_held, now["kv_bytes_held"])
        self.most_held = {name: max(self.most_held[name], now[name]) for name in self.most_held}



    def _free_finished(self) -> None:
        """Finished and cancelled rows let go of their held blocks and give their pages back (nothing else moves),
        except the pages of a row with blocks of its own whose admission is still to be rebuilt: that rebuild writes
        every one of its rows' pages, so they wait for it. An admission all of whose rows ended and none of whose
        blocks a row holds is given up: a block it was to create is never written, so no row may find it (it goes once
        no other rebuild writes to it). The pools and the blocks no row holds stay (`idle`)."""
        for row in self.rows:
            if row.finished:
                self._let_go(row)
        self._leave([row for row in self.rows if row.finished and row.own_from and row.rebuilt is None])
        given_up = [a for a in self.admissions
                    if all(row.finished for row in a.rows) and not any(b.block.rows for b in a.builds)]
        for a in given_up:
            self.admissions.remove(a)
            for build in a.builds:
                if build.created:
                    self.held.retire(build.block)
                else:
                    build.block.layers -= build.layers
            a.settle()
        self.held.free_retired()
        self._leave([row for row in self.rows if row.finished and row.admission not in self.admissions])

    def _leave(self, leaving: list[Row]) -> None:
        """These rows give their pages back and let go of their held blocks."""
        for row in leaving:
            self.pages.give(FULL, row.pages)
            self.pages.give(WINDOW, row.window_pages_held())
            self._let_go(row)
        self.rows = [row for row in self.rows if row not in leaving]

    @staticmethod
    def _let_go(row: Row) -> None:
        """``row`` holds its held blocks no more (its ``own_from`` still says where its own columns start)."""
        for block, _ in row.held:
            block.rows -= 1
        row.held = []


    def idle(self) -> None:
        """Nothing to answer for a while (an idle server's loop, `milo_infer.server.scheduler`): the held blocks no row
        holds go (a store version swapped out is then released). The pools stay: the next rows take their pages."""
        self.held.drop_cached()


def own_start(executed: QueryPlan, own) -> int:
    """The first own column of a row placing held blocks that keeps its blocks ``own`` (indices into
    ``executed.blocks``) in its own pages: they are packed, in context order, just before its query."""
    return executed.prefix_tokens - int(executed.placement.block_tokens()[list(own)].sum())


def model_windows(config) -> list[int | None] | None:
    """Each layer's sliding window (None: full), or None when no layer has one (or the family is not described:
    a test's stand-in model), so such a model plans exactly as before."""
    spec = FAMILIES.get(getattr(config, "model_type", None))
    windows = spec.windows(config) if spec is not None else None
    return windows if windows and any(w is not None for w in windows) else None


def query_turns(config) -> bool:
    """Whether a row's query turned back by a block's offset attends a block held at 0..T-1 exactly (its family's
    keys are a rotation of what the store keeps); a model whose family is not described (a test's stand-in) is taken
    to rotate as Llama's does."""
    spec = FAMILIES.get(getattr(config, "model_type", None))
    return spec is None or spec.query_turns


def cache_keyword(model) -> str:
    """The name under which this model's forward takes a cache: transformers 5 renamed
    ``past_key_values`` to ``cache`` between 5.17 and 5.24, and passes an unknown name on silently."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
