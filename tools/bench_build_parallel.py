"""Build throughput side by side: 1 vs N processes (torchrun) and one-block vs batched encoding.

Each setting runs the real ``milo build`` as a subprocess (a fresh store and staging every time,
one torch thread per process by default), interleaved over ``--rounds`` so a shared machine's load
falls on every setting alike; the load average is printed beside each run. Throughput is block
tokens (what the store keeps) per second of pass one (encoding + factorizing + staging, wall time)
and end to end (model load and the commit included); "CPU cores held" is the processes' CPU time
over pass one's wall time (below the process count when other jobs share the CPUs). Ratios are
against the first setting. Run:

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_build_parallel.py --shots 512 --processes 1,2
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_build_parallel.py --shots 128 --encode-batch 1,4
"""
import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(processes: int, encode_batch: int, out: Path, args) -> list[str]:
    build = ["-m", "milo_infer.cli.main", "build", "--dataset", args.dataset, "--shots", str(args.shots),
             "--block-size", str(args.block_size), "--context-blocks", str(args.context_blocks),
             "--model", args.model, "--encode-batch", str(encode_batch), "--out", str(out), "--json"]
    if args.threads:
        build += ["--threads", str(args.threads)]
    if processes == 1:
        return [sys.executable, *build]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *build]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="banking77")
    ap.add_argument("--shots", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--context-blocks", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--processes", default="1", help="comma-separated process counts (default 1)")
    ap.add_argument("--encode-batch", default="1", help="comma-separated blocks per forward pass (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (0: torch's choice)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    settings = list(itertools.product(map(int, args.processes.split(",")), map(int, args.encode_batch.split(","))))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # the caller's packages too
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    root = Path(tempfile.mkdtemp(prefix="milo-bench-build-parallel-"))
    results = {s: [] for s in settings}
    try:
        for r in range(args.rounds):
            for processes, batch in settings:
                out = root / f"store-{processes}-{batch}-{r}"
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                done = subprocess.run(command(processes, batch, out, args), env=env, cwd=ROOT,
                                      capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if done.returncode != 0:
                    sys.exit(f"bench_build_parallel: {processes} process(es), batch {batch} failed:\n"
                             f"{done.stderr[-3000:]}")
                s = json.loads(done.stdout)
                results[processes, batch].append(s)
                print(f"round {r}  processes {processes}  encode batch {batch}: pass one {s['pass_one_s']:.1f} s "
                      f"({s['tokens'] / s['pass_one_s']:.1f} block tok/s), end to end {wall:.1f} s, CPU cores held "
                      f"in pass one {sum(r['cpu_s'] for r in s['ranks']) / s['pass_one_s']:.2f}; "
                      f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{args.dataset} --shots {args.shots} --block-size {args.block_size} --context-blocks "
          f"{args.context_blocks}, {args.threads or 'default'} torch thread(s) per process, {os.cpu_count()} CPUs, "
          f"{args.rounds} round(s), best of each\n")
    print("| processes | encode batch | pass one s | block tok/s (pass one) | end-to-end s | ratio (pass one) |")
    print("|---|---|---|---|---|---|")
    first = None
    for processes, batch in settings:
        best = min(results[processes, batch], key=lambda s: s["pass_one_s"])
        rate = best["tokens"] / best["pass_one_s"]
        first = first or rate
        print(f"| {processes} | {batch} | {best['pass_one_s']:.1f} | {rate:.1f} | {best['total_s']:.1f} | "
              f"{rate / first:.2f}x |")


if __name__ == "__main__":
    main()
