"""Throughput under KV offloading: full-KV offload vs MILO at ρ, with the transfer path's limits measured.

Builds (or reuses, under --out) one store per method from one encoding, answers the same queries from
each for every k and batch size, methods interleaved round by round, and prints a markdown table:
queries/s, generated tokens/s, milliseconds per stage, bytes moved and GB/s, speedup vs full and the
1/ρ bound, plus the raw bandwidth of the transfer path and the rebuild kernel's speedup over the
reference, measured in the same run. Writes bench.md, bench.json and (with matplotlib) bench.png.

Sources: the shipped demo corpus and queries (default), --dataset NAME --shots N (queries from its
test split), or --synthetic SHAPE (random weights of that shape, synthetic K/V: no model files).
`answer_batch` answers its queries one after another, so batch sizes differ only by grouping.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..bench import synthetic_model, throughput
from ..bench.report import plot, render_markdown
from ..tasks.corpus import DEMO_CORPUS, DEMO_QUERIES, load_corpus, task_from_corpus
from ..tasks.datasets import load_dataset
from ..runtime.attention import ATTENTIONS
from ..runtime.devices import usable_device
from ..runtime.session import place_model
from . import CommandError, at_least, kv_memory, load_model_arg
from .errors import INPUT_ERRORS



def add_arguments(p):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", metavar="FILE", help="demonstrations .jsonl/.csv (default: the shipped demo corpus)")
    src.add_argument("--dataset", metavar="NAME", help="a benchmark set (banking77, ...) from MILO_DATA")
    src.add_argument("--synthetic", choices=sorted(synthetic_model.SHAPES), help="random model of this shape, synthetic store")
    p.add_argument("--queries", metavar="FILE", help="query items (input field) for --corpus (default: the demo queries)")
    p.add_argument("--shots", type=int, default=256, help="demonstrations stored for --dataset/--synthetic (default 256)")
    p.add_argument("--model", default="default", metavar="PATH", help="'default', an HF directory or a .gguf")
    p.add_argument("--ratios", default="0.5,0.25", metavar="R", help="ρ of the MILO stores (default 0.5,0.25)")
    p.add_argument("--k", default="2,4,8", metavar="K", help="blocks retrieved per query, a sweep (default 2,4,8)")
    p.add_argument("--batch", default="1,4", metavar="B",
                   help="queries per batch, a sweep; 'max': the most rows of the largest k the KV budget seats at once "
                        "(default 1,4)")
    p.add_argument("--n-queries", type=int, default=4, help="queries answered per method, k and batch (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; figures are medians (default 3)")
    p.add_argument("--block-size", type=int, default=32, help="demonstrations per block (default 32)")
    p.add_argument("--demo-tokens", type=int, default=20, help="tokens per synthetic demonstration (default 20)")
    p.add_argument("--tier", choices=("host", "disk", "cached"), default="host", help="where factors are read from")
    p.add_argument("--kv-cache-memory", type=kv_memory, default=None, metavar="SIZE",
                   help="the engines' KV budget: bytes (8G) or a share of free device memory (0.5); as milo serve")
    p.add_argument("--prefill", action="store_true",
                   help="also the prefill method: the model prefills each row's retrieved demonstrations (what a "
                        "user does without milo), with its time to first token")
    p.add_argument("--attention", choices=ATTENTIONS, default="auto", help="as milo serve (default auto)")
    p.add_argument("--shared-blocks", choices=("on", "off"), default="on",
                   help="as milo serve: blocks held once for every row (on) or each row's own copy (off; default on)")
    p.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the reports (and the stores)")
    p.add_argument("--stores", metavar="DIR", help="folder for the stores, reused when built the same way "
                                                   "(default: OUT/stores)")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CommandError(f"{flag}: expected integers >= 1, got {text!r}")
    return values


def _batches(text: str) -> list:
    """--batch: integers, and 'max' for the largest batch that fits."""
    sizes = [b.strip() for b in text.split(",") if b.strip()]
    numbers = _ints(",".join(b for b in sizes if b != "max"), "--batch") if set(sizes) - {"max"} else []
    return numbers + ["max"] * ("max" in sizes) if sizes else _ints(text, "--batch")


def _ratios(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"--ratios: expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < r < 1 for r in values):
        raise CommandError(f"--ratios: each ρ must be in (0, 1), got {text!r}")
    return values


def setup(args, ratios):
    """(loaded model, store paths, query texts) for the chosen source."""
    out = Path(args.stores) if args.stores else Path(args.out) / "stores"
    try:
        device = usable_device(args.device)
    except ValueError as e:
        raise CommandError(f"--device {args.device}: {e}") from None
    if args.synthetic:
        loaded = synthetic_model.device_model(args.synthetic, device)
        paths = synthetic_model.synthetic_stores(out, loaded, demos=args.shots, block_size=args.block_size,
                                       demo_tokens=args.demo_tokens, ratios=ratios)
        n_blocks = -(-args.shots // args.block_size)
        return loaded, paths, synthetic_model.synthetic_queries(args.n_queries, n_blocks, max(_ints(args.k, "--k")))
    if args.dataset:
        train, test, task = load_dataset(args.dataset)
        if args.shots > len(train):
            raise CommandError(f"--shots {args.shots}: {args.dataset} has only {len(train)} training demonstrations")
        demos, queries = train[:args.shots], [t.input for t in test[:args.n_queries]]
    else:
        if args.corpus and not args.queries:
            raise CommandError("--corpus needs --queries")
        demos = load_corpus(args.corpus or DEMO_CORPUS)
        queries = [q.input for q in load_corpus(args.queries or DEMO_QUERIES)][:args.n_queries]
        task = task_from_corpus(demos)
    loaded = load_model_arg(args.model)
    place_model(loaded, device)
    paths = throughput.real_stores(out, loaded, demos, task, ratios, block_size=args.block_size)
    return loaded, paths, queries


def run(args) -> int:
    started = time.perf_counter()
    ratios, ks, batches = _ratios(args.ratios), _ints(args.k, "--k"), _batches(args.batch)
    at_least(args, 1, "n_queries", "rounds", "shots", "block_size", "demo_tokens", "threads")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the long work, so a bad --out fails at once
    loaded, paths, queries = setup(args, ratios)
    print(f"bench: model and stores ready in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    command = "milo bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])

    def write(report: dict) -> str:
        """The report as it stands (after each batch, so a run cut short by a timeout leaves what it measured)."""
        report.update(command=command, seconds=time.perf_counter() - started)
        md = render_markdown(report)
        (out / "bench.md").write_text(md + "\n", encoding="utf-8")
        (out / "bench.json").write_text(json.dumps(report, indent=2, default=float), encoding="utf-8")
        return md

    report = throughput.run_bench(loaded, paths, queries, ks=ks, batches=batches, rounds=args.rounds, ratios=ratios,
                                  tier=args.tier, kv_cache_memory=args.kv_cache_memory, attention=args.attention,
                                  shared_blocks=args.shared_blocks == "on", prefill=args.prefill,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True), on_batch=write)
    md = write(report)
    png = plot(report, out / "bench.png")
    print(md)
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}" + (f", {png}" if png else "")
          + f" in {report['seconds']:.0f} s")
    return 0


def main(argv=None) -> int:
    """`python -m milo_infer.cli.bench`: the same command outside `milo` (tools/gpu_bench.sh uses it)."""
    p = argparse.ArgumentParser(prog="milo bench", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except INPUT_ERRORS as e:
        print(f"milo bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
