"""Warming a server's engine before it says it is ready (issue 55): compiled attention compiles each shape bucket the
first time traffic reaches it (FlexAttention on an H200: 7 graphs at batch 32, seconds each), so a server that
answered at once ran its first 16-client level at 2.4 q/s and the same level right after at 20.7.

Warming drives the engine as traffic does, without knowing what the attention compiles: per mounted store and for
each batch size of 1, 2, 4, ... rows (up to the bound), a batch admits that many requests of the store's own
demonstrations (real blocks), runs their prefill and a few decode steps and drops them, then, the pages its
rows reached still handed to the attention (a busy server's reach only grows while rows come and go), does the
same with half as many rows, a quarter, ... one. Whatever shapes that takes (rows, tokens and pool pages in powers
of two), traffic then finds compiled: at most (log2 max_batch + 1)(log2 max_batch + 2) / 2 batches of two shapes
each per store. A shape it never took (a query long enough for the next token bucket) is compiled under traffic and counted
(`milo:compiled_graphs_after_warmup`).
"""
from __future__ import annotations

import logging
import time

from ..runtime.attention import compiled_graphs
from ..runtime.planning import Request

log = logging.getLogger("milo.serve")
WARMUP_MODES = ("auto", "all", "none")
DECODE_STEPS = 2  # decode steps each warming batch runs past its prefill (a decode step's shapes differ from it)


def warm_sizes(max_batch: int, bound: int | None = None) -> list[int]:
    """The batch sizes warmed: powers of two up to ``max_batch`` (at most ``bound``), and that size itself."""
    top = min(max_batch, bound or max_batch)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return sizes + ([top] if sizes[-1] != top else [])


def should_warm(mode: str, attention: str) -> bool:
    """``auto`` warms compiled attention only (``flex``): the per-row SDPA loop compiles nothing, so warming it
    would only delay the start."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"warm-up mode must be one of {', '.join(WARMUP_MODES)}, got {mode!r}")
    return mode == "all" or (mode == "auto" and attention == "flex")


def warm_engine(engine, sizes: list[int], decode_steps: int = DECODE_STEPS) -> dict:
    """Run ``engine`` (milo's `Engine`) through batches of each of ``sizes`` rows per store, as described in
    the module's docstring; nothing it admits is answered to anyone. Returns {"seconds", "graphs" (compiled
    meanwhile), "batches", "failed": [why a batch failed, ...]}: a batch that fails (a request that cannot fit
    the KV budget alone) is logged and skipped, warming goes on."""
    started, graphs = time.perf_counter(), compiled_graphs()
    batches, failed = 0, []
    for name, mounted in engine.stores.items():
        inputs = mounted.store.example_array("input") if mounted.store.num_examples() else []
        texts = [str(t) for t in inputs[:4 * max(sizes)] if str(t).strip()] or ["warm up"]
        for size in sizes:
            try:
                batch = engine.batch()
                for rows in halvings(size):
                    plans = [engine.plan(name, Request(texts[(batches + i) % len(texts)])) for i in range(rows)]
                    run_until_decoded(batch, plans, decode_steps)
                    batches += 1
                batch.idle()
            except Exception as e:  # warming must not stop a server that traffic may well serve
                failed.append(f"store {name!r}, {size} rows: {type(e).__name__}: {e}")
                log.warning("warm-up: a batch of %d rows of store %r failed (%s: %s); warming goes on", size, name,
                            type(e).__name__, e)
    return {"seconds": time.perf_counter() - started, "graphs": compiled_graphs() - graphs, "batches": batches,
            "failed": failed}


def halvings(rows: int) -> list[int]:
    """``rows``, then each power of two below it: the row counts a batch serves once its rows reached the pages of
    ``rows`` (a busy server's attention keeps that reach while rows come and go)."""
    return [rows] + [1 << i for i in reversed(range(rows.bit_length())) if 1 << i < rows]


def run_until_decoded(batch, plans, decode_steps: int) -> None:
    """Admit ``plans`` into ``batch``, step until every row has decoded ``decode_steps`` tokens past its prefill
    (or finished), then drop them; the batch's pools stay, as a busy server's do."""
    events = batch.admit(plans)
    for event in events:
        if event.error is not None:
            raise event.error
    decoded = dict.fromkeys(map(id, plans), 0)
    while len(batch) and min(decoded.values()) < decode_steps:
        for event in batch.step():
            if event.error is not None:
                raise event.error
            decoded[id(event.plan)] = decode_steps if event.finished else decoded[id(event.plan)] + 1
    for plan in plans:
        batch.cancel(plan)
