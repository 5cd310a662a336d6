"""Hit rates of the device tier (milo_infer.runtime.device_tier.DeviceTier) on a real query stream, per tier size.

Each query retrieves its blocks as `milo query` would (the store's BM25 index, top-k groups); the tier
sees those blocks in order, one query after another. Sizes are given in MiB of device memory, so the
same sizes compare stores of different ratios: at ρ the same bytes hold about 1/ρ as many blocks as a
tier of the full store's. Blocks are placeholders on the meta device (sizes only, no memory), so the
stream's hits are exactly what a tier of that size would see. No model is loaded.

Run: ``python tools/device_tier_hits.py STORE [STORE ...] --dataset banking77 --k 6 --mib 8,32,128``
(queries: the data set's test split in the file's order, then shuffled with --seed).
"""
import argparse
import random

import torch

from milo_infer.tasks.datasets import load_dataset
from milo_infer.runtime.retrieval import store_retriever
from milo_store import MiloStore
from milo_infer.runtime.device_tier import DeviceTier


def stream_hits(store: MiloStore, queries: list[str], k: int, limit_bytes: int) -> dict:
    """The tier's stats after every query's blocks went through a tier of ``limit_bytes``."""
    retriever = store_retriever(store)
    tier = DeviceTier(limit_bytes, "meta")
    for q in queries:
        for b in store.blocks_of(retriever.select(q, k=min(k, store.num_groups))):
            if tier.get((str(store.path), b)) is None:
                n = int(store.offsets[b + 1] - store.offsets[b])
                tier.put((str(store.path), b), torch.empty(n, dtype=store.torch_dtype, device="meta"))
    return tier.stats()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--dataset", default="banking77")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--mib", default="8,32,128", help="tier sizes in MiB, comma-separated")
    ap.add_argument("--queries", type=int, default=0, help="first N test queries (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the shuffled stream")
    args = ap.parse_args()
    _, test, _ = load_dataset(args.dataset, shuffle=False)
    in_order = [t.input for t in test][:args.queries or None]
    shuffled = random.Random(args.seed).sample(in_order, len(in_order))
    sizes = [float(x) for x in args.mib.split(",")]
    print(f"{args.dataset}: {len(in_order)} test queries, k = {args.k}")
    print("| store | ρ | block MiB (mean) | tier MiB | blocks held | hit rate, file order | hit rate, shuffled |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.stores:
        with MiloStore.open(path, tier="disk", verify=False) as store:
            ratio = store.accounting()["ratio"]
            mean = float(store.block_bytes(range(store.num_blocks)).mean()) / 2**20
            for mib in sizes:
                limit = int(mib * 2**20)
                ordered, mixed = stream_hits(store, in_order, args.k, limit), stream_hits(store, shuffled, args.k, limit)
                print(f"| {path} | {ratio:.3f} | {mean:.2f} | {mib:g} | {ordered['blocks']} | "
                      f"{ordered['hit_rate']:.1%} | {mixed['hit_rate']:.1%} |")


if __name__ == "__main__":
    main()
