"""The engine in bf16 against fp32 on this CPU: seconds per query at batch 1 and at batch 8, and the answers.

The same store, queries and settings through two engines that differ only in the model's dtype (the
K/V rebuilt into the paged cache follow it); rounds interleaved, medians. The answers of the batch-8
runs are compared: agreement between the dtypes, and each one's accuracy on the Banking77 test labels.
Run (one torch thread, nothing else running):

    MILO_DATA=/work/shared/data HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_dtype.py STORE --queries 64 --threads 1
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
from milo_infer.runtime.planning import EngineSettings, Request  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_infer.tasks.scoring import is_correct  # noqa: E402
from milo_store import MiloStore  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(engine: Engine, texts: list[str], batch: int) -> tuple[float, list[str]]:
    """Seconds per query answering ``texts`` in batches of ``batch``, and the answers."""
    answers, start = [], time.perf_counter()
    for i in range(0, len(texts), batch):
        answers += [a.text for a in engine.answer([engine.plan("s", Request(t)) for t in texts[i:i + batch]])]
    return (time.perf_counter() - start) / len(texts), answers


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--queries", type=int, default=64, help="test queries answered at batch 8 (agreement, accuracy)")
    ap.add_argument("--alone", type=int, default=8, help="of which this many are timed at batch 1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="default", help="the model the store was built with (default: the default model; a HF folder or a .gguf)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, test, _ = load_dataset("banking77")
    queries = test[:args.queries]
    texts = [q.input for q in queries]
    store = MiloStore.open(args.store)
    engines = {}
    for name, dtype in DTYPES.items():
        loaded = load_model(args.model)
        loaded.model.to(dtype)
        engines[name] = Engine(loaded, {"s": store}, EngineSettings(k=args.k), max_rows=8)
    alone = {name: [] for name in DTYPES}
    batched = {name: [] for name in DTYPES}
    answers = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            alone[name].append(timed(engine, texts[:args.alone], 1)[0])
            seconds, answers[name] = timed(engine, texts, 8)
            batched[name].append(seconds)
    store.close()
    agree = sum(a == b for a, b in zip(answers["fp32"], answers["bf16"]))
    print("| dtype | batch 1 s/query | batch 8 s/query | accuracy |\n|---|---:|---:|---:|")
    for name in DTYPES:
        correct = sum(is_correct(a, q.output) for a, q in zip(answers[name], queries))
        print(f"| {name} | {statistics.median(alone[name]):.3f} | {statistics.median(batched[name]):.3f} | "
              f"{correct}/{len(queries)} |")
    ratio_1 = statistics.median(alone["bf16"]) / statistics.median(alone["fp32"])
    ratio_8 = statistics.median(batched["bf16"]) / statistics.median(batched["fp32"])
    print(f"\nbf16 / fp32 time: {ratio_1:.2f} at batch 1, {ratio_8:.2f} at batch 8; answers equal on {agree} of "
          f"{len(queries)} queries ({args.rounds} rounds, medians; {args.alone} queries alone)")


if __name__ == "__main__":
    main()
