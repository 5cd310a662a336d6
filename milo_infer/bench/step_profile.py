"""Where a decode step's time goes in the paged engine (issue 47): the step's wall time split into stages.

Each stage is the wall time spent inside the engine functions that do its work, less what those called of
another stage (exclusive time, so the stages add up to the step):

- ``scheduler``: building the step's pack (each row's segment, positions, mask and pool columns) and freeing
  finished rows (`Batch._pack`, `Batch._free_finished`);
- ``admission``: seating waiting rows and reading their blocks (`Batch._seat`), less the pool setup;
- ``pool_setup``: making the pools at the budget (a batch's first admission) and zeroing the pages handed out
  for the first time (`Batch._ready_pools`; no pool is ever copied, issue 73);
- ``prefix_rebuild``: rebuilding joining rows' prefixes into their pages (`PagedLayer.fill`);
- ``pool_writes``: writing the new tokens' K/V to their pool columns (`PagedLayer.update`, less the rebuild);
- ``gathers``: the per-row attention loop less its SDPA calls: a view of a row's columns when its pages are
  consecutive, a gather of its scattered pages when not (`attention.sdpa_rows`);
- ``row_sdpa``: the SDPA calls themselves, one per row and layer (a row placing held blocks: its own columns'
  part, `attention.partial_attention`);
- ``held_blocks``: the held blocks' part for every row placing them (`attention.Merge.finish`: the queries turned,
  one product per held block, the merge by log-sum-exp);
- ``model``: the rest of the model's forward: projections, MLP, norms, RoPE, the LM head, transformers' Python;
- ``decoding``: choosing each row's next token (`Batch._advance`);
- ``engine``: the rest of `Batch.step` (the ids and positions tensors, logits to the host, bookkeeping).

Two batches: rows decoding for ever (`decoding_batch`: on consecutive pages, or all on scattered ones), and a
served batch whose finished rows are replaced at once (`profile_churn`). Wall time on a shared machine is noisy: read the shares, not the seconds. The wrappers cost a few
microseconds a call (about rows × layers × 2 calls a step), counted in the stage that made the call.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ..runtime import attention, cache, engine
from ..runtime.pages import FULL, run_start
from ..runtime.planning import Request

STAGES = ("scheduler", "admission", "pool_setup", "prefix_rebuild", "pool_writes", "gathers", "row_sdpa",
          "held_blocks", "model", "decoding", "engine")
TIMED = [  # (owner, attribute, stage)
    (engine.Batch, "step", "engine"),
    (engine.Batch, "_pack", "scheduler"),
    (engine.Batch, "_free_finished", "scheduler"),
    (engine.Batch, "_seat", "admission"),
    (engine.Batch, "_forward", "model"),
    (engine.Batch, "_advance", "decoding"),
    (engine.Batch, "_ready_pools", "pool_setup"),
    (cache.PagedLayer, "fill", "prefix_rebuild"),
    (cache.PagedLayer, "update", "pool_writes"),
    (attention, "sdpa_rows", "gathers"),
    (torch.nn.functional, "scaled_dot_product_attention", "row_sdpa"),
    (attention, "partial_attention", "row_sdpa"),
    (attention.Merge, "finish", "held_blocks"),
]


class StageClock:
    """Exclusive wall seconds per stage, and calls, while ``timing()`` is active."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.calls = dict.fromkeys(STAGES, 0)
        self._children: list[float] = []  # per open call: seconds its callees took

    def wrap(self, function, stage: str):
        def timed(*args, **kwargs):
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._children.pop()
                self.seconds[stage] += elapsed - inner
                self.calls[stage] += 1
                if self._children:
                    self._children[-1] += elapsed
        return timed

    @contextlib.contextmanager
    def timing(self):
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in TIMED]
        try:
            for (owner, name, stage), (_, _, function) in zip(TIMED, saved):
                setattr(owner, name, self.wrap(function, stage))
            yield self
        finally:
            for owner, name, function in saved:
                setattr(owner, name, function)


class Endless:
    """A decoder that never stops: every step feeds each row one more token, so a timed batch keeps its size."""
    done, ids = False, ()

    def allowed(self) -> None:
        return None

    def accept(self, token: int) -> None:
        pass

    def text(self) -> str:
        return ""


def reversed_pages(batch) -> None:
    """Every row this batch seats gets its pages in reverse order: none is one run, so the attention gathers each
    row's columns and the rebuild scatters its prefix (what a row on the pages other rows gave back gets)."""
    full = batch.pages[FULL]
    take = full.take
    full.take = lambda n: take(n)[::-1]


def decoding_batch(eng, store: str, texts: list[str], rows: int, scattered: bool = False):
    """``rows`` rows of ``store`` past their prefill, decoding for ever; ``scattered``: on reversed pages."""
    batch = eng.batch()
    if scattered:
        reversed_pages(batch)
    batch.admit([eng.plan(store, Request(texts[i % len(texts)])) for i in range(rows)])
    for row in batch.rows:
        row.decoder = Endless()
    while any(row.prefilling for row in batch.rows):
        batch.step()
    return batch


class Churn:
    """A served batch: ``rows`` rows answering for real (their own decoders), each finished one replaced at once by
    the next text's plan, so steps mix decoding with admissions, prefix rebuilds, prefill chunks and pool setup,
    and rows take the pages others gave back. Made past the first ``rows`` rows' admission and prefill."""

    def __init__(self, eng, store: str, texts: list[str], rows: int, steps: int):
        self.eng, self.store, self.rows = eng, store, rows
        self.queue = iter(texts * (1 + (rows + steps * rows) // max(1, len(texts))))
        self.batch = eng.batch()
        self.batch.admit([eng.plan(store, Request(next(self.queue))) for _ in range(rows)])
        while any(row.prefilling for row in self.batch.rows):
            self.batch.step()
        self.wall, self.seen, self.scattered, self.answers = 0.0, 0, 0, []

    def step(self) -> None:
        """Replace the rows that left, then one step; its wall time (admission and step, not the retrieval: a
        server's, before a row reaches the batch) is added to ``wall``, finished answers to ``answers``."""
        plans = [self.eng.plan(self.store, Request(next(self.queue))) for _ in range(self.rows - len(self.batch))]
        start = time.perf_counter()
        events = self.batch.admit(plans) if plans else []
        events += self.batch.step()
        self.wall += time.perf_counter() - start
        self.answers += [e.answer.text for e in events if e.finished and e.answer is not None]
        self.seen += len(self.batch.rows)
        self.scattered += sum(run_start(row.pages) is None for row in self.batch.rows)


def profile_churn(eng, store: str, texts: list[str], rows: int, steps: int) -> dict:
    """``steps`` steps of a served batch (`Churn`) timed by stage, as `profile_steps`; ``scattered``: the share of
    decoding rows whose pages are not one run."""
    churn, clock = Churn(eng, store, texts, rows, steps), StageClock()
    with clock.timing():
        for _ in range(steps):
            churn.step()
    return {"step": churn.wall, "seconds": clock.seconds, "calls": clock.calls, "rows": rows, "steps": steps,
            "scattered": churn.scattered / max(1, churn.seen)}


def profile_steps(batch, steps: int) -> dict:
    """``steps`` steps of ``batch`` timed by stage: {"step": wall seconds of all, "seconds": {stage: s},
    "calls": {stage: n}, "rows": rows decoding}."""
    clock = StageClock()
    with clock.timing():
        start = time.perf_counter()
        for _ in range(steps):
            batch.step()
        wall = time.perf_counter() - start
    return {"step": wall, "seconds": clock.seconds, "calls": clock.calls, "rows": len(batch.rows), "steps": steps}
