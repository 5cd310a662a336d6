"""Compile every reconstruction-kernel variant the query path can launch for sm_80 and sm_90, without a GPU.

Per variant (factor dtype x RoPE layout (rotate-half, interleaved, partial rotate-half) x head dim, with the tiles
`milo_kernels.plan.tile_config` picks): compile seconds, registers per thread, spill bytes,
shared memory and the occupancy they allow. Exits 1 if a variant fails to compile or spills.

    python tools/compile_kernels.py                       # everything, both targets
    python tools/compile_kernels.py --cc 90 --dtype fp16 int8 --head-dim 128 --json
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")  # time the compiler, not triton's cache
os.environ.pop("TRITON_INTERPRET", None)  # the interpreter cannot compile
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from milo_kernels.aot import FACTORS, HEAD_DIMS, LAYOUTS, SM, compile_variant, variants  # noqa: E402

COLUMNS = ("variant", "cc", "block_t", "block_r", "block_h", "num_warps", "num_stages", "compile_s", "registers",
           "spill_bytes", "shared_bytes", "blocks_per_sm", "occupancy", "limited_by")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cc", type=int, nargs="+", default=sorted(SM), choices=sorted(SM))
    p.add_argument("--dtype", nargs="+", default=list(FACTORS), choices=list(FACTORS))
    p.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--layout", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                   help="RoPE layout: rotate-half, interleaved pairs, or rotate-half over the first rotary_dim channels")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    args = p.parse_args()
    todo = variants(args.dtype, args.head_dim, args.layout)
    rows, failed = [], 0
    if not args.json:
        print(" ".join(f"{c:>{width(c)}}" for c in COLUMNS), flush=True)
    for cc in args.cc:
        for v in todo:
            try:
                row = compile_variant(v, cc)
            except Exception as error:  # a variant that does not compile is a result to report
                row = dict(variant=v.name, cc=cc, error=f"{type(error).__name__}: {error}"[:500])
            failed += "error" in row or row["spill_bytes"] > 0
            rows.append(row)
            if not args.json:
                print(" ".join(f"{row.get(c, ''):>{width(c)}}" for c in COLUMNS) + (f"  {row['error']}"
                                                                                  if "error" in row else ""), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        import triton
        print(f"triton {triton.__version__}: {len(rows)} variants, {failed} failed to compile or spill")
    sys.exit(1 if failed else 0)


def width(column):
    return 20 if column == "variant" else max(len(column), 5)


if __name__ == "__main__":
    main()
