"""Build benchmark: a many-shot Banking77 store with the default model, through the real build path.

Reports what decides whether building is practical: block tokens encoded per second (what the
store holds), forward tokens per second (each block is encoded after the anchor and its context
blocks, so the model runs on more tokens than it keeps), and the share of build time spent
compressing (factorize + rank allocation + write; goal <= 20%, the rest is the model's forward
passes). Run:

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_build.py --shots 512 --ratio 0.5
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_build.py --ratio 0.125 --codecs svd,bits --threads 1

(the second: issue 45's "build time <= 1.5x today's at the same ratio", both codecs in one run).
"""
import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig, default_compression
from milo_infer.tasks.datasets import load_dataset
from milo_infer.models import load_model
from milo_store import MiloStore


def forward_tokens(block_tokens, anchor_tokens: int, context_blocks: int) -> int:
    """Tokens the model ran on: per block, the anchor, up to ``context_blocks`` previous blocks and itself."""
    return sum(anchor_tokens + sum(block_tokens[max(0, i - context_blocks):i + 1]) for i in range(len(block_tokens)))


def bench(args, loaded, load_s, demos, task, root: Path, codec: str | None) -> float:
    """Build one store as `milo build` would at ``args.ratio`` (``codec`` None: its default there); print the
    report; return the build's seconds."""
    out = root / (codec or "default")
    shutil.rmtree(f"{out}.staging", ignore_errors=True)  # a fresh build, never a resumed one
    compression = default_compression(args.ratio, codec=codec)
    config = BuildConfig(block_size=args.block_size, context_blocks=args.context_blocks, compression=compression)
    t0 = time.perf_counter()
    s = build_store(out, loaded, demos, task, config, force=True, progress=True)
    build_s = time.perf_counter() - t0

    with MiloStore.open(out, tier="disk", verify=False) as store:
        acc = store.accounting()
        block_tokens = [int(t) for t in store.block_tokens]
        anchor_tokens = len(store.meta["build"]["anchor_token_ids"])

    fwd = forward_tokens(block_tokens, anchor_tokens, args.context_blocks)
    stages = s["encode_s"] + s["factorize_s"] + s["write_s"]
    compress = s["factorize_s"] + s["write_s"]
    print(f"machine      {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads")
    print(f"build        {args.dataset} --shots {args.shots} --ratio {args.ratio} --codec {compression.codec} "
          f"--block-size {args.block_size} --context-blocks {args.context_blocks}, model {loaded.identity['name']} "
          f"({load_s:.1f} s to load)")
    print(f"content      {s['blocks']} blocks, {s['demonstrations']} demonstrations, {s['tokens']} block tokens, "
          f"{fwd} forward tokens (anchor {anchor_tokens})")
    print(f"throughput   {s['tokens'] / s['encode_s']:.1f} block tok/s, {fwd / s['encode_s']:.1f} forward tok/s "
          f"(encoding only); {s['tokens'] / build_s:.1f} block tok/s end to end")
    print(f"time         encode {s['encode_s']:.1f} s, factorize {s['factorize_s']:.2f} s, "
          f"allocate + write {s['write_s']:.2f} s, build total {build_s:.1f} s")
    print(f"compress     {100 * compress / stages:.1f}% of build time (factorize + allocation + write; goal <= 20%)")
    print(f"store        ratio {acc['ratio']:.4f} (target {args.ratio}), {acc['total_bytes'] / 2**20:.2f} MiB of "
          f"{acc['full_fp16_bytes'] / 2**20:.2f} MiB full fp16 K/V, {acc['disk_bytes'] / 2**20:.2f} MiB on disk")
    return build_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="banking77")
    ap.add_argument("--shots", type=int, default=512)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--codecs", default="default",
                    help="comma-separated codecs built in turn (svd, bits; default: what milo build picks at "
                         "--ratio); with several, their build times are compared to the first's")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--context-blocks", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--dir", default=None, help="where to build (default: a temp dir, removed afterwards)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="milo-bench-build-"))
    train, _, task = load_dataset(args.dataset, seed=0)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - t0
    codecs = [None if c == "default" else c for c in args.codecs.split(",")]
    seconds = [bench(args, loaded, load_s, train[:args.shots], task, root, codec) for codec in codecs]
    for codec, s in zip(codecs[1:], seconds[1:]):
        print(f"build time   {codec or 'default'}: {s:.1f} s = {s / seconds[0]:.2f}x {codecs[0] or 'default'}'s "
              f"{seconds[0]:.1f} s (one run, one after the other)")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
