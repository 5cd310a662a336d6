"""Profile a decode step op by op (issue 55): torch.profiler around a few steps of a batch of rows decoding.

A random model of a named shape (`milo_infer.bench.synthetic_model`) over a synthetic MILO store, as `milo bench
--synthetic` builds, so it runs anywhere without downloads; per ``--rows`` size: the ops by time, launches and
kernels, host gaps, copies (H2D, D2H), host tensors and syncs per step, and where in milo's code the syncs
and uploads come from (`milo_infer.bench.op_profile`). On a GPU:

    PYTHONPATH=$PWD python tools/profile_step.py --synthetic qwen2.5-7b --device cuda --rows 8,32 --out prof.json

On the CPU at tiny shapes it writes the same report (the CUDA-only counts as null).
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.bench import synthetic_model  # noqa: E402
from milo_infer.bench.op_profile import format_report, profile_decode  # noqa: E402
from milo_infer.bench.step_profile import decoding_batch  # noqa: E402
from milo_infer.runtime.attention import ATTENTIONS  # noqa: E402
from milo_infer.runtime.engine import Engine  # noqa: E402
from milo_infer.runtime.pages import parse_kv_memory  # noqa: E402
from milo_infer.runtime.planning import EngineSettings  # noqa: E402
from milo_store import MiloStore  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", default="tiny", choices=sorted(synthetic_model.SHAPES), help="the model's shape")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8], help="batch sizes")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per batch size (default 3)")
    ap.add_argument("--attention", choices=ATTENTIONS, default="auto")
    ap.add_argument("--shots", type=int, default=64, help="demonstrations in the store (default 64)")
    ap.add_argument("--block-size", type=int, default=8, help="demonstrations per block (default 8)")
    ap.add_argument("--demo-tokens", type=int, default=12, help="tokens per demonstration (default 12)")
    ap.add_argument("--k", type=int, default=4, help="blocks retrieved per row (default 4)")
    ap.add_argument("--ratio", type=float, default=0.5, help="the MILO store's ratio (default 0.5)")
    ap.add_argument("--scattered", action="store_true", help="rows on scattered pages (what served rows get)")
    ap.add_argument("--shared-blocks", choices=("on", "off"), default="on",
                    help="blocks held once for every row (on) or each row's own copy (off; default on)")
    ap.add_argument("--top", type=int, default=15, help="ops listed (default 15)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=parse_kv_memory, default=None,
                    help="the engine's KV budget: 8G, or a share of the free memory")
    ap.add_argument("--stores", default=None, help="where the store is built (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the reports as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = synthetic_model.device_model(args.synthetic, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.stores or tmp)
        paths = synthetic_model.synthetic_stores(root, loaded, demos=args.shots, block_size=args.block_size,
                                                 demo_tokens=args.demo_tokens, ratios=(args.ratio,), methods="milo")
        n_blocks = -(-args.shots // args.block_size)
        texts = synthetic_model.synthetic_queries(max(args.rows), n_blocks, args.k)
        reports = []
        with MiloStore.open(paths[f"milo-r{args.ratio:g}"]) as store:
            engine = Engine(loaded, {"s": store}, EngineSettings(k=args.k), attention=args.attention,
                            max_rows=max(args.rows), kv_cache_memory=args.kv_cache_memory,
                            shared_blocks=args.shared_blocks == "on")
            for rows in args.rows:
                batch = decoding_batch(engine, "s", texts, rows, scattered=args.scattered)
                report = profile_decode(batch, args.steps, top=args.top)
                print(format_report(report), flush=True)
                reports.append(report)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "shape": args.synthetic,
                                              "reports": reports}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
