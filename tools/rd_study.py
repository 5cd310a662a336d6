"""Rate–distortion study of issue 45: the attention output error real queries see against real bytes,
for today's codec, its variants and a transform codec (milo_infer.evaluation.rd_study).

    python tools/rd_study.py --dataset banking77 --shots 512 --queries 16 --work /tmp/rd45 --threads 1

Builds (once, kept under --work) `milo build`'s default store with its staging, then prints one markdown
table row per (codec, ratio) and the transform's fit-size sweep.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from milo_infer.evaluation import rd_study  # noqa: E402
from milo_infer.models import load_model  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default', a GGUF, or a transformers directory")
    p.add_argument("--dataset", default="banking77")
    p.add_argument("--shots", type=int, default=512)
    p.add_argument("--queries", type=int, default=16, help="test items whose query tokens score the blocks")
    p.add_argument("--calibration", type=int, default=8,
                   help="demonstrations past --shots whose queries calibrate transform+attn")
    p.add_argument("--ratios", default="0.25,0.125,0.0625")
    p.add_argument("--codecs", default=",".join(rd_study.CODECS))
    p.add_argument("--sweep-ratio", type=float, default=0.125, help="ratio of the transform's fit-size sweep (0: none)")
    p.add_argument("--work", default=os.path.join(os.environ.get("MILO_CACHE", "/tmp"), "rd_study"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    codecs = [c for c in args.codecs.split(",") if c]
    for c in codecs:
        if c not in rd_study.CODECS:
            p.error(f"unknown codec {c!r}; expected some of {', '.join(rd_study.CODECS)}")
    started = time.perf_counter()
    loaded = load_model(args.model)
    train, test, task = load_dataset(args.dataset, seed=args.seed)
    store, staging = rd_study.staged_store(loaded, train[:args.shots], task,
                                           Path(args.work) / f"{args.dataset}-{args.shots}-s{args.seed}", args.seed)
    calibration = train[args.shots:args.shots + args.calibration]  # demonstrations the store does not hold
    data = rd_study.prepare(loaded, store, staging, test, task, args.queries, calibration)
    print(f"{args.dataset}, {args.shots} shots, seed {args.seed}: {len(data.blocks)} blocks "
          f"({int(data.tokens.sum())} tokens; fit on {len(data.fit)}, measured on {len(data.held_out)} held out), "
          f"{data.queries.shape[1]} query tokens from {args.queries} test items", flush=True)
    print("\n| codec | ρ target | ρ measured | attention out rel. err | K rel. err (weighted) | V rel. err (weighted) | note |")
    print("|---|---|---|---|---|---|---|")
    for ratio in [float(r) for r in args.ratios.split(",") if r]:
        for codec in codecs:
            r = rd_study.run(data, codec, ratio)
            note = r["note"] + (f"; zstd would take it to ρ {r['zstd']:.4f}" if "zstd" in r else "")
            print(f"| {codec} | {ratio:g} | {r['measured']:.4f} | {r['attention']:.4f} | {r['keys']:.4f} | "
                  f"{r['values']:.4f} | {note} |", flush=True)
    if args.sweep_ratio:
        print(f"\ntransform+attn at ρ {args.sweep_ratio:g}, fitted on the first k fit blocks, measured on the held-out ones:\n")
        print("| fit blocks | fit tokens | ρ measured | attention out rel. err | K rel. err | V rel. err |")
        print("|---|---|---|---|---|---|")
        for r in rd_study.fit_sweep(data, args.sweep_ratio):
            print(f"| {r['fit_blocks']} | {r['fit_tokens']} | {r['measured']:.4f} | {r['attention']:.4f} | "
                  f"{r['keys']:.4f} | {r['values']:.4f} |", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
