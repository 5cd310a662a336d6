"""`milo serve` under concurrent clients while a store's new version is swapped in, beside the same load without.

The server mounts a copy of ``STORE``; 16 streaming clients (the openai async client) send Banking77 test
queries, ``--requests`` per run, twice: once as they are, once with the directory replaced by ``NEW`` (a
version `milo update` made of it, as `tools/bench_update.py` leaves in its work directory) and
``POST /admin/reload`` sent once a third of the run has been answered. Prints each run's failed
requests, queries/s, p50 and p99 latency, and how long the reload took (opening and mounting the
new version beside the old one while the batch runs). Run:

    MILO_DATA=/work/shared/data HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_swap.py \\
        /tmp/bench_update/base /tmp/bench_update/add1-update --requests 128 --threads 1
"""
import argparse
import asyncio
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_serve import start_server  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_store import MiloStore  # noqa: E402


async def run(base: str, model: str, queries: list[str], clients: int, swap=None) -> dict:
    """Every query once, ``clients`` at a time; ``swap`` (a coroutine function) runs once a third are answered."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    limit = asyncio.Semaphore(clients)
    latency, failures, answered = [], [], 0
    third = asyncio.Event()

    async def ask(query: str) -> None:
        nonlocal answered
        async with limit:
            start = time.perf_counter()
            try:
                async for _chunk in await client.completions.create(model=model, prompt=query, stream=True):
                    pass
                latency.append(time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                failures.append(f"{type(e).__name__}: {e}")
            answered += 1
            if answered >= len(queries) // 3:
                third.set()

    async def swapping():
        await third.wait()
        return await swap()

    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(ask(q) for q in queries), *([swapping()] if swap else []))
    finally:
        await client.close()
    wall = time.perf_counter() - start
    return {"failed": len(failures), "first_failures": failures[:3], "qps": len(queries) / wall,
            "p50_s": float(np.percentile(latency, 50)), "p99_s": float(np.percentile(latency, 99)),
            "reload_s": results[-1] if swap else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", help="the version served first (a directory)")
    ap.add_argument("new", help="its next version (a directory), swapped in during the second run")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--batch-wait-ms", type=float, default=5.0)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    _, test, _ = load_dataset("banking77")
    queries = [d.input for d in test[:args.requests]]
    work = Path(tempfile.mkdtemp(prefix="bench_swap-"))
    live = work / Path(args.store).name
    shutil.copytree(args.store, live)
    process, base = start_server(str(live), args, ("--reload-interval", "0"))
    model = live.name
    wanted = MiloStore.current_version(args.new)

    async def swap() -> float:
        staged = work / "staged"
        await asyncio.to_thread(shutil.copytree, args.new, staged)
        old = work / "old"
        live.rename(old)  # what a local commit does: the new version's directory takes the path
        staged.rename(live)
        start = time.perf_counter()
        async with httpx.AsyncClient(timeout=600) as http:
            answer = await http.post(base + "/admin/reload")
        seconds = time.perf_counter() - start
        assert answer.status_code == 200, answer.text
        assert answer.json()["data"][0]["version"] == wanted, answer.json()
        shutil.rmtree(old)
        return seconds

    try:
        asyncio.run(run(base, model, queries[:8], 4))  # warm-up
        plain = asyncio.run(run(base, model, queries, args.clients))
        swapped = asyncio.run(run(base, model, queries, args.clients, swap))
        served = httpx.get(base + "/v1/models").json()["data"][0]["version"]
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
        shutil.rmtree(work, ignore_errors=True)
    print(f"| run | requests | failed | q/s | p50 s | p99 s | reload s |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, r in (("no swap", plain), ("swap at 1/3", swapped)):
        reload = f"{r['reload_s']:.2f}" if r["reload_s"] is not None else "-"
        print(f"| {name} | {len(queries)} | {r['failed']} | {r['qps']:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {reload} |")
    for r in (plain, swapped):
        for failure in r["first_failures"]:
            print("failure:", failure)
    print(f"\nserving version {served} after the run (the new one: {served == wanted}); server exit status {code}")


if __name__ == "__main__":
    main()
