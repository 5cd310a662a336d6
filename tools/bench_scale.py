"""Corpus-scale benchmark without a model: index build, store open, retrieval and block lookup, RSS at mount.

For each size, a store of N demonstrations in blocks of 32 over a tiny model shape (1 layer, 1 KV
head, d = 8: the K/V is beside the point here) is built with ``milo_store.synthetic``; its text is
real Banking77 and CLINC150 training utterances, repeated with variation past the first copy (a
word dropped, two neighbours swapped, a vocabulary word inserted), so term statistics stay those of
real short intent queries. Queries: Banking77 test utterances. One thread. rank-bm25 (what
retrieval used before the stored index) is measured beside it on the same corpus up to
``--oracle-max``. Mount (open + map and checksum the index + the retriever) and its RSS are measured in
a fresh process, RSS as the growth over the process after imports and a warm-up mount; so are
``milo-store ls`` (first 20 blocks) and ``stat`` (their work, without the interpreter's start), the first
query (where a format-4 index reads its segments' vocabularies into its term table), then every query,
each beside the same query on a format-3 index of the same demonstrations (built in that process, in
memory; it must select the same blocks), so the ratio of the two is measured in one run. Stores are
deleted afterwards.

Run: ``PYTHONPATH=. .venv/bin/python tools/bench_scale.py [--sizes 10000 90000 1000000]``.
"""
import argparse
import csv
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEMOS_PER_BLOCK = 32
TOKENS_PER_BLOCK = 16  # K/V rows per block: small, so the 1M store stays a few hundred MB


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def real_utterances(data: Path) -> tuple[list[str], list[str]]:
    """(Banking77 + CLINC150 training utterances, Banking77 test utterances)."""
    def banking(split):
        with open(data / f"banking77/banking_data/{split}.csv", encoding="utf-8", newline="") as f:
            return [row["text"] for row in csv.DictReader(f)]
    clinc = json.loads((data / "clinc150/data/data_full.json").read_text(encoding="utf-8"))
    return banking("train") + [text for text, _ in clinc["train"]], banking("test")


def varied_corpus(base: list[str], n: int, seed: int = 0) -> list[str]:
    """``n`` texts: ``base`` once as is, then copies each varied by a dropped word, a swap and an inserted word."""
    rng = random.Random(seed)
    vocabulary = sorted({w for t in base for w in t.split()})
    out = list(base[:n])
    while len(out) < n:
        words = base[len(out) % len(base)].split()
        if len(words) > 2:
            del words[rng.randrange(len(words))]
            i = rng.randrange(len(words) - 1)
            words[i], words[i + 1] = words[i + 1], words[i]
        words.insert(rng.randrange(len(words) + 1), rng.choice(vocabulary))
        out.append(" ".join(words))
    return out


def percentiles(seconds: list[float]) -> tuple[float, float]:
    ms = np.array(seconds) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def probe_mount(path: str, queries: list[str], k: int) -> dict:
    """In a fresh process: mount (open + retriever) and its RSS growth, ``ls`` and ``stat`` of the store,
    then per-query retrieval and block lookup. One warm-up mount first, so imports and first-use
    allocations are not counted as the mount's."""
    import gc

    import torch

    from milo_infer.runtime.retrieval import BM25BlockRetriever, store_retriever
    from milo_store import MiloStore
    from milo_store.report import block_rows, describe
    from milo_store.text_index import TextIndex, build_text_index

    torch.set_num_threads(1)
    with MiloStore.open(path, tier="disk", verify=False) as store:
        store_retriever(store)
    gc.collect()
    base = rss_bytes()
    out = {}
    for verify in (False, True):
        t = time.perf_counter()
        store = MiloStore.open(path, tier="disk", verify=verify)
        retriever = store_retriever(store)
        out[f"mount_s_verify_{verify}"] = time.perf_counter() - t
        out[f"rss_mount_verify_{verify}"] = rss_bytes() - base
        if not verify:
            store.close()
            del store, retriever
            gc.collect()
    for name, fn in (("ls", lambda s: block_rows(s, 0, 20)), ("stat", describe)):
        t = time.perf_counter()
        with MiloStore.open(path, tier="disk", verify=False) as s:
            fn(s)
        out[f"cli_{name}_s"] = time.perf_counter() - t
    t = time.perf_counter()
    retriever.select("first query", k=k)  # a format-4 index builds its term table here
    out["first_query_s"] = time.perf_counter() - t
    out["rss_after_first_query"] = rss_bytes() - base
    # format 3's index of the same demonstrations (built here, in memory), queried beside it: the ratio
    examples = store.examples()
    index3 = TextIndex(build_text_index(examples["input"], examples["block"], store.num_blocks))
    group_starts = index3.block_starts[np.searchsorted(store.block_group, np.arange(store.num_groups + 1))]
    format3 = BM25BlockRetriever.from_index(index3, group_starts, store.group_tokens())
    retrieve, lookup, retrieve3 = [], [], []
    for q in queries:
        t = time.perf_counter()
        groups = retriever.select(q, k=k)
        t1 = time.perf_counter()
        for b in store.blocks_of(groups):
            store.block(b)
        t2 = time.perf_counter()
        if format3.select(q, k=k) != groups:
            raise AssertionError(f"format 3's index selects other blocks for {q!r}")
        retrieve3.append(time.perf_counter() - t2)
        retrieve.append(t1 - t)
        lookup.append(t2 - t1)
    out["retrieve_ms"], out["lookup_ms"] = percentiles(retrieve), percentiles(lookup)
    out["format3_retrieve_ms"] = percentiles(retrieve3)
    store.close()
    return out


def run_size(n: int, base: list[str], queries: list[str], root: Path, args) -> dict:
    from rank_bm25 import BM25Okapi

    from milo_store import CompressionConfig, Layout, segments, text_index
    from milo_store.synthetic import build_synthetic_store
    from milo_store.text_index import tokenize

    texts = varied_corpus(base, n)
    blocks = np.arange(n) // DEMOS_PER_BLOCK
    num_blocks = int(blocks[-1]) + 1
    row = {"demonstrations": n, "blocks": num_blocks}
    t = time.perf_counter()  # what a build indexes: the vocabulary, and each text segment's postings
    vocabulary, _ = text_index.vocabulary(texts)
    runs = segments.split([DEMOS_PER_BLOCK] * num_blocks, 0, num_blocks, segments.segment_demos(n))
    postings = [text_index.segment_postings(texts[a * DEMOS_PER_BLOCK:z * DEMOS_PER_BLOCK]) for a, z in runs]
    row["index_build_s"] = time.perf_counter() - t
    row["index_bytes"] = sum(a.nbytes for part in [vocabulary, *postings] for a in part.values())
    row["vocabulary"], row["segments"] = len(vocabulary["term_starts"]) - 1, len(runs)
    del vocabulary, postings
    if n <= args.oracle_max:
        t = time.perf_counter()
        oracle = BM25Okapi([tokenize(x) for x in texts])
        row["rank_bm25_index_s"] = time.perf_counter() - t
        times = []
        for q in queries[:args.oracle_queries]:
            t = time.perf_counter()
            oracle.get_scores(tokenize(q))
            times.append(time.perf_counter() - t)
        row["rank_bm25_ms"] = percentiles(times)
        del oracle
    path = root / f"store-{n}"
    t = time.perf_counter()
    build_synthetic_store(path, Layout(1, 1, 8), [TOKENS_PER_BLOCK] * num_blocks, CompressionConfig(ratio=0.5),
                          texts=texts, example_block=blocks.tolist(), force=True)
    row["store_build_s"] = time.perf_counter() - t
    row["store_disk_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    row["index_disk_bytes"] = sum(f.stat().st_size for f in (path / "indexes" / text_index.NAME).rglob("*")
                                  if f.is_file())  # the vocabulary; the postings are in the text segments
    probe = subprocess.run([sys.executable, __file__, "--probe", str(path), "--queries", str(args.queries),
                            "--k", str(args.k)], check=True, capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    row.update(json.loads(probe.stdout.strip().splitlines()[-1]))
    shutil.rmtree(path)
    return row


def report(row: dict) -> None:
    mb = 1 / 2 ** 20
    r50, r99 = row["retrieve_ms"]
    l50, l99 = row["lookup_ms"]
    f50, f99 = row["format3_retrieve_ms"]
    line = (f"N={row['demonstrations']:>8} blocks={row['blocks']:>6} vocab={row['vocabulary']:>6} "
            f"segments={row['segments']:>3} | index build "
            f"{row['index_build_s']:6.2f} s, {row['index_bytes'] * mb:7.1f} MiB | store build {row['store_build_s']:6.1f} s"
            f" | mount {row['mount_s_verify_False'] * 1e3:7.1f} ms ({row['mount_s_verify_True'] * 1e3:7.1f} ms with"
            f" index CRC) | first query {row['first_query_s'] * 1e3:6.1f} ms | retrieve p50 {r50:6.2f} p99 {r99:6.2f}"
            f" ms (format 3's index p50 {f50:6.2f} p99 {f99:6.2f} ms: {r50 / f50:.2f}x) | lookup p50 {l50:5.2f} p99 {l99:5.2f} ms | RSS at"
            f" mount +{row['rss_mount_verify_False'] * mb:6.1f} MiB (+{row['rss_mount_verify_True'] * mb:6.1f} MiB"
            f" with CRC; {row['rss_mount_verify_True'] / row['index_bytes']:.2f}x index) | ls {row['cli_ls_s'] * 1e3:.0f} ms,"
            f" stat {row['cli_stat_s'] * 1e3:.0f} ms")
    if "rank_bm25_ms" in row:
        o50, o99 = row["rank_bm25_ms"]
        line += f" | rank-bm25 p50 {o50:7.1f} p99 {o99:7.1f} ms ({o50 / r50:.0f}x)"
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 90_000, 1_000_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--oracle-max", type=int, default=90_000, help="largest size rank-bm25 is measured at")
    ap.add_argument("--oracle-queries", type=int, default=50)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    ap.add_argument("--dir", default=None, help="where stores are built (default: a temp dir under /tmp)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: measure one mount in this process
    args = ap.parse_args()
    base, queries = real_utterances(Path(args.data))
    queries = queries[:args.queries]
    if args.probe:
        print(json.dumps(probe_mount(args.probe, queries, args.k)))
        return
    import torch
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="milo-scale-", dir=args.dir))
    rows = []
    try:
        for n in args.sizes:
            rows.append(run_size(n, base, queries, root, args))
            report(rows[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
