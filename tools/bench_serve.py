"""Load test of `milo serve`: real Banking77 test queries from concurrent streaming clients, beside the in-process engine.

For each store, a `milo serve` subprocess on loopback answers ``--requests`` queries at each
``--concurrency`` (the openai async client, streaming, so time to first token is measured where the
client sees it): queries/s, p50/p99 latency, p50 time to first token, and the mean batch size from
the server's own ``milo:batch_size`` histogram. Beside each level, the in-process engine answers the
same queries in batches of that size through one running batch (no HTTP, no queue): the server's overhead
is 1 - server q/s / engine q/s. ``--memory-requests`` more requests then trace the server's
resident memory (VmRSS) before and after each quarter of them. ``--warmup``/``--warmup-rows`` are the server's
(its start's warm-up, timed to /health's 200); ``--client-warmup 0`` leaves out the clients' own warm-up requests
and ``--repeat`` runs each level twice in a row, so the first level's q/s beside its repeat's shows what the
first traffic paid for compiling (issue 55). ``--shared-blocks on,off`` serves each store once with blocks held
once for every row and once with each row holding its own copy (`milo serve --shared-blocks`), one after the
other in the same run, and reports the most K/V bytes each level held and the distinct blocks held against the
blocks placed then (the server's `milo:kv_cache_bytes_held`, `milo:held_blocks` and `milo:placed_blocks`, read
every 0.2 s; issue 54). ``--sampled`` runs each level a second time at once on the same server with requests as a
chat front end sends them (temperature 0.7, top_p 0.8, a seed each, and the top 5 log probabilities of every token),
twice, then the greedy level once more (greedy, sampled, sampled, greedy: a drift in the machine's speed weighs on
both alike), and reports the sampled runs' mean q/s and completion tokens/s against the greedy runs' (issue 63). Prints a markdown table; ``--out`` also writes JSON. ``--synthetic SHAPE`` serves stores `milo bench --synthetic SHAPE` built, with the random model
of that shape (``--model synthetic:SHAPE``) and queries naming their blocks' topics (tools/gpu_bench.sh). Run:

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_serve.py stores/banking77 stores/banking77-r025 \\
        --concurrency 1,4,16,64 --requests 256 --memory-requests 2000
"""
import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.runtime.pages import parse_kv_memory  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_infer.server.launch import store_name  # noqa: E402
from milo_infer.runtime.planning import EngineSettings  # noqa: E402

STDERR_TAIL = 30  # lines of a failed server's stderr shown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(threads: int = 0) -> dict:
    """The server's environment: this checkout first on the path, and the caller's path kept after it (gpu_bench.sh
    puts the wheels a GPU image lacks, fastapi and uvicorn among them, on PYTHONPATH; a server without them exits 1)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_server(store: str, args, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """A `milo serve` of ``store`` answering /health; if it exits or never answers, SystemExit with the tail of its
    stderr (kept in a temporary file, so a long-running server's log never fills a pipe)."""
    port = free_port()
    log = tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-m", "milo_infer.cli.main", "serve", store, "--port", str(port),
                                "--max-batch", str(args.max_batch), "--batch-wait-ms", str(args.batch_wait_ms),
                                "--model", args.model, "--k", str(args.k), *extra,
                                *(("--device", args.device) if args.device else ()),
                                *(("--kv-cache-memory", args.kv_cache_memory) if args.kv_cache_memory else ()),
                                "--attention", args.attention,
                                *(("--warmup", args.warmup) if args.warmup else ()),
                                *(("--warmup-rows", str(args.warmup_rows)) if args.warmup_rows else ())],
                               env=server_env(args.threads), stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.kill()
    process.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace").strip().splitlines()[-STDERR_TAIL:]
    log.close()
    why = f"exit {process.returncode}" if time.monotonic() < deadline else f"no answer in {args.start_timeout:g} s"
    raise SystemExit(f"bench_serve: milo serve {store} did not start ({why}); its stderr ends:\n"
                     + "\n".join("  " + line for line in tail or ["(nothing)"]))


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def server_metric(base: str, name: str) -> float | None:
    """One unlabelled sample of the server's /metrics (None: it has no such metric)."""
    return server_metrics(base, (name,)).get(name)


def server_metrics(base: str, names: tuple[str, ...]) -> dict[str, float]:
    """These unlabelled samples of the server's /metrics (those it has)."""
    values = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


HELD = ("milo:kv_cache_bytes_held", "milo:held_blocks", "milo:placed_blocks")


class HeldWatch:
    """The most K/V bytes the server's rows held while it runs (and the blocks held and placed at that moment), read
    from its /metrics every ``period`` seconds on a thread of its own."""

    def __init__(self, base: str, period: float = 0.2):
        self.base, self.period, self.most = base, period, dict.fromkeys(HELD, 0.0)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="bench-serve-held")

    def _watch(self) -> None:
        while not self.done.wait(self.period):
            now = server_metrics(self.base, HELD)
            if now.get(HELD[0], 0.0) > self.most[HELD[0]]:
                self.most = {name: now.get(name, 0.0) for name in HELD}

    def __enter__(self) -> "HeldWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def batch_histogram(base: str) -> tuple[float, float]:
    """(sum, count) of the server's batch-size histogram."""
    values = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        for name in ("milo:batch_size_sum", "milo:batch_size_count"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values["milo:batch_size_sum"], values["milo:batch_size_count"]


def sampled(i: int) -> dict:
    """Request ``i``'s fields as a chat front end sends them, asking for the top 5 log probabilities too."""
    return {"temperature": 0.7, "top_p": 0.8, "seed": i, "logprobs": 5}


async def load(base: str, model: str, queries: list[str], concurrency: int, fields=lambda i: {}) -> dict:
    """Every query once, ``concurrency`` at a time, with ``fields(i)`` added to request i; latency, time to first
    token per request, and completion tokens/s."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    limit = asyncio.Semaphore(concurrency)
    latency, first, tokens = [], [], []

    async def ask(i: int, query: str) -> None:
        async with limit:
            start = time.perf_counter()
            seen = None
            async for chunk in await client.completions.create(model=model, prompt=query, stream=True,
                                                               stream_options={"include_usage": True}, **fields(i)):
                seen = seen or time.perf_counter()
                if chunk.usage is not None:
                    tokens.append(chunk.usage.completion_tokens)
            latency.append(time.perf_counter() - start)
            first.append((seen or time.perf_counter()) - start)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(ask(i, q) for i, q in enumerate(queries)))
    finally:
        await client.close()
    wall = time.perf_counter() - start
    return {"qps": len(queries) / wall, "tokens_per_s": sum(tokens) / wall, "p50_s": float(np.percentile(latency, 50)),
            "p99_s": float(np.percentile(latency, 99)), "ttft_p50_s": float(np.percentile(first, 50))}


def engine_qps(engine, name: str, queries: list[str], size: int) -> float:
    """Queries/s of the in-process engine answering ``queries`` in batches of ``size``, through one running batch
    as the server's loop keeps."""
    from milo_infer.runtime.planning import Request

    plans = [engine.plan(name, Request(q)) for q in queries]
    batch = engine.batch()
    start = time.perf_counter()
    for i in range(0, len(plans), size):
        events = batch.admit(plans[i:i + size])
        while len(batch):
            events += batch.step()
        if failed := [e.error for e in events if e.error is not None]:
            raise failed[0]
    return len(plans) / (time.perf_counter() - start)


def bench_store(store: str, queries: list[str], loaded, args, on_level=lambda result: None,
                shared: str = "on") -> dict:
    """One store's levels (and memory trace), served with ``--shared-blocks shared``; ``on_level`` gets the result so
    far after each level, so a run cut short by a timeout leaves what it measured."""
    from milo_infer.runtime.engine import Engine
    from milo_store import MiloStore

    model = store_name(store)
    started = time.perf_counter()
    process, base = start_server(store, args, ("--shared-blocks", shared))
    ready_s = time.perf_counter() - started
    warmup_s = server_metric(base, "milo:warmup_seconds")
    print(f"  {model} (shared blocks {shared}): milo serve answered /health in {ready_s:.1f} s (its warm-up: "
          f"{warmup_s or 0:.1f} s)", file=sys.stderr, flush=True)
    mounted = MiloStore.open(store)
    engine = Engine(loaded, {model: mounted}, settings=EngineSettings(k=args.k), max_rows=args.max_batch,
                    attention=args.attention, shared_blocks=shared == "on",
                    **({"kv_cache_memory": parse_kv_memory(args.kv_cache_memory)} if args.kv_cache_memory else {}))
    rows = []
    try:
        if args.client_warmup:
            asyncio.run(load(base, model, queries[:args.client_warmup], 4))
        for concurrency in args.concurrency:
            before = batch_histogram(base)
            with HeldWatch(base) as held:
                row = asyncio.run(load(base, model, queries[:args.requests], concurrency))
            row["kv_bytes_held"], row["held_blocks"], row["placed_blocks"] = (held.most[name] for name in HELD)
            after = batch_histogram(base)
            row["mean_batch"] = (after[0] - before[0]) / max(1.0, after[1] - before[1])
            if args.sampled:  # sampled requests asking for log probabilities twice, then greedy again (ABBA)
                runs = [asyncio.run(load(base, model, queries[:args.requests], concurrency, fields))
                        for fields in (sampled, sampled, lambda i: {})]
                greedy = [row, runs[2]]
                for key in ("qps", "tokens_per_s"):
                    row[f"greedy_{key}"] = float(np.mean([r[key] for r in greedy]))
                    row[f"sampled_{key}"] = float(np.mean([r[key] for r in runs[:2]]))
                row["sampled_over_greedy"] = row["sampled_qps"] / row["greedy_qps"]
            if args.repeat:  # the same level again at once: what it runs at with nothing left to compile
                row["repeat_qps"] = asyncio.run(load(base, model, queries[:args.requests], concurrency))["qps"]
                row["first_over_repeat"] = row["qps"] / row["repeat_qps"]
            row["compiled_after_warmup"] = server_metric(base, "milo:compiled_graphs_after_warmup_total")
            row["engine_qps"] = engine_qps(engine, model, queries[:args.requests], min(concurrency, args.max_batch))
            row["overhead"] = 1 - row["qps"] / row["engine_qps"]
            rows.append({"concurrency": concurrency, **row})
            print(f"  {model} c={concurrency}: {row['qps']:.1f} q/s (engine {row['engine_qps']:.1f}), "
                  f"{time.perf_counter() - started:.1f} s since the server started", file=sys.stderr, flush=True)
            on_level({"store": model, "path": store, "shared_blocks": shared, "ready_s": ready_s,
                      "warmup_s": warmup_s, "levels": rows, "memory": None, "exit_status": None, "partial": True})
        memory = None
        if args.memory_requests:  # resident memory before, and after each quarter of the run
            rss = [resident_bytes(process.pid)]
            many = [queries[i % len(queries)] for i in range(args.memory_requests)]
            for quarter in np.array_split(np.arange(len(many)), 4):
                asyncio.run(load(base, model, [many[i] for i in quarter], max(args.concurrency)))
                rss.append(resident_bytes(process.pid))
            memory = {"requests": args.memory_requests, "rss": rss, "growth": rss[-1] / rss[0] - 1}
    finally:
        mounted.close()
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    return {"store": model, "path": store, "shared_blocks": shared, "ready_s": ready_s, "warmup_s": warmup_s,
            "levels": rows, "memory": memory, "exit_status": code}


def table(results: list[dict]) -> str:
    lines = ["| store | shared blocks | ready s | clients | q/s | vs 1 client | repeated q/s | p50 s | p99 s | TTFT p50 s "
             "| mean batch | engine q/s | overhead | compiled after warm-up | K/V held MiB (most) | blocks held / placed then |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        alone = next((lv["qps"] for lv in r["levels"] if lv["concurrency"] == 1), None)
        for lv in r["levels"]:
            repeat = f"{lv['repeat_qps']:.2f}" if "repeat_qps" in lv else "-"
            ratio = f"{lv['qps'] / alone:.2f}x" if alone else "-"
            late = lv.get("compiled_after_warmup")
            lines.append(f"| {r['store']} | {r['shared_blocks']} | {r['ready_s']:.1f} | {lv['concurrency']} | {lv['qps']:.2f} "
                         f"| {ratio} | {repeat} "
                         f"| {lv['p50_s']:.3f} | {lv['p99_s']:.3f} | {lv['ttft_p50_s']:.3f} | {lv['mean_batch']:.1f} "
                         f"| {lv['engine_qps']:.2f} | {lv['overhead'] * 100:.0f}% | {'-' if late is None else f'{late:.0f}'} "
                         f"| {lv['kv_bytes_held'] / 2**20:.0f} | {lv['held_blocks']:.0f} / {lv['placed_blocks']:.0f} |")
    sampled = [(r, lv) for r in results for lv in r["levels"] if "sampled_qps" in lv]
    if sampled:
        lines += ["", "| store | clients | greedy q/s | sampled + top-5 logprobs q/s | sampled / greedy | greedy tokens/s "
                      "| sampled tokens/s | tokens/s ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['store']} | {lv['concurrency']} | {lv['greedy_qps']:.2f} | {lv['sampled_qps']:.2f} "
                  f"| {lv['sampled_over_greedy']:.3f} | {lv['greedy_tokens_per_s']:.1f} | {lv['sampled_tokens_per_s']:.1f} "
                  f"| {lv['sampled_tokens_per_s'] / lv['greedy_tokens_per_s']:.3f} |" for r, lv in sampled]
    for r in results:
        if r["memory"]:
            m = r["memory"]
            trace = " -> ".join(f"{b / 2**20:.0f}" for b in m["rss"])
            lines.append(f"\n{r['store']}: resident memory {trace} MiB (start, then after each quarter of {m['requests']} "
                         f"requests: {m['growth'] * 100:+.1f}%); exit status {r['exit_status']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="+", help="store directories (each served on its own, one after another)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=256, help="requests per concurrency level")
    ap.add_argument("--memory-requests", type=int, default=2000, help="requests of the memory run (0: skip)")
    ap.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch and the engine's rows (default 16, as milo serve)")
    ap.add_argument("--batch-wait-ms", type=float, default=5.0, help="the server's gathering window (default 5)")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--model", default="default")
    ap.add_argument("--synthetic", metavar="SHAPE", help="stores of `milo bench --synthetic SHAPE`: its random model "
                                                         "and synthetic queries")
    ap.add_argument("--device", default=None, help="the server's and the in-process engine's device")
    ap.add_argument("--kv-cache-memory", default=None, help="the server's --kv-cache-memory")
    ap.add_argument("--attention", default="auto", help="the server's and the engine's --attention")
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds a server may take to answer /health")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the server (0: torch's choice)")
    ap.add_argument("--warmup", default=None, help="the server's --warmup (default: its own default)")
    ap.add_argument("--warmup-rows", type=int, default=None, help="the server's --warmup-rows")
    ap.add_argument("--client-warmup", type=int, default=8,
                    help="requests (4 at a time) sent before the levels (default 8; 0: none, the first level is first)")
    ap.add_argument("--repeat", action="store_true", help="run each level twice in a row (first vs repeated q/s)")
    ap.add_argument("--sampled", action="store_true",
                    help="run each level again with sampled requests asking for the top 5 log probabilities")
    ap.add_argument("--shared-blocks", type=lambda s: s.split(","), default=["on"], metavar="on,off",
                    help="serve each store with blocks held once (on), each row's own copy (off), or both, one after "
                         "the other (default on)")
    ap.add_argument("--out", default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    from milo_infer.bench.synthetic_model import device_model, synthetic_queries
    from milo_infer.models import load_model
    from milo_infer.runtime.session import place_model
    from milo_store import MiloStore

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.synthetic:
        args.model = f"synthetic:{args.synthetic}"
        with MiloStore.open(args.stores[0]) as store:
            queries = synthetic_queries(args.requests, store.num_blocks, args.k)
    else:
        _, test, _ = load_dataset("banking77")
        queries = [d.input for d in test]
    loaded = device_model(args.synthetic, args.device) if args.synthetic else load_model(args.model)
    place_model(loaded, args.device)
    results = []

    def save(partial=None) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(results + ([partial] if partial else []), indent=2))
    for store in args.stores:
        for shared in args.shared_blocks:
            results.append(bench_store(store, queries, loaded, args, on_level=save, shared=shared))
            save()
    print(table(results))


if __name__ == "__main__":
    main()
