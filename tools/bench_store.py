"""Store benchmark: build, open and per-query block reads of each tier, beside raw bandwidths measured in the same run.

Shape: 512 demonstrations of a 3B-class model (36 layers, 2 KV heads, d=128), 16 blocks of
about 1000 tokens (16k tokens), ratio 0.5. Baselines over the very same byte ranges: ``os.preadv``
from the page cache into a preallocated buffer (raw read), ``torch`` copy (memcpy), and zarr's own
slice read. Run: ``.venv/bin/python tools/bench_store.py [--blocks 16 --tokens 1000 --k 6]``.
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zarr

from milo_infer.bench.throughput import median_seconds
from milo_store import CompressionConfig, Layout, MiloStore, Staging, factorize_block, write_store
from milo_store import format as fmt
from milo_store.synthetic import synthetic_block_kv


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--k", type=int, default=6, help="blocks read per query")
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where to build (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    layout = Layout(args.layers, args.kv_heads, args.head_dim)
    root = Path(args.dir or tempfile.mkdtemp(prefix="milo-bench-"))
    rng = np.random.default_rng(0)
    tokens = rng.integers(int(args.tokens * 0.8), int(args.tokens * 1.2), args.blocks)
    g = torch.Generator().manual_seed(0)
    kv = [synthetic_block_kv(layout, int(t), g) for t in tokens]

    t0 = time.perf_counter()
    staging = Staging(root / "staging", {"bench": 1})
    svd_s = 0.0
    for i, (k, v) in enumerate(kv):
        t = time.perf_counter()
        f = factorize_block(k, v)
        svd_s += time.perf_counter() - t
        staging.put(i, f)
    stage_s = time.perf_counter() - t0
    t = time.perf_counter()
    path = write_store(root / "store", staging, len(kv), layout, CompressionConfig(ratio=args.ratio), force=True)
    write_s = time.perf_counter() - t
    open_s = {tier: median_seconds(lambda: MiloStore.open(path, tier=tier).close(), 3) for tier in ("disk", "host")}

    stores = {"host": MiloStore.open(path, tier="host"), "disk": MiloStore.open(path, tier="disk"),
              "disk (no verify)": MiloStore.open(path, tier="disk", verify=False)}
    ref = stores["disk"]
    queries = [rng.choice(ref.num_blocks, size=min(args.k, ref.num_blocks), replace=False) for _ in range(args.queries)]
    nbytes = [int(ref.block_bytes(q).sum()) for q in queries]
    mean_bytes = statistics.mean(nbytes)

    def per_query(read_block):
        def run():
            for q in queries:
                for i in q:
                    read_block(int(i))
        run()  # warm the page cache
        return median_seconds(run, 3) / len(queries)

    rows = {name: per_query(s.block) for name, s in stores.items()}
    # the same byte ranges, raw: preadv into a preallocated buffer, no checks
    # stored items, which the offsets count (a bits store's are bytes, decoded into fp16 factors by `block`)
    buf = torch.empty(int(max(ref.offsets[1:] - ref.offsets[:-1])), dtype=ref.stored_torch_dtype)
    rows["raw preadv"] = per_query(lambda i: ref.read_range(int(ref.offsets[i]), int(ref.offsets[i + 1]),
                                                              buf[:int(ref.offsets[i + 1] - ref.offsets[i])]))
    host = stores["host"]
    dst = torch.empty_like(buf)
    rows["memcpy"] = per_query(lambda i: dst[:int(ref.offsets[i + 1] - ref.offsets[i])].copy_(host.stored_blocks([i])[0]))
    # the same bytes as one zarr array (what format 3 kept: equal chunks, the store's chunk size), sliced by zarr
    flat = torch.cat(ref.stored_blocks(list(range(ref.num_blocks))))
    z = zarr.create_array(str(root / "flat"), data=fmt.to_numpy(flat), compressors=None,
                          chunks=(fmt.MAX_CHUNK_BYTES // ref.stored_itemsize,))
    rows["zarr slice"] = per_query(lambda i: z[int(ref.offsets[i]):int(ref.offsets[i + 1])])

    acc = ref.accounting()
    print(f"store: {args.blocks} blocks, {int(tokens.sum())} tokens, {layout}, ratio {args.ratio}")
    print(f"bytes: full fp16 KV {acc['full_fp16_bytes'] / 2**20:.1f} MiB, accounted {acc['total_bytes'] / 2**20:.1f} MiB "
          f"(ratio {acc['ratio']:.4f}), on disk {acc['disk_bytes'] / 2**20:.1f} MiB")
    print(f"build: SVD {svd_s:.2f} s, stage (SVD + staging writes) {stage_s:.2f} s, allocate + write {write_s:.2f} s")
    print(f"open: disk tier {open_s['disk'] * 1e3:.1f} ms, host tier {open_s['host'] * 1e3:.1f} ms (reads + verifies all)")
    print(f"\nper query: {args.k} random blocks, {mean_bytes / 2**20:.2f} MiB")
    print("| read path | ms/query | GB/s | vs raw preadv |\n|---|---:|---:|---:|")
    for name, s in rows.items():
        print(f"| {name} | {s * 1e3:.2f} | {mean_bytes / s / 1e9:.2f} | {rows['raw preadv'] / s:.2f} |")
    copies = host.block(host.num_blocks - 1).untyped_storage().data_ptr() == host.block(0).data_ptr()
    print(f"\nhost tier block is a zero-copy view: {copies}")
    for s in stores.values():
        s.close()
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
