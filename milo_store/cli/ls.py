"""List a store's blocks: tokens, demonstrations, K and V ranks, bytes."""
import numpy as np

from ..store import MiloStore
from .common import human_bytes, print_json


def add_arguments(p):
    p.add_argument("path", help="store directory or URL (s3://bucket/prefix, gs://, az://, file://)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def block_rows(store: MiloStore) -> list[dict]:
    per_block = np.bincount(np.asarray(store.examples()["block"], dtype=np.int64), minlength=store.num_blocks)
    rows = []
    for i in range(store.num_blocks):
        k, v = store.ranks[i, :, 0].astype(int), store.ranks[i, :, 1].astype(int)
        rows.append({"block": i, "tokens": int(store.block_tokens[i]), "demonstrations": int(per_block[i]),
                     "key_rank": {"min": int(k.min()), "mean": round(float(k.mean()), 2), "max": int(k.max())},
                     "value_rank": {"min": int(v.min()), "mean": round(float(v.mean()), 2), "max": int(v.max())},
                     "bytes": int(store.offsets[i + 1] - store.offsets[i]) * store.itemsize})
    return rows


def run(args) -> int:
    with MiloStore.open(args.path, tier="disk", verify=False) as store:
        rows = block_rows(store)
    if args.json:
        print_json(rows)
        return 0
    print(f"{'block':>6} {'tokens':>7} {'demos':>6} {'K rank min/mean/max':>20} {'V rank min/mean/max':>20} {'bytes':>11}")
    for r in rows:
        k, v = r["key_rank"], r["value_rank"]
        print(f"{r['block']:>6} {r['tokens']:>7} {r['demonstrations']:>6} {k['min']:>6}/{k['mean']:>6.1f}/{k['max']:<6} "
              f"{v['min']:>6}/{v['mean']:>6.1f}/{v['max']:<6} {human_bytes(r['bytes']):>11}")
    return 0
