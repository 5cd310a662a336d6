"""List a store's blocks: tokens, demonstrations, K and V ranks, bytes (a page at a time: --offset, --limit)."""
import argparse

import numpy as np

from .. import text_index
from ..layout import RAW_RANK
from ..store import MiloStore
from .common import human_bytes, print_json


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def add_arguments(p):
    p.add_argument("path", help="store directory or URL (s3://bucket/prefix, gs://, az://, file://)")
    p.add_argument("--offset", type=non_negative, default=0, help="first block listed (default 0)")
    p.add_argument("--limit", type=non_negative, default=100, help="most blocks listed (default 100; 0: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def demonstrations_per_block(store: MiloStore, start: int, stop: int) -> np.ndarray:
    """From the BM25 index's block starts (a few entries); stores without it count every demonstration's block."""
    found = store.index_arrays(text_index.NAME, check=False)
    if found is not None:
        return np.diff(np.asarray(found[1]["block_starts"][start:stop + 1], dtype=np.int64))
    return np.bincount(np.asarray(store.examples()["block"], dtype=np.int64), minlength=store.num_blocks)[start:stop]


def rank_summary(ranks: np.ndarray) -> dict:
    """min/mean/max rank of a block's factored units of one kind, and how many are raw (RAW_RANK)."""
    r = ranks.astype(int).ravel()
    factored = r[r != RAW_RANK]
    if not len(factored):
        return {"min": None, "mean": None, "max": None, "raw": len(r)}
    return {"min": int(factored.min()), "mean": round(float(factored.mean()), 2), "max": int(factored.max()),
            "raw": int(len(r) - len(factored))}


def block_rows(store: MiloStore, offset: int = 0, limit: int = 0) -> list[dict]:
    start = min(offset, store.num_blocks)
    stop = store.num_blocks if limit == 0 else min(start + limit, store.num_blocks)
    per_block = demonstrations_per_block(store, start, stop)
    rows = []
    for i in range(start, stop):
        rows.append({"block": i, "tokens": int(store.block_tokens[i]), "demonstrations": int(per_block[i - start]),
                     "key_rank": rank_summary(store.ranks[i, :, 0]), "value_rank": rank_summary(store.ranks[i, :, 1]),
                     "bytes": int(store.offsets[i + 1] - store.offsets[i]) * store.itemsize})
    return rows


def _ranks(s: dict) -> str:
    if s["min"] is None:
        return f"{'all raw':>20} {s['raw']:>5}"
    return f"{s['min']:>6}/{s['mean']:>6.1f}/{s['max']:<6} {s['raw']:>5}"


def run(args) -> int:
    with MiloStore.open(args.path, tier="disk", verify=False) as store:
        rows = block_rows(store, args.offset, args.limit)
        total = store.num_blocks
    if args.json:
        print_json(rows)
        return 0
    print(f"{'block':>6} {'tokens':>7} {'demos':>6} {'K rank min/mean/max raw':>26} {'V rank min/mean/max raw':>26} "
          f"{'bytes':>11}")
    for r in rows:
        print(f"{r['block']:>6} {r['tokens']:>7} {r['demonstrations']:>6} {_ranks(r['key_rank'])} "
              f"{_ranks(r['value_rank'])} {human_bytes(r['bytes']):>11}")
    if len(rows) < total:
        first = rows[0]["block"] if rows else args.offset
        print(f"blocks {first}..{first + len(rows) - 1} of {total} listed (--offset, --limit; --limit 0 lists all)")
    return 0
