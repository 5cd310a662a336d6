"""One worker's share of a request's blocks, read two ways: whole blocks, or only the share's byte ranges.

A block's factors are laid out layer after layer, and inside a layer K heads 0..H-1 then V heads 0..H-1
(docs/format.md), so a pipeline stage's layers are one byte range per block and a tensor-parallel rank's
heads two per layer. The layout allows reading just those; but a block's CRC32C covers the whole block,
so bytes read in part cannot be checked, and the block caches keep whole blocks. This measures what
reading only the share would save: bytes and seconds per request of ``--k`` blocks, whole blocks
(``MiloStore.blocks``, disk tier: preadv, then the CRC32C check) against the share's ranges (preadv per
range, unchecked), page cache warm (the store is read once first), median of ``--rounds``.

    .venv/bin/python tools/bench_share_reads.py STORE --k 4 --rounds 50
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from milo_store import MiloStore  # noqa: E402


def share_ranges(store: MiloStore, block: int, layers: range, heads: range) -> list[tuple[int, int]]:
    """(start, stop) values of the flat factor array holding ``block``'s K and V of ``heads`` in ``layers``; the
    whole block where the codec's stored bytes are not segments laid out layer by layer (a bits block)."""
    if not store.codec.segments_stored:
        return [(int(store.offsets[block]), int(store.offsets[block + 1]))]
    sizes = store.layout.segment_sizes(store.ranks[block:block + 1], store.block_tokens[block:block + 1])[0]  # [L, 2, H]
    bounds = store.block_layer_bounds(block) + int(store.offsets[block])
    ranges = []
    for layer in layers:
        at = int(bounds[layer])
        for kind in range(2):
            start = at + int(sizes[layer, :kind].sum()) + int(sizes[layer, kind, :heads.start].sum())
            ranges.append((start, start + int(sizes[layer, kind, heads.start:heads.stop].sum())))
    merged = []  # a stage of every head: each layer's ranges touch, read them as one
    for a, z in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], z)
        else:
            merged.append((a, z))
    return merged


def read_ranges(store: MiloStore, ranges: list[tuple[int, int]]) -> int:
    out = torch.empty(sum(z - a for a, z in ranges), dtype=store.stored_torch_dtype)
    at = 0
    for a, z in ranges:
        store.read_range(a, z, out[at:at + z - a])
        at += z - a
    return out.numel() * store.stored_itemsize  # the offsets count stored items, bytes for a bits store


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--k", type=int, default=4, help="blocks per request")
    p.add_argument("--rounds", type=int, default=50)
    args = p.parse_args()
    store = MiloStore.open(args.store, tier="disk")
    L, H = store.layout.num_layers, store.layout.num_kv_heads
    shares = {"whole": (range(L), range(H)), f"stage 1 of 2 (layers 0..{L // 2 - 1})": (range(L // 2), range(H)),
              f"rank 1 of {H} (head 0)": (range(L), range(1))}
    rng = np.random.default_rng(0)
    requests = [sorted(rng.choice(store.num_blocks, size=min(args.k, store.num_blocks), replace=False).tolist())
                for _ in range(args.rounds)]
    store.blocks(list(range(store.num_blocks)))  # warm the page cache: both ways read cached pages
    rows = {}
    for name, (layers, heads) in shares.items():
        whole, part, whole_bytes, part_bytes, part_reads = [], [], [], [], []
        for ids in requests:
            t = time.perf_counter()
            store.blocks(ids)
            whole.append(time.perf_counter() - t)
            whole_bytes.append(int(store.block_bytes(ids).sum()))
            ranges = [r for b in ids for r in share_ranges(store, b, layers, heads)]
            t = time.perf_counter()
            part_bytes.append(read_ranges(store, ranges))
            part.append(time.perf_counter() - t)
            part_reads.append(len(ranges))
        rows[name] = {"whole_bytes": statistics.mean(whole_bytes), "whole_ms": statistics.median(whole) * 1e3,
                      "share_bytes": statistics.mean(part_bytes), "share_reads": statistics.mean(part_reads),
                      "share_ms": statistics.median(part) * 1e3}
    print(json.dumps({"store": str(store.path), "layers": L, "kv_heads": H, "k": args.k, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
