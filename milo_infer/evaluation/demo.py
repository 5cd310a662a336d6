"""The main job on embedded defaults: build a store from the shipped demo corpus with the default
model (once), then answer the shipped demo queries from it and, beside each answer, the full cache's
answer to the same query, with the K/V bytes of each.

What the demo shows is agreement with the full cache at a fraction of its bytes: the full cache is
an uncompressed (identity, fp16) store of the same encoding, answering from the same retrieved
blocks. Whether an answer matches the query's expected label is secondary: a 135M model with 4 of 8
blocks in context gets many wrong with or without compression.

Run: ``make demo`` (or ``python -m milo_infer.evaluation.demo [--store PATH] [--ratio 0.5] [--rebuild]``); the
full cache's store is PATH-full beside it.
"""
import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

from milo_store import MiloStore
from milo_store.report import describe

from ..building.config import BuildConfig, default_compression
from ..tasks.corpus import DEMO_CORPUS, DEMO_QUERIES, Demonstration, load_corpus, task_from_corpus
from .methods import method_config
from ..models import load_model
from ..tasks.scoring import is_correct
from ..runtime.session import MiloSession
from ..building.shared_staging import encode_once
from ..runtime.planning import EngineSettings


@dataclass(frozen=True)
class Comparison:
    """One demo query answered from the compressed store and from the full cache."""

    query: str
    expected: str
    answer: str
    full_answer: str
    kv_bytes: int  # what the compressed store's answer read
    full_kv_bytes: int  # the full cache of the blocks the full answer used: their fp16 K/V

    @property
    def agrees(self) -> bool:
        return self.answer == self.full_answer


def compare(session: MiloSession, full: MiloSession, queries: list[Demonstration]) -> list[Comparison]:
    """Each query (its input, and its output the expected label) answered by ``session`` and by ``full``."""
    rows = []
    for q in queries:
        a, f = session.answer(q.input), full.answer(q.input)
        rows.append(Comparison(q.input, q.output, a.text, f.text, a.kv_bytes_stored, f.kv_bytes_full))
    return rows


def render(rows: list[Comparison]) -> str:
    """A table of the answers beside the full cache's, then agreement and bytes; expected labels last."""
    width = max(len(r.query) for r in rows)
    lines = [f"{'query':<{width}}  {'answer':<24} {'full cache':<24} same  KV MiB (fp16)   expected",
             "-" * (width + 88)]
    for r in rows:
        lines.append(f"{r.query:<{width}}  {r.answer!r:<24} {r.full_answer!r:<24} {'yes' if r.agrees else 'NO ':<4}  "
                     f"{r.kv_bytes / 2**20:5.2f} ({r.full_kv_bytes / 2**20:5.2f})  {r.expected!r}"
                     f"{'' if is_correct(r.answer, r.expected, 'label') else ' (missed)'}")
    agree = sum(r.agrees for r in rows)
    read, full = sum(r.kv_bytes for r in rows), sum(r.full_kv_bytes for r in rows)
    hits = sum(is_correct(r.answer, r.expected, "label") for r in rows)
    full_hits = sum(is_correct(r.full_answer, r.expected, "label") for r in rows)
    lines += ["",
              f"agreement with the full cache: {agree}/{len(rows)} answers the same, reading "
              f"{read / len(rows) / 2**20:.2f} MiB of K/V per query where the full cache holds "
              f"{full / len(rows) / 2**20:.2f} MiB of fp16 K/V ({read / full:.2f}x)",
              f"expected labels (secondary): {hits}/{len(rows)} from the store, {full_hits}/{len(rows)} from the full cache"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=os.environ.get("MILO_DEMO_STORE", "stores/demo"))
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rebuild", action="store_true", help="write the stores again even if they exist")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    loaded = load_model("default")
    print(f"model: {loaded.identity['name']} ({loaded.identity['num_layers']} layers, "
          f"{loaded.identity['num_kv_heads']} KV heads, head dim {loaded.identity['head_dim']}), "
          f"loaded in {time.perf_counter() - t:.1f} s")
    store_path = Path(args.store)
    names = {"store": store_path.name, "full": f"{store_path.name}-full"}
    demos = load_corpus(DEMO_CORPUS)
    t = time.perf_counter()
    summaries = encode_once(loaded, demos, task_from_corpus(demos), BuildConfig(block_size=32, context_blocks=2),
                            {names["store"]: default_compression(args.ratio), names["full"]: method_config("full", 1.0)},
                            store_path.parent, reuse=not args.rebuild)
    for name, s in summaries.items():
        print(f"store: {'reusing' if s.get('reused') else 'built'} {s['store']}")
    if not all(s.get("reused") for s in summaries.values()):
        print(f"  from {len(demos)} demonstrations (ratio {args.ratio}) in {time.perf_counter() - t:.0f} s")
    with (MiloStore.open(store_path, tier="host") as store,
          MiloStore.open(store_path.parent / names["full"], tier="host") as full_store):
        info = describe(store)
        b = info["bytes"]
        print(f"  {info['blocks']} blocks, {info['demonstrations']} demonstrations; KV full {b['full_fp16_kv'] / 2**20:.1f} "
              f"MiB, stored {b['accounted'] / 2**20:.1f} MiB (ratio {info['actual_ratio']:.3f}, planned "
              f"{info['planned_ratio']})\n")
        rows = compare(MiloSession(loaded, store, settings=EngineSettings(k=args.k)), MiloSession(loaded, full_store, settings=EngineSettings(k=args.k)),
                       load_corpus(DEMO_QUERIES))
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
