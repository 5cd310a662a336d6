"""Compare storage methods on held-out queries: accuracy and measured KV bytes, as a results table.

For each data set, seed and block size: the first --shots training demonstrations become one store
per method and ratio (the model encodes them once per codec; see `milo_infer.building.shared_staging.encode_once`),
then the first --test test items are answered from each store. --ratio and --block-size take
comma-separated lists, for accuracy-against-ratio and -block-size curves (tools/plot_results.py).
Everything lands under --out: the stores, one predictions JSONL per run (rerunning the same command
resumes where it stopped) and results.md / results.json, rewritten after every finished method.
`prefill` (the model prefilling full's retrieved demonstrations) does not depend on --context-blocks,
so its predictions sit beside the run folders and serve every --context-blocks of the same --out. A
method ending in -recompute<n> answers from its base method's store, with predictions of its own.
"""
import itertools
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from ..building.config import BuildConfig
from ..tasks.corpus import load_corpus, task_from_corpus
from ..tasks.datasets import DATASETS, load_dataset
from ..evaluation.evaluate import EVAL_BATCH, agreement, evaluate
from ..evaluation.methods import (BASES, DEFAULT, EXAMPLES, MODIFIERS, PREFILL, QUANTS, method_config, recompute_name,
                                  resolve, split_recompute, store_name)
from ..building.shared_staging import encode_once
from ..evaluation.tables import write_tables
from ..runtime.planning import MAX_NEW_TOKENS
from . import CommandError, at_least, load_model_arg


def add_arguments(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", metavar="NAMES", help=f"comma-separated benchmark sets: {', '.join(DATASETS)}")
    src.add_argument("--corpus", metavar="FILE", help="your demonstrations (.jsonl/.csv); needs --queries")
    p.add_argument("--queries", metavar="FILE", help="test items for --corpus, with input and output fields")
    p.add_argument("--model", default="default", metavar="PATH", help="'default', a Hugging Face directory or a .gguf")
    p.add_argument("--methods", default="full,default,raw+int8", metavar="M",
                   help=f"comma-separated method names, base(+quantization)(-modifier)*: bases "
                        f"{', '.join(BASES)}; modifiers {', '.join(MODIFIERS)}, ks<key share>; quantizations "
                        f"{', '.join(QUANTS)}; or '{DEFAULT}' (what milo build writes at each ratio), or "
                        f"'{PREFILL}' (no store: the model prefills the demonstrations full retrieves); any store "
                        f"method may end in -recompute<n> (the model computes each retrieved block's first n "
                        f"tokens again at query time). "
                        f"E.g. {', '.join(EXAMPLES)} (default full,default,raw+int8)")
    p.add_argument("--shots", type=int, default=512, help="demonstrations stored per data set (default 512)")
    p.add_argument("--ratio", default="0.5", metavar="R[,R]",
                   help="ρ for the compressed methods, in (0, 1]; several give one store each (default 0.5)")
    p.add_argument("--test", type=int, default=100, help="test items answered per data set and seed (default 100)")
    p.add_argument("--seeds", type=int, default=1, help="number of seeds, S..S+N-1: sample, block order (default 1)")
    p.add_argument("--first-seed", type=int, default=0, metavar="S",
                   help="the first seed (default 0): adds seeds from another process; each process writes "
                        "only its own rows to --out's tables (merge them with tools/results_table.py)")
    p.add_argument("--k", type=int, default=6, help="blocks retrieved per query (default 6)")
    p.add_argument("--batch", type=int, default=EVAL_BATCH,
                   help=f"queries answered per forward, each with its own blocks; predictions do not depend on it "
                        f"(default {EVAL_BATCH})")
    p.add_argument("--block-size", default="32", metavar="M[,M]",
                   help="demonstrations per block; several encode the corpus once each (default 32)")
    p.add_argument("--context-blocks", type=int, default=2, help="previous blocks each block is encoded after")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="longest free-form answer (math); labels are bounded by their own length (default 64)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads; 1 is many times faster on a CPU shared with other jobs (default: torch's)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for stores, predictions and the tables")


def check(args) -> tuple[list[str], list[str]]:
    """(data set names, method names), after every check that needs no model; parses --ratio and
    --block-size into args.ratios and args.block_sizes."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise CommandError("--methods: none given")
    for m in methods:
        try:
            method_config(m, 0.5)
        except ValueError as e:
            raise CommandError(f"--methods: {e}") from None
    if args.corpus is not None:
        if args.queries is None:
            raise CommandError("--corpus needs --queries (the test items)")
        names = [Path(args.corpus).stem]
    else:
        names = [d.strip() for d in args.dataset.split(",") if d.strip()]
        bad = [d for d in names if d not in DATASETS]
        if bad or not names:
            raise CommandError(f"--dataset: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(DATASETS)}")
    args.ratios = _numbers("--ratio", args.ratio, float)
    args.block_sizes = _numbers("--block-size", args.block_size, int)
    if not all(0 < r <= 1 for r in args.ratios):
        raise CommandError(f"--ratio must be in (0, 1]; got {args.ratio}")
    if min(args.block_sizes) < 1:
        raise CommandError(f"--block-size must be at least 1; got {args.block_size}")
    at_least(args, 1, "shots", "test", "seeds", "k", "batch", "max_new_tokens", "threads")
    at_least(args, 0, "first_seed", "context_blocks")
    return names, methods


def data(args, name: str, seed: int):
    """(demonstrations to store, test items, task) for one data set and seed."""
    if args.corpus is not None:
        train, test = load_corpus(args.corpus), load_corpus(args.queries)
        task = task_from_corpus(train)
    else:
        train, test, task = load_dataset(name, seed=seed)
    if args.shots > len(train):
        raise CommandError(f"--shots {args.shots}: {name} has only {len(train)} training demonstrations")
    if max(args.block_sizes) > args.shots:
        raise CommandError(f"--block-size {max(args.block_sizes)} is larger than --shots {args.shots}")
    return train[:args.shots], test[:args.test], task


def run(args) -> int:
    started = time.perf_counter()
    names, methods = check(args)
    out = Path(args.out)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model_arg(args.model)
    command = "milo eval " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["eval"] else ""
    rows = []
    # a method whose ratio is fixed (full, raw, milo-fullrank) has one store whatever --ratio lists; full
    # then prefill answer first, so that every other method's agreement with them is known when its row
    # is written (full's agreement with prefill is added to its row once prefill has answered)
    runs = {}  # (method, store name) -> the first ratio naming that store
    for m, r in itertools.product(methods, args.ratios):
        runs.setdefault((m, store_name(m, r)), r)
    runs = sorted(runs.items(), key=lambda run: (run[0][0] != "full", run[0][0] != PREFILL))
    bar = tqdm(total=len(names) * args.seeds * len(args.block_sizes) * len(runs) * args.test, unit="query",
               desc="eval")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    for name, seed, block_size in itertools.product(names, seeds, args.block_sizes):
        demos, test, task = data(args, name, seed)
        run_dir = out / name / f"seed{seed}-shots{args.shots}-b{block_size}-w{args.context_blocks}"
        stores = {store_name(m, r): method_config(m, r, seed) for m in methods for r in args.ratios}
        bar.set_postfix_str(f"{name} seed {seed} b{block_size}: encoding")
        base = BuildConfig(block_size=block_size, context_blocks=args.context_blocks, seed=seed)
        built = encode_once(loaded, demos, task, base, stores, run_dir / "stores", progress=False)
        reference, prefilled, first = {}, {}, len(rows)
        for (m, sname), ratio in runs:
            bar.set_postfix_str(f"{name} seed {seed} b{block_size}: {m if m == PREFILL else sname}")
            t0, answered = time.perf_counter(), []
            recompute = split_recompute(m)[1]
            predictions = (run_dir.parent / f"seed{seed}-shots{args.shots}-b{block_size}-{PREFILL}" if m == PREFILL
                           else run_dir / recompute_name(sname, recompute))
            result = evaluate(loaded, run_dir / "stores" / sname, test, task, k=args.k,
                              predictions=f"{predictions}-k{args.k}{_length_tag(args, task)}.jsonl",
                              max_new_tokens=args.max_new_tokens, batch=args.batch, prefill=m == PREFILL,
                              recompute=recompute,
                              on_answer=lambda r: (answered.append(r), bar.update()))
            bar.update(result["n"] - len(answered))  # items resumed from the predictions file
            answers = result.pop("answers")
            reference = answers if m == "full" else reference
            if m == PREFILL:
                prefilled = answers
                for row in rows[first:]:  # full's row, answered before
                    row["agreement_prefill"] = agreement(reference, prefilled)
            rows.append({"dataset": name, "seed": seed, "method": m, "resolved": resolve(m, ratio), "store": sname,
                         "k": args.k, "shots": args.shots, "block_size": block_size,
                         "context_blocks": None if m == PREFILL else args.context_blocks,  # prefill's: any
                         "ratio_setting": stores[sname].ratio, "eval_s": time.perf_counter() - t0,
                         "build": built[sname], "agreement": None if m == "full" else agreement(answers, reference),
                         "agreement_prefill": agreement(answers, prefilled) if prefilled and m != PREFILL else None,
                         **result})
            header = _header(args, command, started, loaded.identity["name"])
            write_tables(rows, out, header=header)
    bar.close()
    md = (out / "results.md").read_text(encoding="utf-8")
    print(md)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'} in {time.perf_counter() - started:.0f} s")
    return 0


def _length_tag(args, task) -> str:
    """A free-form answer length other than the default is part of the predictions file's name."""
    return f"-n{args.max_new_tokens}" if task.answer_kind != "label" and args.max_new_tokens != MAX_NEW_TOKENS else ""


def _numbers(flag: str, text: str, kind) -> list:
    """A comma-separated list of numbers, in order and without repeats."""
    try:
        values = list(dict.fromkeys(kind(x) for x in str(text).split(",") if x.strip()))
    except ValueError:
        raise CommandError(f"{flag} takes comma-separated numbers; got {text!r}") from None
    if not values:
        raise CommandError(f"{flag}: no value given")
    return values


def _header(args, command: str, started: float, model: str) -> str:
    """What a reader of the table needs to reproduce it."""
    return (f"Accuracy (%) on the first {args.test} test items; {args.shots} demonstrations, block size "
            f"{args.block_size}, {args.context_blocks} context blocks, k={args.k}, ρ={args.ratio}, "
            f"seed(s) {args.first_seed}..{args.first_seed + args.seeds - 1}; model {model}. "
            f"In brackets: the share of answers equal to full's.\n\n"
            f"{'Command: `' + command + '`. ' if command else ''}"
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} with {_cpus()} CPU core(s), "
            f"{torch.get_num_threads()} torch thread(s), {time.perf_counter() - started:.0f} s so far.\n")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
