"""Check that milo reproduces a model exactly, in a minute, before a long build.

On the model's own weights, in the dtype the build will use, over the first demonstrations of your corpus
(or a data set's training split): an identity store of a few blocks is built and read back through the
engine, and each layer's keys and values are compared with what the model writes into its own cache,
where the blocks were encoded (capture) and at new positions (re-positioning); the engine's logits for a
query with transformers' over the same cache; the query-aware key weights with the queries attention
receives. Prints the largest deviation per layer against the tolerance of the dtype; exits 1 when any
is over it, 2 when milo does not support the model (naming why). The library is
`milo_infer.evaluation.conformance`.
"""
import argparse

import torch

from milo_store.commandline import print_json

from ..evaluation.conformance import check_conformance
from ..runtime.session import place_model
from ..tasks.corpus import DEMO_CORPUS
from ..tasks.datasets import DATASETS
from . import CommandError, at_least, checked_device, load_model_arg
from .build import demonstrations

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLUMNS = (("capture keys", "capture K"), ("capture values", "capture V"), ("reposition keys", "moved K"),
           ("reposition values", "moved V"), ("query_scales", "query wts"))
STATE_COLUMNS = (("capture state", "state"), ("capture conv", "conv tail"))  # a hybrid's linear layers


def add_arguments(p):
    p.add_argument("model", nargs="?", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face model directory, or a .gguf file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--corpus", metavar="FILE", help="your demonstrations: .jsonl or .csv with input and output fields "
                     "(default: the shipped demo corpus)")
    src.add_argument("--dataset", choices=DATASETS, help="a benchmark data set's training split (from $MILO_DATA)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="the model's dtype, as the build will run it (default float32, milo build's)")
    p.add_argument("--shots", type=int, default=8, help="demonstrations to check over (default 8)")
    p.add_argument("--block-size", type=int, default=2, help="demonstrations per block (default 2)")
    p.add_argument("--context-blocks", type=int, default=1, help="previous blocks each block is encoded after (default 1)")
    p.add_argument("--template", metavar="T", help=r"how a demonstration is written, as for milo build")
    p.add_argument("--anchor", metavar="A", help=r"instruction text before all demonstrations, as for milo build")
    p.add_argument("--system", metavar="TEXT", help="a system prompt before the anchor, as for milo build")
    p.add_argument("--seed", type=int, default=0, help="shuffles a data set as milo build does")
    p.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the deviations as JSON")


def run(args) -> int:
    at_least(args, 1, "shots", "block_size", "threads")
    at_least(args, 0, "context_blocks")
    if args.shots < 2 * args.block_size:
        raise CommandError(f"--shots {args.shots}: the check places two blocks or more, so it needs at least "
                           f"{2 * args.block_size} demonstrations with --block-size {args.block_size}")
    if args.corpus is None and args.dataset is None:
        args.corpus = str(DEMO_CORPUS)
    device = checked_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    demos, task = demonstrations(args)
    loaded = load_model_arg(args.model, dtype=DTYPES[args.dtype])
    place_model(loaded, device)
    report = check_conformance(loaded, demos, task, demos[0].input, block_size=args.block_size,
                               context_blocks=args.context_blocks)
    if args.json:
        print_json(report.as_dict())
    else:
        print_report(report)
    return 0 if report.passed else 1


def print_report(r) -> None:
    tol = r.tolerance
    print(f"model    {r.model} ({r.model_type}), {str(r.dtype).removeprefix('torch.')}: {r.blocks} blocks")
    print("deviation: largest |milo - model| per layer, over max(1, largest |model|); tolerance capture "
          f"{tol['capture']:g}, moved (re-positioned) {tol['reposition']:g}, query weights {tol['query_scales']:g}, "
          f"logits {tol['logits']:g}")
    columns = COLUMNS + (STATE_COLUMNS if any("capture conv" in checks for checks in r.layers) else ())
    print("layer  " + "  ".join(f"{title:>10}" for _, title in columns))
    for layer, checks in enumerate(r.layers):  # a layer attending another's K/V has none of its own to check; an MLA
        # layer's one unit is its keys ("in K"); a linear layer holds a state, no K/V (and an attention layer no state);
        # an MLP block alone nothing
        absent = ("-" if any(name.endswith("keys") for name in checks) and "capture values" in checks else
                  "linear" if "capture conv" in checks else "in K" if any(name.endswith("keys") for name in checks)
                  else "shared" if checks else "mlp")  # an MLP block alone (NemotronH's) mixes no tokens
        print(f"{layer:5d}  " + "  ".join(f"{checks[name].relative:10.2e}" if name in checks else f"{absent:>10}"
                                          for name, _ in columns))
    print(f"logits over a query: {r.logits.relative:.2e}")
    if r.passed:
        print(f"PASS: milo reproduces this model's cache in every layer ({len(r.layers)})")
    else:
        print(f"FAIL: {len(r.failures())} over tolerance: " + "; ".join(r.failures()[:8])
              + (" ..." if len(r.failures()) > 8 else ""))
