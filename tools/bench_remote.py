"""Remote stores: what a slow link to an object store buys MILO, measured against moto's S3 server.

Three parts, one run, one S3-compatible server (moto, in its own process on 127.0.0.1):

1. chunk objects: one random-bytes store per factor chunk size; per query (k blocks) the raw range
   GETs of obstore for its byte ranges against milo's read path for the same blocks (cold, no block
   cache), interleaved. moto reads a whole object per GET, so small chunks read faster there.
2. raw vs milo, end to end: real stores (the default model, Banking77, identity fp16 = full KV, and
   MILO at each ρ) pushed to the server; through a throttling proxy on loopback at each link rate
   (a SIMULATED link: one token bucket shared by all connections), per query: the KV assembly
   (remote fetch + move + rebuild into the cache), queries/s, bytes and GETs fetched; full vs MILO,
   cold (no block cache) and warm (every block in the local block cache); the 1/ρ bound is the
   measured bytes ratio; the crossover is where MILO's queries/s pass full's.
3. in the same run, per link rate: raw range GETs of the same byte ranges as milo's read path.

Raw range GETs come three ways, each timed against milo's read path on the same queries: obstore's
``get_ranges`` over the merged ranges without coalescing (the reference the ratio divides by), with its
default 1 MiB coalescing, and ``get_ranges_async`` for every chunk object at once on one event loop.
``--reads-only`` runs only that comparison, on a random-bytes store with blocks the size of the full
store's (no model), at each of ``--rates``.

This machine is shared and noisy; ratios inside one run are what to read. Run:

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench_remote.py --out /tmp/bench-remote
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench_remote.py --out /tmp/bench-reads --reads-only --rates 0,50M
"""
import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np
import obstore
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback_proxy import LoopbackProxy  # noqa: E402

from milo_infer.bench import throughput  # noqa: E402
from milo_infer.bench.throughput import TimedSession  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_infer.models import load_model  # noqa: E402
from milo_infer.runtime.planning import EngineSettings  # noqa: E402
from milo_store import Layout, MiloStore, StoreWriter  # noqa: E402
from milo_store.blockcache import BlockCache, parse_size  # noqa: E402
from milo_store.push import push  # noqa: E402
from milo_store.format import MAX_CHUNK_BYTES as REMOTE_CHUNK_BYTES  # noqa: E402
from milo_store.urls import open_object_store  # noqa: E402

BUCKET = "milo-bench"


def parse_rate(text: str) -> float:
    """Bytes/s from '25M', '1G' (decimal, as link rates are quoted), or '0' for no throttling."""
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    t = text.strip().upper()
    return float(t[:-1]) * units[t[-1]] if t[-1] in units else float(t)


def start_moto():
    """moto's S3 server in its own process (so it does not share our GIL), with a bucket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"), timeout=2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint, AWS_ALLOW_HTTP="true")
    return proc, endpoint


def raw_ranges(store: MiloStore, ids) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges milo reads for these blocks, per chunk object key, adjacent ones merged."""
    per = {}
    for i in sorted(set(ids)):
        start, stop = int(store.offsets[i]) * store.itemsize, int(store.offsets[i + 1]) * store.itemsize
        for c, a, z, _ in store.placement.pieces(start, stop):
            ranges = per.setdefault(store.origin.key(c), [])
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], z)
            else:
                ranges.append((a, z))
    return per


def raw_get(client, per_key, pool, coalesce: int = 0) -> int:
    """obstore range GETs of these ranges, objects in parallel: the client alone, nothing else."""
    def one(item):
        key, ranges = item
        bufs = obstore.get_ranges(client, key, starts=[a for a, _ in ranges], ends=[z for _, z in ranges],
                                  coalesce=coalesce)
        return sum(len(b) for b in bufs)
    return sum(pool.map(one, per_key.items()))


async def raw_get_async(client, per_key) -> int:
    """obstore's async range GETs of every chunk object at once, its default coalescing."""
    got = await asyncio.gather(*(obstore.get_ranges_async(client, key, starts=[a for a, _ in r], ends=[z for _, z in r])
                                 for key, r in per_key.items()))
    return sum(len(b) for bufs in got for b in bufs)


def raw_vs_milo(url: str, queries: list[list[int]], tmp: Path) -> dict:
    """Seconds per query of raw GETs (three ways) and of milo's cold read of the same blocks, interleaved
    query by query in a rotating order; medians. The async GETs run on one event loop in its own thread, as
    a server's would."""
    client = open_object_store(url)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    ways = {"raw": lambda ids, per: raw_get(client, per, pool),
            "raw_coalesced": lambda ids, per: raw_get(client, per, pool, coalesce=1 << 20),
            "raw_async": lambda ids, per: asyncio.run_coroutine_threadsafe(raw_get_async(client, per), loop).result(),
            "milo": lambda ids, per: store.blocks(ids)}
    seconds = {w: [] for w in ways}
    nbytes = []
    try:
        with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp / "none", 0)) as store, \
                ThreadPoolExecutor(8) as pool:
            order = list(ways)
            for q, ids in enumerate(queries):  # the order rotates, so no way always follows another
                per = raw_ranges(store, ids)
                for w in order[q % len(order):] + order[:q % len(order)]:
                    t = time.perf_counter()
                    got = ways[w](ids, per)
                    seconds[w].append(time.perf_counter() - t)
                    if w == "raw":
                        nbytes.append(got)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        loop.close()
    med = {w: statistics.median(v) for w, v in seconds.items()}
    b = statistics.median(nbytes)
    return {"bytes_per_query": b, "raw_s": med["raw"], "milo_s": med["milo"], "raw_mbps": b / med["raw"] / 1e6,
            "milo_mbps": b / med["milo"] / 1e6, "milo_over_raw": med["raw"] / med["milo"],
            "paired_milo_over_raw": statistics.median(r / m for r, m in zip(seconds["raw"], seconds["milo"])),
            "raw_coalesced_mbps": b / med["raw_coalesced"] / 1e6, "raw_async_mbps": b / med["raw_async"] / 1e6}


def random_store(url: str, layout: Layout, ranks: np.ndarray, tokens: np.ndarray, chunk_bytes: int) -> None:
    """A store of random fp16 factors at ``url`` with chunks of at most ``chunk_bytes``."""
    g = torch.Generator().manual_seed(0)
    with StoreWriter(url, layout, ranks, tokens, max_chunk_bytes=chunk_bytes, force=True) as w:
        for i in range(len(tokens)):
            w.write_block(torch.randn(int(w.offsets[i + 1] - w.offsets[i]), generator=g).half())
        w.commit()


def chunk_sweep(sizes, tmp: Path, blocks: int, block_tokens: int, rank: int, k: int, n_queries: int) -> list[dict]:
    """Random-bytes stores of the default model's shape, one per chunk size; raw vs milo per size."""
    layout = Layout(30, 3, 64)
    ranks = np.full((blocks, layout.num_layers, 2, layout.num_kv_heads), rank, dtype=np.int16)
    tokens = np.full(blocks, block_tokens, dtype=np.int32)
    rng = np.random.default_rng(0)
    queries = [sorted(rng.choice(blocks, size=k, replace=False).tolist()) for _ in range(n_queries)]
    rows = []
    for size in sizes:
        url = f"s3://{BUCKET}/chunks-{size}"
        random_store(url, layout, ranks, tokens, size)
        row = raw_vs_milo(url, queries, tmp)
        row["chunk_bytes"] = size
        rows.append(row)
        print(f"chunk {size >> 20} MiB: raw {row['raw_mbps']:.0f} MB/s, milo {row['milo_mbps']:.0f} MB/s", file=sys.stderr)
    return rows


def run_queries(sessions: dict, queries: list[str]) -> dict:
    """Per method: queries/s and per-query KV assembly, remote bytes and GETs (methods interleaved per query)."""
    acc = {m: {"wall": 0.0, "assembly": [], "fetch": [], "rebuild": []} for m in sessions}
    before = {m: s.store.remote_stats() for m, s in sessions.items()}
    for q in queries:
        for m, s in sessions.items():
            t = time.perf_counter()
            a = s.answer(q)
            acc[m]["wall"] += time.perf_counter() - t
            sec = a.seconds
            acc[m]["assembly"].append(sec["read"] + sec["transfer"] + sec["rebuild"])
            acc[m]["fetch"].append(sec["read"])
            acc[m]["rebuild"].append(sec["rebuild"])
    out = {}
    for m, s in sessions.items():
        after = s.store.remote_stats()
        n = len(queries)
        out[m] = {"qps": n / acc[m]["wall"], "assembly_ms": 1e3 * statistics.median(acc[m]["assembly"]),
                  "fetch_ms": 1e3 * statistics.median(acc[m]["fetch"]),
                  "rebuild_ms": 1e3 * statistics.median(acc[m]["rebuild"]),
                  "bytes_per_query": (after["bytes"] - before[m]["bytes"]) / n,
                  "gets_per_query": (after["gets"] - before[m]["gets"]) / n}
    return out


def open_sessions(loaded, urls: dict, cache: BlockCache, k: int) -> dict:
    sessions = {}
    for m, url in urls.items():
        store = MiloStore.open(url, tier="disk", block_cache=cache)
        sessions[m] = TimedSession(loaded, store, settings=EngineSettings(k=k), copy_identity=m == "full")
    return sessions


@contextlib.contextmanager
def link(rate: float):
    """Clients opened inside reach the server through a loopback proxy throttled to ``rate`` bytes/s
    (0: directly)."""
    if not rate:
        yield
        return
    upstream = os.environ["AWS_ENDPOINT_URL"]
    with LoopbackProxy(upstream, rate=rate) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        try:
            yield
        finally:
            os.environ["AWS_ENDPOINT_URL"] = upstream


def read_path(args, tmp: Path) -> list[dict]:
    """Raw range GETs against milo's cold read path at each link rate, on a random-bytes store whose
    blocks are the size of the end-to-end full store's (k of them per query, remote chunk objects)."""
    layout = Layout(30, 3, 64)
    blocks = 16
    ranks = np.full((blocks, layout.num_layers, 2, layout.num_kv_heads), 64, dtype=np.int16)
    tokens = np.full(blocks, args.read_block_tokens, dtype=np.int32)
    url = f"s3://{BUCKET}/reads"
    random_store(url, layout, ranks, tokens, REMOTE_CHUNK_BYTES)
    rng = np.random.default_rng(0)
    queries = [sorted(rng.choice(blocks, size=args.k, replace=False).tolist()) for _ in range(args.n_queries)]
    rows = []
    for rate in args.rates:
        with link(rate):
            row = raw_vs_milo(url, queries, tmp)
        row["rate_mbps"] = rate / 1e6 if rate else None
        rows.append(row)
        print(f"link {rate / 1e6 if rate else 'unthrottled'} MB/s: milo / raw {row['milo_over_raw']:.2f}", file=sys.stderr)
    return rows


def end_to_end(args, loaded, urls: dict, queries: list[str], tmp: Path) -> dict:
    warm_cache = BlockCache(tmp / "warm", 1 << 40)
    sessions = open_sessions(loaded, urls, warm_cache, args.k)
    run_queries(sessions, queries)  # fills the warm cache, and warms up every code path
    warm = run_queries(sessions, queries)
    for s in sessions.values():
        s.store.close()
    rows = []
    for rate in args.rates:
        with link(rate):
            cold_cache = BlockCache(tmp / "cold", 0)  # caches nothing: every block comes over the link
            sessions = open_sessions(loaded, urls, cold_cache, args.k)
            cold = run_queries(sessions, queries)
            block_ids = [sessions["full"].store.blocks_of(sessions["full"].select(q)) for q in queries]
            for s in sessions.values():
                s.store.close()
            raw = raw_vs_milo(urls["full"], block_ids, tmp)
        rows.append({"rate_mbps": rate / 1e6 if rate else None, "cold": cold, "raw_vs_milo_full": raw})
        print(f"link {rate / 1e6 if rate else 'unthrottled'} MB/s: " + ", ".join(
            f"{m} {r['qps']:.2f} q/s" for m, r in cold.items()), file=sys.stderr)
    return {"warm": warm, "rows": rows}


def render(report: dict) -> str:
    lines = [f"## Remote stores ({report['date']})", "", f"command: `{report['command']}`", "",
             f"moto {report['moto']} on 127.0.0.1 (own process); {report['threads']} torch thread(s); shared, noisy "
             "machine: compare numbers within this run.", "",
             "### Factor chunk object size (moto, unthrottled, random-bytes store of SmolLM2-135M's shape, "
             f"k={report['chunk_k']} blocks of {report['chunk_block_mib']:.1f} MiB per query)", "",
             "| chunk object | raw range GETs MB/s | milo read MB/s | milo / raw |", "|---:|---:|---:|---:|"]
    for r in report["chunks"]:
        lines.append(f"| {r['chunk_bytes'] >> 20} MiB | {r['raw_mbps']:.0f} | {r['milo_mbps']:.0f} | {r['milo_over_raw']:.2f} |")
    e = report["e2e"]
    full_bytes = e["rows"][0]["cold"]["full"]["bytes_per_query"]
    lines += ["", f"### End to end, {report['model']}, Banking77 {report['shots']} shots, k={report['k']}, "
              f"{report['n_queries']} queries; link throttled by a loopback proxy (SIMULATED link)", "",
              "| link MB/s | cache | method | q/s | speedup vs full | bound 1/ρ | KV assembly ms | fetch ms | rebuild ms "
              "| MiB/query | GETs/query |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def add(label, cache, res):
        base = res["full"]
        for m, r in res.items():
            ratio = r["bytes_per_query"] / full_bytes if cache == "cold" else None
            bound = f"{1 / ratio:.2f}" if ratio else "-"
            lines.append(f"| {label} | {cache} | {m} | {r['qps']:.2f} | {r['qps'] / base['qps']:.2f} | {bound} | "
                         f"{r['assembly_ms']:.0f} | {r['fetch_ms']:.0f} | {r['rebuild_ms']:.0f} | "
                         f"{r['bytes_per_query'] / 2**20:.2f} | {r['gets_per_query']:.1f} |")

    for row in e["rows"]:
        add(f"{row['rate_mbps']:g}" if row["rate_mbps"] else "unthrottled", "cold", row["cold"])
    add("any", "warm", e["warm"])
    lines += ["", "raw range GETs vs milo's read path for the full store's blocks of the same queries, same link:", ""]
    lines += read_table([{**row["raw_vs_milo_full"], "rate_mbps": row["rate_mbps"]} for row in e["rows"]])
    lines += [""] + [f"crossover {m}: {c}" for m, c in report["crossover"].items()]
    return "\n".join(lines)


def read_table(rows: list[dict]) -> list[str]:
    """Raw range GETs (three ways) beside milo's read path, one line per link rate; milo / raw divides
    the medians by the first way's, paired the median of the per-query ratios (steadier on a busy
    machine). Reports saved before the other columns were measured show "-" for them."""
    def cell(r, key, form):
        return format(r[key], form) if key in r else "-"
    lines = ["| link MB/s | raw MB/s | raw coalesced 1 MiB MB/s | raw async MB/s | milo MB/s | milo / raw "
             "| paired milo / raw |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rate_mbps'] if r['rate_mbps'] else 'unthrottled'} | {cell(r, 'raw_mbps', '.0f')} | "
                     f"{cell(r, 'raw_coalesced_mbps', '.0f')} | {cell(r, 'raw_async_mbps', '.0f')} | "
                     f"{cell(r, 'milo_mbps', '.0f')} | {r['milo_over_raw']:.2f} | "
                     f"{cell(r, 'paired_milo_over_raw', '.2f')} |")
    return lines


def render_reads(report: dict) -> str:
    return "\n".join([f"## Remote read path ({report['date']})", "", f"command: `{report['command']}`", "",
                      f"moto {report['moto']} on 127.0.0.1 (own process); random-bytes store, blocks of "
                      f"{report['block_mib']:.1f} MiB in {REMOTE_CHUNK_BYTES >> 20} MiB chunk objects, k={report['k']} "
                      f"blocks per query, {report['n_queries']} queries, medians; cold (no block cache).", "",
                      *read_table(report["reads"])])


def crossover(rows: list[dict]) -> dict:
    """Per MILO method: where its cold queries/s pass full's in the sweep, and the link rate below which
    its KV assembly beats full's, W* = (bytes saved) / (extra rebuild), from medians over the sweep
    (the same model as `milo bench`'s crossover, with the fetch over the link as the transfer)."""
    out = {}
    rated = sorted((r for r in rows if r["rate_mbps"]), key=lambda r: r["rate_mbps"])
    for m in rows[0]["cold"]:
        if m == "full":
            continue
        faster = [r["rate_mbps"] for r in rated if r["cold"][m]["qps"] >= r["cold"]["full"]["qps"]]
        slower = [r["rate_mbps"] for r in rated if r["cold"][m]["qps"] < r["cold"]["full"]["qps"]]
        if not slower:
            sweep = f"queries/s ahead of full at every simulated rate up to {rated[-1]['rate_mbps']:g} MB/s"
        elif not faster:
            sweep = f"queries/s behind full at every simulated rate down to {rated[0]['rate_mbps']:g} MB/s"
        else:
            sweep = f"queries/s ahead at <= {max(faster):g} MB/s, behind at >= {min(slower):g} MB/s"
        saved = statistics.median(r["cold"]["full"]["bytes_per_query"] - r["cold"][m]["bytes_per_query"] for r in rows)
        extra = statistics.median(r["cold"][m]["rebuild_ms"] - r["cold"]["full"]["rebuild_ms"] for r in rows) / 1e3
        bound = f"{saved / extra / 1e6:.0f} MB/s" if extra > 0 else "any rate (its rebuild is no slower)"
        out[m] = f"{sweep}; KV assembly beats full's below {bound} ({saved / 2**20:.1f} MiB saved per query for " \
                 f"{extra * 1e3:.0f} ms more rebuild)"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for the report and the local stores (required unless --render)")
    p.add_argument("--shots", type=int, default=256)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--n-queries", type=int, default=4)
    p.add_argument("--ratios", default="0.5,0.25")
    p.add_argument("--rates", default="25M,50M,200M,1G,0", help="simulated link rates, bytes/s (0: no proxy)")
    p.add_argument("--chunk-sizes", default="1M,4M,8M,32M,64M")
    p.add_argument("--render", metavar="JSON", help="only render the markdown of a saved bench_remote.json")
    p.add_argument("--reads-only", action="store_true", help="only raw range GETs vs milo's read path, no model")
    p.add_argument("--read-block-tokens", type=int, default=768,
                   help="--reads-only: tokens per block at rank 64 (768: about the full store's 18 MiB blocks)")
    args = p.parse_args(argv)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        if "reads" in report:
            print(render_reads(report))
            return 0
        report["crossover"] = crossover(report["e2e"]["rows"])
        print(render(report))
        return 0
    if not args.out:
        p.error("--out is required")
    torch.set_num_threads(1)
    args.rates = [parse_rate(r) for r in args.rates.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    out = Path(args.out)
    tmp = out / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    moto, endpoint = start_moto()
    if args.reads_only:
        try:
            reads = read_path(args, tmp)
        finally:
            moto.terminate()
            moto.wait()
        import moto as moto_pkg
        report = {"date": str(date.today()), "command": "python tools/bench_remote.py " + " ".join(sys.argv[1:]),
                  "moto": moto_pkg.__version__, "k": args.k, "n_queries": args.n_queries, "reads": reads,
                  "block_mib": 180 * 64 * (args.read_block_tokens + 65) * 2 / 2**20}
        (out / "bench_remote.json").write_text(json.dumps(report, indent=2))
        print(render_reads(report))
        return 0
    try:
        chunks = chunk_sweep([parse_size(s) for s in args.chunk_sizes.split(",")], tmp, blocks=24, block_tokens=512,
                             rank=32, k=args.k, n_queries=6)
        loaded = load_model("default")
        train, test, task = load_dataset("banking77")
        local = throughput.real_stores(out / "stores", loaded, train[:args.shots], task, ratios)
        urls = {}
        for name, path in local.items():
            urls[name] = f"s3://{BUCKET}/e2e-{name}"
            push(path, urls[name], force=True)
        e2e = end_to_end(args, loaded, urls, [t.input for t in test[:args.n_queries]], tmp)
    finally:
        moto.terminate()
        moto.wait()
    import moto as moto_pkg
    block_mib = 180 * 32 * (512 + 65) * 2 / 2**20
    report = {"date": str(date.today()), "command": "python tools/bench_remote.py " + " ".join(sys.argv[1:]),
              "moto": moto_pkg.__version__, "threads": torch.get_num_threads(), "chunks": chunks, "chunk_k": args.k,
              "chunk_block_mib": block_mib, "e2e": e2e, "model": loaded.identity["name"], "shots": args.shots,
              "k": args.k, "n_queries": args.n_queries, "crossover": crossover(e2e["rows"])}
    (out / "bench_remote.json").write_text(json.dumps(report, indent=2))
    md = render(report)
    (out / "bench_remote.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
