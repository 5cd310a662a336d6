"""Blocks held once against each row's own copy (issue 54), side by side in one run: answers, queries/s, K/V held.

For each ``--batch`` size, the same ``--queries`` test queries of a data set (or the demo corpus's) are answered
``batch`` at a time by two engines over the same store, one with `Engine(shared_blocks=True)` and one with
``False``, their batches alternating over ``--rounds`` rounds: each engine's median queries/s, the ratio, the most
K/V bytes its batches' rows held, the distinct blocks held against the blocks placed then, the most placements
attended in a held copy (the others in rows' own pages), and how many answers are equal. Batch 1 is a lone query
(each answered alone; a batch keeps nothing across `Engine.answer` calls). Run:

    MILO_DATA=../shared/data HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_shared_blocks.py STORE --dataset banking77 \\
        --queries 100 --batch 1,16,64 --threads 1
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.models import load_model  # noqa: E402
from milo_infer.runtime.engine import Engine  # noqa: E402
from milo_infer.runtime.planning import EngineSettings  # noqa: E402
from milo_infer.tasks.corpus import load_corpus  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_store import MiloStore  # noqa: E402

DEMO = ROOT / "milo_infer/tasks/data/demo_corpus.jsonl"
MODES = {"on": True, "off": False}


def answer_all(engine: Engine, texts: list[str], batch: int) -> tuple[float, list[str], dict]:
    """Every text answered ``batch`` at a time: wall seconds, the answers, and the stats of all the batches."""
    from milo_infer.runtime.planning import Request

    stats, answers, start = {}, [], time.perf_counter()
    for i in range(0, len(texts), batch):
        answers += [a.text for a in engine.answer([engine.plan("s", Request(t)) for t in texts[i:i + batch]], stats)]
    return time.perf_counter() - start, answers, stats


def measure(engines: dict[str, Engine], texts: list[str], batch: int, rounds: int) -> dict:
    seconds = {mode: [] for mode in engines}
    answers, stats = {}, {}
    for _ in range(rounds):
        for mode, engine in engines.items():  # alternating: the machine's noise falls on both
            wall, answers[mode], stats[mode] = answer_all(engine, texts, batch)
            seconds[mode].append(wall)
    qps = {mode: len(texts) / statistics.median(s) for mode, s in seconds.items()}
    return {"batch": batch, "queries": len(texts), "qps": qps, "ratio": qps["on"] / qps["off"],
            "kv_bytes_held": {m: s["kv_bytes_held"] for m, s in stats.items()},
            "held_blocks": stats["on"]["held_blocks"], "placed_blocks": stats["on"]["placed_blocks"],
            "held_placements": stats["on"]["held_placements"],
            "equal": sum(a == b for a, b in zip(answers["on"], answers["off"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--dataset", default=None, help="ask this data set's test queries (MILO_DATA; default: the demo "
                                                    "corpus's inputs)")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--batch", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; medians (default 1)")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--model", default="default", help="the model the store was built with (default: the default model)")
    ap.add_argument("--kv-cache-memory", type=int, default=8 << 30, help="each engine's KV budget in bytes (default 8 GiB)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = ([d.input for d in load_dataset(args.dataset, shuffle=False)[1]] if args.dataset
             else [d.input for d in load_corpus(DEMO)])[:args.queries]
    loaded = load_model(args.model)
    with MiloStore.open(args.store) as store:
        rows = []
        for batch in args.batch:
            engines = {mode: Engine(loaded, {"s": store}, EngineSettings(k=args.k), max_rows=batch,
                                    kv_cache_memory=args.kv_cache_memory, shared_blocks=shared)
                       for mode, shared in MODES.items()}
            rows.append(measure(engines, texts, batch, args.rounds))
            print(f"batch {batch}: done", file=sys.stderr, flush=True)
    print(f"store {args.store}, k {args.k}, {len(texts)} queries, {args.threads} thread(s), {args.rounds} round(s)")
    print("| batch | q/s held once | q/s own copies | ratio | K/V MiB held once | K/V MiB own copies | held / own "
          "| blocks held / placed | placements held once | equal answers |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        held = r["kv_bytes_held"]
        print(f"| {r['batch']} | {r['qps']['on']:.2f} | {r['qps']['off']:.2f} | {r['ratio']:.2f} | "
              f"{held['on'] / 2**20:.0f} | {held['off'] / 2**20:.0f} | {held['on'] / held['off']:.2f} | "
              f"{r['held_blocks']} / {r['placed_blocks']} | {r['held_placements']} | "
              f"{r['equal']} of {r['queries']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
