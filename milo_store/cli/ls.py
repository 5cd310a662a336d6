"""List a store's blocks: tokens, demonstrations, K and V ranks, bytes (a page at a time: --offset, --limit)."""
import argparse

from ..commandline import print_json
from ..report import block_rows, human_bytes
from ..store import MiloStore


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
