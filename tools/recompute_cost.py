"""Time to first token against query-time recompute: one store, the same queries at every n, interleaved.

`milo eval` logs each method's time to first token, but its methods run one after another, so on a
shared CPU the load drifts between them. Here every query is answered at every n (and, with
--prefill, by the prefill baseline) before the next query, in an order that rotates per query, so
each setting sees the same load on average.

Run: ``python tools/recompute_cost.py STORE --dataset banking77 --queries 10 --n 0,4,16,32,128 --prefill --threads 1``
(an n at least a block's length recomputes every token: prefill's answers, at the store's rounding)
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_infer.runtime.engine import Engine  # noqa: E402
from milo_infer.runtime.planning import EngineSettings, Request  # noqa: E402
from milo_infer.evaluation.methods import PREFILL  # noqa: E402
from milo_infer.models import load_model  # noqa: E402
from milo_store import MiloStore  # noqa: E402


def measure(engine: Engine, texts: list[str], settings: list) -> dict:
    """Per setting (an int n, or PREFILL): mean time to first token, mean tokens computed and the answers,
    each query answered alone at every setting, the settings' order rotated by one per query; with
    PREFILL among them, each setting's share of answers equal to prefill's."""
    seen = {s: {"first_token_seconds": [], "prefill_tokens": [], "answers": []} for s in settings}
    for i, text in enumerate(texts):
        for s in settings[i % len(settings):] + settings[:i % len(settings)]:
            request = Request(text, prefill=True) if s == PREFILL else Request(text, recompute=s)
            answer = engine.answer([engine.plan("store", request)])[0]
            for field, value in (("first_token_seconds", answer.first_token_seconds),
                                 ("prefill_tokens", answer.prefill_tokens), ("answers", answer.text)):
                seen[s][field].append(value)
    result = {}
    for s, fields in seen.items():
        result[str(s)] = {"first_token_seconds": statistics.fmean(fields["first_token_seconds"]),
                          "prefill_tokens": statistics.fmean(fields["prefill_tokens"]), "answers": fields["answers"]}
        if PREFILL in seen:
            result[str(s)]["agreement_prefill"] = statistics.fmean(
                a == b for a, b in zip(fields["answers"], seen[PREFILL]["answers"]))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--dataset", required=True, help="the data set whose test queries are asked (its first --queries)")
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--n", default="0,4,16,32,128", help="tokens recomputed per block, comma-separated")
    ap.add_argument("--prefill", action="store_true", help="time the prefill baseline too (tens of seconds a query on a CPU)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default="default", help="the model the store was built with (default: the default model; a HF folder or a .gguf)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = [int(n) for n in args.n.split(",")] + ([PREFILL] if args.prefill else [])
    _, test, _ = load_dataset(args.dataset, seed=args.seed)
    with MiloStore.open(args.store) as store:
        engine = Engine(load_model(args.model), {"store": store}, settings=EngineSettings(k=args.k))
        result = measure(engine, [item.input for item in test[:args.queries]], settings)
    print(json.dumps({"store": args.store, "dataset": args.dataset, "queries": args.queries, "k": args.k,
                      "threads": torch.get_num_threads(), "settings": result}, indent=2))


if __name__ == "__main__":
    main()
