"""What a chat client's fields do to a label store's answers (issue 63): structured output and system messages.

Over the first ``--queries`` Banking77 test queries (the loader's seeded order), through the in-process engine in
batches of 16, with two stores of the same demonstrations, ``STORE`` built without a system prompt and
``SYSTEM_STORE`` built with ``--system TEXT``:

- labels: the share of answers that are one of the store's labels, decoded freely (any token, as a store without
  labels would), held to the label schema `milo serve` offers (``/v1/models``' ``response_format``: a JSON string
  whose enum is the labels), and by the store's label trie (what milo answers a label store with by default); each
  one's accuracy, and the schema's agreement with the trie's answers;
- system: a system message other than the store's (``STORE`` asked with ``TEXT``: it is read after the
  demonstrations, before the query) against a prefill of the prompt that puts it first ([TEXT + anchor][the same
  retrieved demonstrations][query], every token computed by the model: ``SYSTEM_STORE``'s prefill), beside
  ``SYSTEM_STORE``'s own answer (the same system message, answered from its anchor) and ``STORE`` asked without one,
  against the same prefill.

Prints a markdown table; ``--out`` also writes JSON. Run:

    MILO_DATA=/work/shared/data HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_chat.py STORE SYSTEM_STORE \\
        --queries 100 --threads 1
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.models import load_model  # noqa: E402
from milo_infer.runtime.engine import Engine  # noqa: E402
from milo_infer.runtime.planning import EngineSettings, Request  # noqa: E402
from milo_infer.server.protocol import label_format  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_store import MiloStore  # noqa: E402

BATCH = 16


def answers(engine: Engine, store: str, requests: list[Request]) -> list[str]:
    out = []
    for i in range(0, len(requests), BATCH):
        out += [a.text for a in engine.answer([engine.plan(store, r) for r in requests[i:i + BATCH]])]
    return out


def share(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", help="a label store built without a system prompt")
    ap.add_argument("system_store", help="the same demonstrations built with --system TEXT")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--system-queries", type=int, default=None,
                    help="of which the system comparison takes the first N (default all: each prefill computes a "
                         "whole context, ~30 s a query on one contended CPU thread)")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24, help="a free or JSON answer's budget (default 24)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, test, _ = load_dataset("banking77")
    queries = test[:args.queries]
    texts, gold = [q.input for q in queries], [q.output for q in queries]
    loaded = load_model(args.model)
    plain, system = MiloStore.open(args.store), MiloStore.open(args.system_store)
    engine = Engine(loaded, {"plain": plain, "system": system}, EngineSettings(k=args.k), max_rows=BATCH)
    task = engine.stores["system"].queries.task
    if not task.system or not task.labels:
        raise SystemExit(f"bench_chat: {args.system_store} holds no system prompt or no labels")
    labels = set(task.labels)
    schema = json.dumps(label_format(task.labels)["json_schema"]["schema"])

    trie = answers(engine, "plain", [Request(t) for t in texts])
    forced = answers(engine, "plain", [Request(t, schema=schema, max_new_tokens=args.max_tokens) for t in texts])
    forced = [json.loads(a) if a.startswith('"') and a.endswith('"') else a for a in forced]
    queries_of = engine.stores["plain"].queries
    label_trie, queries_of.trie = queries_of.trie, None  # free: any token, until a stop string or the budget
    free = answers(engine, "plain", [Request(t, max_new_tokens=args.max_tokens) for t in texts])
    queries_of.trie = label_trie
    label_rows = {name: {"valid": share(a in labels for a in got), "accuracy": share(a == g for a, g in zip(got, gold)),
                         "agrees_with_trie": share(a == b for a, b in zip(got, trie))}
                  for name, got in (("free", free), ("schema", forced), ("trie", trie))}
    result = {"queries": len(texts), "k": args.k, "labels": label_rows, "system_prompt": task.system}
    lines = [f"{len(texts)} Banking77 test queries, k {args.k}, seed 0 (the loader's order)", "",
             "| answer | valid labels | accuracy | agrees with the trie's |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {r['valid']:.0%} | {r['accuracy']:.0%} | {r['agrees_with_trie']:.0%} |"
              for name, r in label_rows.items()]
    print("\n".join(lines), flush=True)  # the labels' part stands alone: the system part takes far longer

    n = args.system_queries or len(texts)
    prefill = answers(engine, "system", [Request(t, prefill=True) for t in texts[:n]])
    asked = {"other system message, after the demonstrations": answers(engine, "plain", [
                 Request(t, system=task.system) for t in texts[:n]]),
             "the store's system message (its anchor)": answers(engine, "system", [
                 Request(t, system=task.system) for t in texts[:n]]),
             "no system message": trie[:n]}
    system_rows = {name: {"agrees_with_prefill": share(a == b for a, b in zip(got, prefill)),
                          "accuracy": share(a == g for a, g in zip(got, gold))} for name, got in asked.items()}
    result.update(system=system_rows, system_queries=n, prefill_accuracy=share(a == g for a, g in zip(prefill, gold)))
    lines = ["", f"{n} queries; prefill of [system + anchor][blocks][query]: accuracy {result['prefill_accuracy']:.0%}",
             "", "| system message | agrees with prefill | accuracy |", "|---|---:|---:|"]
    lines += [f"| {name} | {r['agrees_with_prefill']:.0%} | {r['accuracy']:.0%} |" for name, r in system_rows.items()]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
