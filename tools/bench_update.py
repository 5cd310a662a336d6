"""`milo update` against a full rebuild of the final corpus: time, blocks encoded, bytes written, and answers.

Builds a store of the first ``--shots`` Banking77 training demonstrations (seeded shuffle, as `milo
build --dataset` takes them), then for each change, on a copy of it: ``--add`` of the next 1% and 10%
of the training split, and ``--remove`` of 10 demonstrations spread over the store. Each update is
timed beside a full rebuild (`build_store`, the same configuration) of the corpus it ends with. Bytes
written are those of files the update created (the chunk files it shares with the previous version are
hard links, written by nobody); a rebuild writes its whole store. With ``--queries N``, the first N test
queries are answered from the updated and the rebuilt store (k 6, one torch thread in-process):
accuracy of each and their agreement. The two stores hold the same demonstrations but not the same
blocks (an update appends to the last block and keeps the others as they were; a rebuild shuffles the
whole corpus into new blocks), so their answers differ where retrieval picks other blocks. Run:

    MILO_DATA=/work/shared/data HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_update.py --shots 2048 \\
        --threads 2 --queries 200 --work /tmp/bench_update
"""
import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.building.builder import build_store  # noqa: E402
from milo_infer.building.config import BuildConfig  # noqa: E402
from milo_infer.building.update import update_store  # noqa: E402
from milo_infer.models import load_model  # noqa: E402
from milo_infer.runtime.engine import Engine  # noqa: E402
from milo_infer.runtime.planning import EngineSettings, Request  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_infer.tasks.scoring import is_correct  # noqa: E402
from milo_store import MiloStore  # noqa: E402


def inodes(path: Path) -> set[int]:
    return {f.stat().st_ino for f in path.rglob("*") if f.is_file()}


def written_bytes(path: Path, before: set[int]) -> int:
    """Bytes of the files at ``path`` that are not the ones ``before`` lists (hard links kept from a version)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.stat().st_ino not in before)


def answers(loaded, path: Path, queries) -> list[str]:
    with MiloStore.open(path) as store:
        engine = Engine(loaded, {"s": store}, EngineSettings(k=6))
        out = []
        for i in range(0, len(queries), 16):
            plans = [engine.plan("s", Request(q.input)) for q in queries[i:i + 16]]
            out += [a.text for a in engine.answer(plans)]
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shots", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--queries", type=int, default=0, help="test queries answered from each updated and rebuilt store")
    ap.add_argument("--only", default="add1,add10,remove10", help="which changes to run")
    ap.add_argument("--answer-on", default="add1,add10,remove10", help="the changes whose stores answer --queries")
    ap.add_argument("--work", type=Path, required=True, help="a directory for the stores (emptied first)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    train, test, task = load_dataset("banking77")
    base, rest = train[:args.shots], train[args.shots:]
    loaded = load_model("default")
    config = BuildConfig()
    t = time.perf_counter()
    build_store(args.work / "base", loaded, base, task, config, progress=False)
    print(f"base: {args.shots} demonstrations built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    step = max(1, args.shots // 10)
    changes = {"add1": (rest[:max(1, args.shots // 100)], []), "add10": (rest[:step], []),
               "remove10": ([], [base[i].id for i in range(0, args.shots, args.shots // 10)][:10])}
    rows = []
    for name in args.only.split(","):
        add, remove = changes[name]
        updated, rebuilt = args.work / f"{name}-update", args.work / f"{name}-rebuild"
        shutil.copytree(args.work / "base", updated, copy_function=os.link)  # a version the update may share
        before = inodes(updated)
        t = time.perf_counter()
        summary = update_store(updated, loaded, add=add, remove=remove, progress=False)
        update_s = time.perf_counter() - t
        update_bytes = written_bytes(updated, before)
        gone = set(remove)
        final = [d for d in base if d.id not in gone] + list(add)
        t = time.perf_counter()
        built = build_store(rebuilt, loaded, final, task, config, progress=False)
        rebuild_s = time.perf_counter() - t
        rebuild_bytes = written_bytes(rebuilt, set())
        row = {"change": name, "added": len(add), "removed": len(remove), "update_s": update_s,
               "rebuild_s": rebuild_s, "update_blocks": summary["blocks_encoded_now"],
               "rebuild_blocks": built["blocks_encoded_now"], "update_bytes": update_bytes,
               "rebuild_bytes": rebuild_bytes}
        if args.queries and name in args.answer_on.split(","):
            queries = test[:args.queries]
            a, b = answers(loaded, updated, queries), answers(loaded, rebuilt, queries)
            row["update_acc"] = sum(is_correct(x, q.output) for x, q in zip(a, queries)) / len(queries)
            row["rebuild_acc"] = sum(is_correct(x, q.output) for x, q in zip(b, queries)) / len(queries)
            row["agreement"] = sum(x == y for x, y in zip(a, b)) / len(queries)
        rows.append(row)
        print(f"  {name}: update {update_s:.1f} s, rebuild {rebuild_s:.1f} s", file=sys.stderr)
    print("| change | update s | rebuild s | time ratio | blocks encoded (update / rebuild) | bytes written "
          "(update / rebuild) | bytes ratio |" + (" accuracy update / rebuild | agreement |" if args.queries else ""))
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.queries else ""))
    for r in rows:
        label = f"+{r['added']}" if r["added"] else f"-{r['removed']}"
        line = (f"| {label} | {r['update_s']:.1f} | {r['rebuild_s']:.1f} | {r['update_s'] / r['rebuild_s']:.3f} | "
                f"{r['update_blocks']} / {r['rebuild_blocks']} | {r['update_bytes'] / 2**20:.1f} MiB / "
                f"{r['rebuild_bytes'] / 2**20:.1f} MiB | {r['update_bytes'] / r['rebuild_bytes']:.3f} |")
        if "agreement" in r:
            line += f" {r['update_acc']:.3f} / {r['rebuild_acc']:.3f} | {r['agreement']:.3f} |"
        elif args.queries:
            line += " - | - |"
        print(line)


if __name__ == "__main__":
    main()
