"""The engine's own cost against its floor, and what one admission into a running batch costs, in one run.

Floor: for each query, the store's rebuilt prefix K/V already in a transformers ``DynamicCache``, then a
plain forward over the query and greedy decoding of the same tokens (the model's own attention, nothing of
milo's): what answering costs once the context is there. Engine: ``Engine.answer([plan])`` at batch 1
(its rebuild and its forwards), and the model seconds it reports. Admission: the wall time from ``admit``
to the query's first token, and to its answer, when it joins a batch of ``--running`` rows that are
decoding, against the same query alone, beside what one step of those rows costs without it. Rounds are interleaved; medians.

Attention (issue 40): for each ``--batch`` size, a batch of that many rows decoding, one step timed at a time
with each ``--attention`` (the per-row SDPA loop, one FlexAttention call per layer: compiled, warmed up
first), interleaved; beside it the K/V bytes the batch's pools allocated, what its rows need, and what a
cache of one slot of the model's positions per row would have reserved. Run:

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD .venv/bin/python tools/bench_engine.py STORE --threads 1 --batch 1,8,16
"""
import argparse
import ast
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.bench.step_profile import (STAGES, Churn, StageClock, decoding_batch, profile_churn,  # noqa: E402
                                           profile_steps)
from milo_infer.evaluation.conformance import cache_of, rebuilt  # noqa: E402
from milo_infer.models import load_model  # noqa: E402
from milo_infer.runtime.decoding import LabelDecoder  # noqa: E402
from milo_infer.runtime.engine import Engine  # noqa: E402
from milo_infer.runtime import attention  # noqa: E402
from milo_infer.runtime.pages import PAGE_TOKENS, pages_for  # noqa: E402
from milo_infer.runtime.planning import EngineSettings, Request  # noqa: E402
from milo_infer.runtime.prefix import rebuild_layer  # noqa: E402
from milo_infer.tasks.corpus import load_corpus  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_store import MiloStore  # noqa: E402

DEMO = ROOT / "milo_infer/tasks/data/demo_corpus.jsonl"
RUNNING_TEXTS = ["where is my new card", "I was charged twice", "how do I top up", "my transfer failed",
                 "change my pin", "cancel my order", "what is the exchange rate"]


def prefix_cache(engine: Engine, plan) -> DynamicCache:
    """The plan's rebuilt [anchor][blocks] K/V, layer by layer (and a hybrid's composed states), in a fresh
    DynamicCache."""
    keys, values, states = rebuilt(engine, plan.placement)
    return cache_of(keys, values, config=engine.model.config, states=states)


@torch.inference_mode()
def floor(engine: Engine, plan) -> tuple[float, str]:
    """Seconds of a plain forward over the query and greedy label decoding, the prefix K/V already cached."""
    cache = prefix_cache(engine, plan)
    decoder = LabelDecoder(engine.stores[plan.store].queries.trie, engine.tokenizer, plan.max_new_tokens)
    t = time.perf_counter()
    ids, positions = torch.tensor([plan.query_ids]), torch.from_numpy(plan.positions)[None]
    while True:
        logits = engine.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                              **{engine.cache_kwarg: cache}).logits[0, -1]
        token = decoder.push(logits)
        if decoder.done:
            return time.perf_counter() - t, decoder.result().text
        ids, positions = torch.tensor([[token]]), positions[:, -1:] + 1


def first_token_and_answer(batch, plan) -> tuple[float, float]:
    """Seconds from admitting ``plan`` into ``batch`` to its first token and to its answer."""
    t = time.perf_counter()
    events, first = batch.admit([plan]), None
    while True:
        for e in events:
            if e.plan is plan:
                first = first if first is not None else time.perf_counter() - t
                if e.finished:
                    return first, time.perf_counter() - t
        events = batch.step()


def attention_rows(loaded, store, texts, args) -> list[dict]:
    """Per batch size: the median step seconds of each attention, interleaved, and the KV bytes."""
    out = []
    for size in args.batch:
        batches = {a: decoding_batch(Engine(loaded, {"s": store}, EngineSettings(k=args.k), attention=a,
                                            max_rows=size), "s", texts, size) for a in args.attention}
        for b in batches.values():  # warm up: compilation, first-touch
            b.step()
            b.step()
        seconds = {a: [] for a in batches}
        for _ in range(args.steps):
            for a, b in batches.items():
                t = time.perf_counter()
                b.step()
                seconds[a].append(time.perf_counter() - t)
        b = next(iter(batches.values()))
        slots = size * b.engine.max_positions * b.engine.page_bytes // PAGE_TOKENS
        out.append({"batch": size, **{a: statistics.median(v) for a, v in seconds.items()},
                    "allocated": b.kv_bytes_allocated, "needed": b.kv_bytes_needed, "slots": slots})
    return out


def profile_rows(loaded, store, texts, args) -> list[dict]:
    """Per row count and page layout: ``--steps`` decode steps of that many rows, timed by stage (the per-row
    attention, as on a CPU)."""
    out = []
    for size in args.profile:
        for layout in args.layouts:
            for shared in args.shared_blocks:
                engine = Engine(loaded, {"s": store}, EngineSettings(k=args.k), attention="rows", max_rows=size,
                                shared_blocks=shared == "on")
                if layout == "churn":
                    out.append({"layout": layout, "shared": shared, "columns": None,
                                **profile_churn(engine, "s", texts, size, args.steps)})
                    continue
                batch = decoding_batch(engine, "s", texts, size, scattered=layout == "scattered")
                batch.step()  # warm up: first touch of the new tokens' columns
                out.append({"layout": layout, "shared": shared, "columns": sum(r.next_position for r in batch.rows) // size,
                            "kv_bytes_held": batch.held_counts()["kv_bytes_held"], **profile_steps(batch, args.steps)})
                del batch, engine
    return out


def sdpa_rows_at(commit: str):
    """``milo_infer.runtime.attention.sdpa_rows`` as it was at ``commit``, to time beside this tree's."""
    source = subprocess.run(["git", "show", f"{commit}:milo_infer/runtime/attention.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    function = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "sdpa_rows")
    namespace = {"torch": torch, "PAGE_TOKENS": PAGE_TOKENS, "pages_for": pages_for, "Pack": object,
                 "LayerAttention": attention.LayerAttention, "scored_attention": attention.scored_attention,
                 "Merge": attention.Merge, "partial_attention": attention.partial_attention}
    exec(compile(ast.Module([function], type_ignores=[]), f"{commit}:attention.py", "exec"), namespace)
    rows = namespace["sdpa_rows"]
    if function.args.args[4].arg == "scaling":  # before each layer's window, soft-cap and sinks were passed
        return lambda query, key, value, pack, layer: rows(query, key, value, pack, layer and layer.scaling)
    return rows


def compare_rows(loaded, store, texts, args) -> list[dict]:
    """Per row count and page layout: one decoding batch, its steps timed alternately with ``--compare``'s
    per-row attention and this tree's (the same rows, columns and load); medians."""
    before, now, out = sdpa_rows_at(args.compare), attention.sdpa_rows, []
    for size in args.profile:
        for layout in args.layouts:
            engine = Engine(loaded, {"s": store}, EngineSettings(k=args.k), attention="rows", max_rows=size,
                            shared_blocks=False)  # the per-row loop of each row's own copy
            batch = decoding_batch(engine, "s", texts, size, scattered=layout == "scattered")
            seconds = {"before": [], "now": []}
            try:
                for i in range(2 * args.steps + 2):
                    name = ("before", "now")[i % 2]
                    attention.sdpa_rows = before if name == "before" else now
                    t = time.perf_counter()
                    batch.step()
                    if i >= 2:  # the first of each: warm-up
                        seconds[name].append(time.perf_counter() - t)
            finally:
                attention.sdpa_rows = now
            out.append({"rows": size, "layout": layout, **{k: statistics.median(v) for k, v in seconds.items()}})
            del batch, engine
    return out


def per_row_rebuild(*args, **kwargs) -> None:
    """The kernels' rebuild called once per row, each row decoding every block it places (`PrefixRebuild`'s CPU path
    before issue 47 decoded a block its rows share once)."""
    rebuild_layer(*args, **kwargs)


def churn_configurations() -> dict:
    """The two served batches a --compare-rebuild run alternates: {name: Engine keywords}, before first; both of
    rows holding their own copies of their prefixes (issue 47's): each row's prefix rebuilt on its own, against
    each block decoded once per admission."""
    own = {"shared_blocks": False}
    return {"per_row": {"rebuild": per_row_rebuild, **own}, "shared": own}


def compare_churns(loaded, store, texts, args) -> list[dict]:
    """Per row count: two served batches (`Churn`) of the same texts (`churn_configurations`), their steps
    alternating; the step's, the prefix rebuild's and the pool setup's mean seconds, and whether their answers
    agree."""
    out = []
    for size in args.profile:
        churns, clocks = {}, {}
        for name, options in churn_configurations().items():
            engine = Engine(loaded, {"s": store}, EngineSettings(k=args.k), attention="rows", max_rows=size, **options)
            churns[name], clocks[name] = Churn(engine, "s", texts, size, args.steps), StageClock()
        for _ in range(args.steps):
            for name, churn in churns.items():
                with clocks[name].timing():
                    churn.step()
        (before, now) = (c.answers for c in churns.values())
        out.append({"rows": size, "names": list(churns), "answers": min(len(before), len(now)),
                    "equal": sum(map(str.__eq__, before, now)),
                    **{name: {"step": churn.wall / args.steps,
                              **{stage: clocks[name].seconds[stage] / args.steps
                                 for stage in ("prefix_rebuild", "pool_setup")}}
                       for name, churn in churns.items()}})
        del churns, clocks
    return out


def print_churn_comparison(rows: list[dict], args) -> None:
    print(f"store {args.store}, k {args.k}, {args.threads} thread(s); a served batch's mean seconds a step over "
          f"{args.steps} steps, two batches of the same queries alternating (tools/bench_engine.py, "
          f"churn_configurations)")
    a, b = rows[0]["names"]
    print(f"| rows | {a} step s | {b} step s | {a} / {b} | {a} rebuild s | {b} rebuild s | {a} pool setup s | "
          f"{b} pool setup s | answers equal |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        x, y = r[a], r[b]
        print(f"| {r['rows']} | {x['step']:.3f} | {y['step']:.3f} | {x['step'] / y['step']:.2f} | "
              f"{x['prefix_rebuild']:.3f} | {y['prefix_rebuild']:.3f} | {x['pool_setup']:.3f} | "
              f"{y['pool_setup']:.3f} | {r['equal']} of {r['answers']} |")


def print_comparison(rows: list[dict], args) -> None:
    print(f"store {args.store}, k {args.k}, {args.threads} thread(s); a decode step's median seconds over {args.steps} "
          f"steps each, alternating: the per-row attention at {args.compare} (before) and this tree's (now)")
    print("| rows | pages | before s | now s | before / now |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['layout']} | {r['before']:.3f} | {r['now']:.3f} | {r['before'] / r['now']:.2f} |")


def print_profile(rows: list[dict], args) -> None:
    print(f"store {args.store}, k {args.k}, {args.threads} thread(s), {args.steps} steps each; shares of a decode "
          f"step's wall time (%), exclusive per stage (milo_infer/bench/step_profile.py)")
    print("| rows | pages | shared blocks | columns a row | K/V held MiB | step ms | " + " | ".join(STAGES)
          + " | SDPA calls a step |")
    print("|---" * (len(STAGES) + 7) + "|")
    for r in rows:
        shares = " | ".join(f"{100 * r['seconds'][s] / r['step']:.1f}" for s in STAGES)
        pages = r["layout"] if "scattered" not in r else f"churn ({100 * r['scattered']:.0f}% scattered)"
        held = f"{r['kv_bytes_held'] / 2**20:.0f}" if "kv_bytes_held" in r else "-"
        print(f"| {r['rows']} | {pages} | {r['shared']} | {r['columns'] or '-'} | {held} | "
              f"{1e3 * r['step'] / r['steps']:.0f} | {shares} | {r['calls']['row_sdpa'] // r['steps']} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", type=int, default=7, help="rows decoding when the query joins")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="default", help="the model the store was built with (default: the default model; a HF folder or a .gguf)")
    ap.add_argument("--batch", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 16],
                    help="rows decoding in the attention comparison (default 1,8,16)")
    ap.add_argument("--attention", type=lambda t: t.split(","), default=["rows", "flex"],
                    help="attentions compared, the first is the baseline (default rows,flex)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per batch and attention (default 8)")
    ap.add_argument("--profile", type=lambda t: [int(x) for x in t.split(",")], default=None, metavar="ROWS",
                    help="only this: where a decode step's time goes at each of these row counts (issue 47)")
    ap.add_argument("--layouts", type=lambda t: t.split(","), default=["run", "scattered"],
                    help="--profile: rows decoding on consecutive pages (run), on scattered ones (scattered), or a served "
                         "batch whose finished rows are replaced at once (churn) (default run,scattered)")
    ap.add_argument("--compare", metavar="COMMIT", default=None,
                    help="--profile: instead, time decode steps alternately with the per-row attention (sdpa_rows) of "
                         "COMMIT, read from git, and this tree's")
    ap.add_argument("--compare-rebuild", action="store_true",
                    help="--profile: instead, time a served batch alternately with each row's prefix rebuilt on its own "
                         "and with each block decoded once per admission")
    ap.add_argument("--shared-blocks", type=lambda t: t.split(","), default=["on"], metavar="on,off",
                    help="--profile: blocks held once for every row (on), each row's own copy (off), or both (default on)")
    ap.add_argument("--dataset", default=None,
                    help="--profile: ask this dataset's test queries (MILO_DATA) instead of the demo corpus")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    profile_texts = ([d.input for d in load_dataset(args.dataset)[1]] if args.dataset
                     else [d.input for d in load_corpus(DEMO)])
    if args.profile and args.compare_rebuild:
        with MiloStore.open(args.store) as store:
            print_churn_comparison(compare_churns(loaded, store, profile_texts, args), args)
        return 0
    if args.profile and args.compare:
        with MiloStore.open(args.store) as store:
            print_comparison(compare_rows(loaded, store, profile_texts, args), args)
        return 0
    if args.profile:
        with MiloStore.open(args.store) as store:
            print_profile(profile_rows(loaded, store, profile_texts, args), args)
        return 0
    with MiloStore.open(args.store) as store:
        engine = Engine(loaded, {"s": store}, EngineSettings(k=args.k))
        runner = Engine(loaded, {"s": store}, EngineSettings(k=args.k, max_new_tokens=64))
        runner.stores["s"].queries.trie = None  # the running rows decode free-form, long enough to be running
        texts = [d.input for d in load_corpus(DEMO)[-args.queries:]]
        rows = {name: [] for name in ("floor", "engine", "engine_model", "alone_first", "joined_first",
                                      "alone_answer", "joined_answer", "running_step", "running_at_join")}
        agree = 0
        for _ in range(args.rounds):
            for text in texts:
                plan = engine.plan("s", Request(text))
                seconds, text_floor = floor(engine, plan)
                rows["floor"].append(seconds)
                t = time.perf_counter()
                answer = engine.answer([engine.plan("s", Request(text))])[0]
                rows["engine"].append(time.perf_counter() - t)
                rows["engine_model"].append(answer.seconds["model"])
                agree += answer.text == text_floor
                first, whole = first_token_and_answer(engine.batch(), engine.plan("s", Request(text)))
                rows["alone_first"].append(first)
                rows["alone_answer"].append(whole)
                batch = runner.batch()
                batch.admit([runner.plan("s", Request(r)) for r in RUNNING_TEXTS[:args.running]])
                batch.step()  # their prefill
                t = time.perf_counter()
                batch.step()
                rows["running_step"].append(time.perf_counter() - t)
                rows["running_at_join"].append(len(batch))
                first, whole = first_token_and_answer(batch, engine.plan("s", Request(text)))
                rows["joined_first"].append(first)
                rows["joined_answer"].append(whole)
        med = {name: statistics.median(v) for name, v in rows.items()}
    print(f"store {args.store}, k {args.k}, {args.queries} queries x {args.rounds} rounds, "
          f"{args.threads} thread(s); medians (s)")
    print("| floor | engine b=1 | engine ratio | engine model s | model ratio | alone first token | "
          "joined first token | ratio | running rows' step | alone answer | joined answer | ratio | rows running at join |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {med['floor']:.3f} | {med['engine']:.3f} | {med['engine'] / med['floor']:.2f} | "
          f"{med['engine_model']:.3f} | {med['engine_model'] / med['floor']:.2f} | {med['alone_first']:.3f} | "
          f"{med['joined_first']:.3f} | {med['joined_first'] / med['alone_first']:.2f} | {med['running_step']:.3f} | "
          f"{med['alone_answer']:.3f} | {med['joined_answer']:.3f} | "
          f"{med['joined_answer'] / med['alone_answer']:.2f} | {med['running_at_join']:.0f} |")
    print(f"answers equal to the floor's: {agree} of {args.queries * args.rounds}")
    with MiloStore.open(args.store) as store:
        rows = attention_rows(loaded, store, texts, args)
    base, others = args.attention[0], args.attention[1:]
    print(f"\none decode step, medians of {args.steps} interleaved (s); K/V MiB: the pools, the rows' columns, and "
          f"a slot of the model's positions per row")
    print("| rows | " + " | ".join(f"{a} s" for a in args.attention) + " | "
          + " | ".join(f"{a} / {base}" for a in others) + " | K/V allocated | rows' need | slots | allocated / need |")
    print("|---" * (2 * len(args.attention) + 4) + "|")
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[a]:.4f}" for a in args.attention) + " | "
              + " | ".join(f"{r[a] / r[base]:.2f}" for a in others) + f" | {r['allocated'] / 2**20:.1f} | "
              f"{r['needed'] / 2**20:.1f} | {r['slots'] / 2**20:.0f} | {r['allocated'] / r['needed']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
