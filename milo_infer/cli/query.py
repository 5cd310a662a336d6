"""Answer a query from a store: retrieve blocks, rebuild their K/V, let the model answer.

Prints the answer, and with --show-blocks the blocks used and their demonstrations; --json gives
everything (answer, blocks and their demonstrations, KV bytes full vs moved, seconds per stage, and the batch's
K/V bytes held, distinct blocks held against blocks placed and factor bytes staged) for programs. Only the retrieved blocks' demonstrations are read, and only when they are shown. Several
queries are answered as one batch. A query that shares no term with any demonstration is answered from
arbitrary blocks: a warning on stderr says so, and ``retrieval_matched`` is false in --json.
"""
import json
import sys

import torch

from milo_store import MiloStore
from milo_store.report import block_demonstrations

from ..runtime.session import MiloSession, place_model
from ..runtime.planning import EngineSettings
from . import CommandError, add_tier_arguments, at_least, checked_device, load_model_arg, mount_options


def add_arguments(p):
    p.add_argument("store", help="store directory or URL (from `milo build`)")
    p.add_argument("text", nargs="+", help="the query text (one or more queries)")
    p.add_argument("--model", default="default", help="model path or 'default' (must match the store)")
    p.add_argument("--k", type=int, default=6, help="blocks to retrieve per query (default 6)")
    p.add_argument("--token-budget", type=int, default=None, help="cap on retrieved tokens instead of / besides k")
    p.add_argument("--recompute", type=int, default=0, metavar="N",
                   help="tokens at the start of each retrieved block the model computes again in the query's context "
                        "(closer to plain prompting, N×k more tokens per query; default 0)")
    add_tier_arguments(p)
    p.add_argument("--order", choices=("score", "corpus"), default="score", help="block order in the context")
    p.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads; 1 is many times faster on a CPU shared with other jobs (default: torch's)")
    p.add_argument("--show-blocks", action="store_true", help="list the retrieved blocks' demonstrations")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    at_least(args, 1, "k", "token_budget", "threads")
    at_least(args, 0, "recompute")
    device = checked_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    store = MiloStore.open(args.store, **mount_options(args))
    loaded = load_model_arg(args.model)
    device = place_model(loaded, device)
    session = MiloSession(loaded, store, settings=EngineSettings(k=args.k, token_budget=args.token_budget, order=args.order, recompute=args.recompute), device=device)
    matched = [session.retriever.matches(text) for text in args.text]
    for text, hit in zip(args.text, matched):
        if not hit:
            print(f"milo query: warning: {text!r} shares no term with any demonstration: retrieval matched nothing, "
                  "the blocks are arbitrary", file=sys.stderr)
    stats: dict = {}
    try:
        answers = session.answer_batch(args.text, stats)
    except ValueError as e:  # e.g. a token budget smaller than any block, a query longer than the model's context
        raise CommandError(str(e)) from None
    batch = {"rows": len(answers), "kv_bytes_held": stats["kv_bytes_held"], "held_blocks": stats["held_blocks"],
             "placed_blocks": stats["placed_blocks"], "factor_bytes_staged": stats["staged_bytes"]}
    shown = args.show_blocks or args.json
    demos = block_demonstrations(store, [b for a in answers for b in a.blocks]) if shown else {}
    results = []
    for text, a, hit in zip(args.text, answers, matched):
        result = {"query": text, "answer": a.text, "retrieval_matched": hit, "blocks": a.blocks,
                  "prefix_tokens": a.prefix_tokens,
                  "kv_bytes_full": a.kv_bytes_full, "kv_bytes_stored": a.kv_bytes_stored,
                  "seconds": {k: round(v, 4) for k, v in a.seconds.items()}, "batch": batch}
        if shown:
            result["block_demonstrations"] = [{"block": b, "demonstrations": [f"{i} => {o}" for i, o in demos[b]]}
                                              for b in a.blocks]
        results.append(result)
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
        return 0
    for r in results:
        print(f"{r['query']}\n  -> {r['answer']}")
        print(f"  blocks {r['blocks']}  context {r['prefix_tokens']} tokens  KV moved {r['kv_bytes_stored'] / 2**20:.2f} MiB "
              f"of {r['kv_bytes_full'] / 2**20:.2f} MiB full  "
              + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["seconds"].items()))
        if args.show_blocks:
            for blk in r["block_demonstrations"]:
                print(f"  block {blk['block']}:")
                for line in blk["demonstrations"][:5]:
                    print(f"    {line}")
                if len(blk["demonstrations"]) > 5:
                    print(f"    ... {len(blk['demonstrations']) - 5} more")
    print(f"K/V held {batch['kv_bytes_held'] / 2**20:.2f} MiB for {batch['held_blocks']} distinct blocks of "
          f"{batch['placed_blocks']} placed; factors staged {batch['factor_bytes_staged'] / 2**20:.2f} MiB")
    return 0
