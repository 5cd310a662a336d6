"""End-to-end throughput of answering from offloaded K/V: full-KV offload against MILO.

Every method answers the same queries through `MiloSession` (retrieve k blocks, read their factors,
move them to the compute device, rebuild K/V, prefill the query and decode a label), from stores of
one encoding whose bytes are measured, never computed:

* ``full``: the identity-codec fp16 store with its K/V *copied* into the cache and keys rotated, the
  work a full-KV offload does; ``full-gemm``: the same store rebuilt by the kernel as X·I (what the
  unmodified pipeline does with an identity store, kept to show what that costs);
* ``milo-r<ρ>``: SVD factors at ratio ρ, rebuilt by `milo_kernels.reconstruct_layer`;
* ``prefill`` (``prefill=True``): what a user does without milo: the same retrieval, and the model prefills each
  row's retrieved demonstrations' tokens (the store's token ids) before the query; nothing is read or rebuilt.
  Its time to first token is the one milo's rebuild should beat most.

Methods run interleaved, round after round, and each figure is the median over rounds, so drifting
load on a shared machine hits all methods alike. Beside them, in the same run: the raw bandwidth of
the transfer path (memcpy and page-cache preadv on CPU, pinned and pageable H2D on CUDA) and the
rebuild time of one retrieval by the literal reference vs the routed kernel. From these the report
derives the bound on speedup (the bytes ratio, ≈ 1/ρ) and the crossover: the link bandwidth below
which moving fewer bytes pays for the extra reconstruction.

The session the methods run in is `TimedSession` (below: `MiloSession` whose identity store can be copied
into the cache instead of rebuilt, the full-KV baseline; stage times come from the engine, CUDA events on
CUDA, named by `STAGES` as reports show them). Around this module: `report` (the markdown table and the
plot) and `synthetic_model` (the same workload without a real model or
corpus: random weights of a given shape, a byte-level tokenizer, synthetic K/V, for tests and GPU runs
without downloads).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from milo_kernels import reconstruct_layer
from milo_kernels.cpu import rope
from milo_store import CompressionConfig, MiloStore

from ..building.config import BuildConfig, default_compression
from ..building.shared_staging import encode_once
from ..models import LoadedModel
from ..runtime.attention import compiled_graphs
from ..runtime.pages import PAGE_TOKENS, pages_for
from ..runtime.prefetch import LayerPrefetcher
from ..runtime.session import MiloSession
from ..tasks.corpus import Demonstration, TaskSpec


# --- the timed session ---------------------------------------------------------------------------

STAGES = ("retrieve", "read", "transfer", "rebuild", "model")


class TimedSession(MiloSession):
    """`MiloSession` for the benchmark: ``copy_identity`` replaces the rebuild of an identity store by a
    copy (the full-KV baseline), composed into the engine as its ``rebuild``."""

    def __init__(self, loaded, store, *, copy_identity: bool = False, **kwargs):
        if copy_identity and store.meta.get("codec") != "identity":
            raise ValueError(f"{store.path}: copy_identity needs an identity-codec store")
        super().__init__(loaded, store, **({"rebuild": copy_identity_layer} if copy_identity else {}), **kwargs)


def copy_identity_layer(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, rotary_dim=None,
                        **_) -> None:
    """The full-KV baseline's fill: an identity segment's A is X itself, so per kind gather every segment's
    rows in one cat, rotate the keys, and scatter all rows to their (head, row) in one indexed write: a
    handful of launches a layer, as a real offload's copy would be."""
    d = out_k.shape[-1]
    segs = segments.cpu()
    for kind, out in ((0, out_k), (1, out_v)):
        mine = segs[segs[:, 5] == kind]
        if not len(mine):
            continue
        src, _, tokens, dst, head, _ = mine.unbind(1)
        x = torch.cat([factors[s:s + t * d].view(t, d) for s, t in zip(src.tolist(), tokens.tolist())])
        within = torch.arange(int(tokens.sum())) - torch.repeat_interleave(torch.cumsum(tokens, 0) - tokens, tokens)
        where = torch.stack([torch.repeat_interleave(dst, tokens) + within, torch.repeat_interleave(head, tokens)])
        if out.is_cuda:  # a pageable upload would wait for the compute stream, every layer
            where = where.pin_memory().to(out.device, non_blocking=True)
        rows, heads = where
        if kind == 0:
            x = rope(x.float(), cos[rows], sin[rows], interleaved, rotary_dim=rotary_dim)
        out[heads, rows] = x.to(out.dtype)


# --- methods and stores --------------------------------------------------------------------------

def method_names(ratios, prefill: bool = False) -> list[str]:
    return ["full", "full-gemm"] + (["prefill"] if prefill else []) + [f"milo-r{r:g}" for r in ratios]


def store_configs(ratios, query_aware: bool = True) -> dict[str, CompressionConfig]:
    """Store directory name -> configuration: one identity store serves both full methods; MILO's stores
    are what `milo build` writes at each ratio (`default_compression`). Without query-aware weights (a
    synthetic store has no model to weigh channels by) the same policy and quantization run unweighted."""
    configs = {"full": CompressionConfig(codec="identity", ratio=1.0, dtype="float16")}
    configs.update({f"milo-r{r:g}": dataclasses.replace(default_compression(r, codec="svd"), query_aware=query_aware)
                    for r in ratios})
    return configs


def store_of(method: str) -> str:
    """The store a method answers from (prefill: the full store's retrieval and token ids)."""
    return "full" if method.startswith("full") or method == "prefill" else method


def real_stores(root, loaded: LoadedModel, demos: list[Demonstration], task: TaskSpec, ratios,
                block_size: int = 32, context_blocks: int = 2) -> dict[str, Path]:
    """Build (or reuse) every method's store from one encoding of ``demos``."""
    base = BuildConfig(block_size=block_size, context_blocks=context_blocks)
    summaries = encode_once(loaded, demos, task, base, store_configs(ratios), root, progress=False)
    return {name: Path(s["store"]) for name, s in summaries.items()}


# --- measuring -----------------------------------------------------------------------------------

def measure(sessions: dict[str, TimedSession], queries: list[str], k: int, batch: int, rounds: int,
            progress=None) -> list[dict]:
    """One row per method: medians over ``rounds`` of the same queries answered ``batch`` at a time (real
    batches: one forward per step for all rows), methods interleaved. Besides the per-query stage times, the
    same stages per forward (``ms_per_step``), the KV bytes the batches' pools allocated beside what their rows
    needed, and on CUDA the device memory allocated at most while the method ran. ``progress`` gets a line per
    method and round, with its seconds and the graphs torch.compile made meanwhile (what a stalled GPU run shows)."""
    samples = {name: [] for name in sessions}
    chunks = [queries[i:i + batch] for i in range(0, len(queries), batch)]
    device_peak = {name: 0 for name in sessions}
    for round_ in range(rounds):
        for name, s in sessions.items():
            s.k = k
            graphs = compiled_graphs()
            if s.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(s.device)
            answers, stats, t = [], {}, time.perf_counter()
            for chunk in chunks:
                answers += s.engine.answer([s.plan(q) for q in chunk], stats)
            wall = time.perf_counter() - t
            if s.device.type == "cuda":
                device_peak[name] = max(device_peak[name], torch.cuda.max_memory_allocated(s.device))
            samples[name].append((wall, sum(a.completion_tokens for a in answers), answers, stats))
            if progress is not None:
                progress(f"bench:   k={k} batch={batch} round {round_ + 1}/{rounds} {name}: {wall:.1f} s, "
                         f"{stats['steps']} forwards, {compiled_graphs() - graphs} graphs compiled")
    rows = []
    for name, runs in samples.items():
        n = len(queries)
        per_query = {stage: [] for stage in STAGES}
        per_step = {stage: [] for stage in STAGES}
        for _, _, answers, stats in runs:
            for stage in STAGES:
                total = sum(a.seconds.get(stage, 0.0) for a in answers)  # a prefill row reads nothing
                per_query[stage].append(total / n)
                per_step[stage].append(total / stats["steps"])
        answers, stats = runs[0][2], runs[0][3]
        moved = statistics.mean(a.kv_bytes_moved for a in answers)
        transfer = statistics.median(per_query["transfer"])
        wall = statistics.median(r[0] for r in runs)
        rows.append({
            "method": name, "k": k, "batch": batch, "queries": n,
            "qps": n / wall, "tok_s": statistics.median(r[1] for r in runs) / wall,
            "tokens_per_query": statistics.median(r[1] for r in runs) / n,
            "first_token_ms": 1e3 * statistics.median(statistics.median(a.first_token_seconds for a in r[2])
                                                      for r in runs),
            "ms": {stage: 1e3 * statistics.median(v) for stage, v in per_query.items()},
            "bytes_moved": moved, "bytes_without_union": statistics.mean(a.kv_bytes_stored for a in answers),
            "unique_block_share": stats["unique_blocks"] / stats["blocks"] if stats["blocks"] else 1.0,
            "peak_kv_bytes": stats["peak_kv_bytes"], "kv_bytes_needed": stats["kv_bytes_needed"],
            "kv_bytes_allocated": stats["kv_bytes_allocated"], "kv_bytes_held": stats["kv_bytes_held"],
            "held_blocks": stats["held_blocks"], "placed_blocks": stats["placed_blocks"],
            "staged_bytes": stats["staged_bytes"],
            "steps": statistics.median(r[3]["steps"] for r in runs),
            "ms_per_step": {stage: 1e3 * statistics.median(v) for stage, v in per_step.items()},
            "device_peak_bytes": device_peak[name] or None,
            "bytes_full_kv": statistics.mean(a.kv_bytes_full for a in answers),
            "transfer_gbps": moved / transfer / 1e9 if transfer > 0 else float("nan"),
            "answers": [a.text for a in answers],
        })
    base = next(r for r in rows if r["method"] == "full")
    for r in rows:
        r["ratio"] = r["bytes_moved"] / base["bytes_moved"]
        r["speedup"] = r["qps"] / base["qps"]
    return rows


def median_seconds(fn, repeat: int, sync=lambda: None, warmup: int = 0) -> float:
    """Median wall seconds of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones; ``sync()`` before and
    after each (a device's queue drained), so the clock holds the work itself."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def link_bandwidth(store: MiloStore, device: torch.device, nbytes: int, repeat: int = 5) -> dict[str, float]:
    """GB/s of the transfer path for ``nbytes`` (one query's full-KV bytes), measured now.

    CPU: a host memcpy, and a preadv of the store's chunk files from the page cache (the disk tier's
    read). CUDA: host-to-device copies from pinned and from pageable memory.
    """
    size = store.stored_itemsize  # what the store's offsets count (bytes for a bits store), not the decoded factors'
    n = max(1, min(nbytes, int(store.offsets[-1]) * size) // size)
    src = torch.randn(n).to(store.stored_torch_dtype)
    out = {}
    if device.type == "cuda":
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
        dst = torch.empty_like(src, device=device)
        pinned = src.pin_memory()
        out["H2D pinned"] = median_seconds(lambda: dst.copy_(pinned, non_blocking=True), repeat, sync)
        out["H2D pageable"] = median_seconds(lambda: dst.copy_(src), repeat, sync)
    else:
        dst = torch.empty_like(src)
        out["memcpy"] = median_seconds(lambda: dst.copy_(src), repeat, lambda: None)
        store.read_range(0, n, dst)  # warm the page cache
        out["preadv (page cache)"] = median_seconds(lambda: store.read_range(0, n, dst), repeat, lambda: None)
    return {name: n * size / s / 1e9 for name, s in out.items()}


def kernel_speedup(session: TimedSession, block_ids: list[int], repeat: int = 3) -> dict[str, float]:
    """Seconds to rebuild every layer of one retrieval through `reconstruct_layer` (validation included):
    the reference backend (the literal oracle) vs the device's own path (batched CPU, or Triton)."""
    store, layout, dev = session.store, session.layout, session.device
    prefetch = LayerPrefetcher(store, block_ids, dev)
    tokens = store.block_tokens[block_ids]
    dst = np.concatenate(([0], np.cumsum(tokens)[:-1])).astype(np.int64)
    layers = []
    for l in range(layout.num_layers):
        factors, starts = prefetch.layer(l)
        layers.append((factors.clone(), torch.from_numpy(layout.layer_segments(l, store.ranks[block_ids, l], tokens,
                                                                              dst, starts))))
    engine = session.engine
    outs = {(spec.kv_heads, spec.head_dim): [torch.empty(spec.kv_heads, int(tokens.sum()), spec.head_dim,
                                                         dtype=engine.dtype, device=dev) for _ in range(2)]
            for spec in layout.layers if spec.holds_cache}
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def run(backend):
        for l, (factors, segments) in enumerate(layers):
            spec = layout.layers[l]
            if spec.holds_cache:
                reconstruct_layer(factors, segments, *outs[spec.kv_heads, spec.head_dim], *engine.rope.layer(l),
                                  **spec.rope_layout(), quant=layout.quant, backend=backend)

    times = {}
    for name, backend in (("reference", "reference"), ("kernel", "auto")):  # "auto": the device's own kernel
        run(backend)  # warm up (Triton compiles on first use)
        times[name] = median_seconds(lambda: run(backend), repeat, sync)
    return times


def largest_batch(session: TimedSession, query: str, k: int) -> int:
    """The most rows like ``query``'s plan at ``k`` that the engine's KV budget seats at once: each its whole context
    and answer, or, with blocks held once, its query and answer beside every block of the store held once."""
    session.k = k
    plan = session.plan(query)
    engine = session.engine
    if not engine.shared_blocks:
        return max(1, engine.kv_pages // pages_for(plan.prompt_tokens + plan.max_new_tokens))
    store = session.mounted.prefix
    held = pages_for(store.anchor_len) + sum(pages_for(int(t)) for t in store.store.block_tokens)
    own = pages_for(plan.prompt_tokens + plan.max_new_tokens) - plan.prefix_tokens // PAGE_TOKENS
    return max(1, (engine.kv_pages - held) // own)


def run_bench(loaded: LoadedModel, store_paths: dict[str, Path], queries: list[str], *, ks=(2, 4, 8), batches=(1, 4),
              rounds: int = 3, ratios=(0.5, 0.25), tier: str = "host", device=None, max_batch: int = 256,
              kv_cache_memory: int | float | None = None, attention: str = "auto", shared_blocks: bool = True,
              progress=print, on_batch=None, prefill: bool = False) -> dict:
    """Every (k, batch) × method, the transfer path's raw bandwidth and the kernel's speedup; one report. A batch
    of ``"max"`` is the most rows of the largest k that fit the KV budget (at most ``max_batch``); a batch
    larger than the queries answers them over again. ``kv_cache_memory``, ``attention`` and ``shared_blocks`` are the
    engines' (`Engine`). ``on_batch`` gets the report so far after each (k, batch), its ``partial`` saying how much (the
    link, kernel and crossover figures come at the end), so a run cut short leaves what it measured. ``prefill``:
    the ``prefill`` method too (its stores must keep their token ids)."""
    stores = {name: MiloStore.open(path, tier=tier) for name, path in store_paths.items()}
    try:
        started, graphs = time.perf_counter(), compiled_graphs()
        ks = sorted({min(k, stores["full"].num_blocks) for k in ks})
        probe = TimedSession(loaded, stores["full"], device=device, kv_cache_memory=kv_cache_memory, attention=attention,
                             shared_blocks=shared_blocks)
        fits = min(max_batch, largest_batch(probe, queries[0], max(ks)))
        del probe
        batches = list(dict.fromkeys(fits if b == "max" else b for b in batches))
        sessions = {m: TimedSession(loaded, stores[store_of(m)], device=device, copy_identity=m == "full",
                                    max_rows=max(batches), kv_cache_memory=kv_cache_memory, attention=attention,
                                    shared_blocks=shared_blocks, prefill=m == "prefill")
                    for m in method_names(ratios, prefill)}
        first = next(iter(sessions.values()))
        dev = first.device
        for s in sessions.values():  # warm up: first-touch allocations, lazy imports, kernel compilation
            s.k = max(ks)
            s.answer(queries[0])
        progress(f"bench: warm-up (one query per method) in {time.perf_counter() - started:.1f} s, "
                 f"{compiled_graphs() - graphs} graphs compiled; batches {batches}")
        report = {"rows": [], "device": str(dev), "model": loaded.identity["name"],
                  "layout": dataclasses.asdict(first.layout), "store_blocks": first.store.num_blocks,
                  "block_tokens": first.store.block_tokens.tolist(), "tier": tier, "rounds": rounds,
                  "threads": torch.get_num_threads(), "ratios": list(ratios), "largest_batch": fits,
                  "kv_budget_bytes": first.engine.kv_budget, "attention": first.engine.attention,
                  "shared_blocks": first.engine.shared_blocks}
        sweep = [(k, b) for k in ks for b in batches]
        for done, (k, b) in enumerate(sweep, 1):
            started, graphs = time.perf_counter(), compiled_graphs()
            asked = [queries[i % len(queries)] for i in range(max(b, len(queries)))]
            # untimed, one method: each chunk size's shapes compiled (FlexAttention's, shared by the methods) and
            # pools first touched, so no method's time holds a compile (with one round the first method's would)
            first.k = k
            for size in dict.fromkeys(len(asked[i:i + b]) for i in range(0, len(asked), b)):
                first.engine.answer([first.plan(q) for q in asked[:size]])
            progress(f"bench: k={k} batch={b} warm-up in {time.perf_counter() - started:.1f} s, "
                     f"{compiled_graphs() - graphs} graphs compiled")
            report["rows"] += measure(sessions, asked, k, b, rounds, progress)
            progress(f"bench: k={k} batch={b} done in {time.perf_counter() - started:.1f} s, "
                     f"{compiled_graphs() - graphs} graphs compiled ({compiled_graphs()} in all)")
            if on_batch is not None:
                on_batch({**report, "rows": list(report["rows"]),
                          "partial": f"{done} of {len(sweep)} (k, batch) measured"})
        rows = report["rows"]
        top = [r for r in rows if r["k"] == max(ks) and r["batch"] == batches[0]]
        full_bytes = next(r["bytes_full_kv"] for r in top if r["method"] == "full")
        link = link_bandwidth(stores["full"], dev, int(full_bytes))
        first.k = max(ks)
        blocks = first.select(queries[0])
        kernels = {m: kernel_speedup(sessions[m], blocks) for m in sessions if m.startswith("milo")}
        return {**report, "link_gbps": link, "kernel_s": kernels, "crossover": crossover(top)}
    finally:
        for s in stores.values():
            s.close()


def crossover(rows: list[dict]) -> dict[str, dict]:
    """Per MILO method, the link bandwidth at which its saved bytes pay for its extra rebuild time.

    Moving B bytes over a link of bandwidth W costs B/W; MILO saves (B_full − B_milo)/W of transfer and
    spends (rebuild_milo − rebuild_full) more on reconstruction, so it wins on links slower than
    W* = (B_full − B_milo) / (rebuild_milo − rebuild_full). Rebuild times are the measured ones of the
    full copy and of MILO's kernel on this device, per query.
    """
    full = next(r for r in rows if r["method"] == "full")
    out = {}
    for r in rows:
        if not r["method"].startswith("milo"):
            continue
        saved = full["bytes_moved"] - r["bytes_moved"]
        extra = (r["ms"]["rebuild"] - full["ms"]["rebuild"]) / 1e3
        out[r["method"]] = {"bytes_saved": saved, "extra_rebuild_s": extra,
                            "crossover_gbps": saved / extra / 1e9 if extra > 0 else float("inf")}
    return out
