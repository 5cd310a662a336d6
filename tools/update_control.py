"""Does `milo update` cost accuracy beyond what a reshuffle does? An updated store against a rebuilt one, beside a
rebuild with another shuffle seed against the same rebuild (the control), per data set and seed.

For each data set and seed (the data set's shuffle, as `milo eval --seeds` takes it, and the build's): ``--shots``
training demonstrations are built into a store, then updated: ``--remove`` of them (spread over the store,
one every 1/remove) go and the next ``--add`` of the training split come. Beside it, the corpus the update ends with
is rebuilt twice: with the same build seed (``rebuilt``) and with another (``reshuffled``: the same
demonstrations in other blocks). Each of the three stores exists twice, as `milo eval` builds them: ``full``
(the uncompressed identity store) and the method measured (``--method``, default `default`), both from one
encoding (`encode_once`); the update is applied to both. The first ``--test`` test items are answered from
each store (k, batch and the predictions' JSONL files as `milo eval`'s `evaluate`, so a killed run resumes),
and by ``prefill`` (the model prefilling the demonstrations the full store retrieves).

Reported per store: accuracy, and the agreement of its answers with its own full cache and with prefill; and
the agreement of the updated and of the reshuffled store with the rebuilt one. An update costs accuracy beyond
a reshuffle if the updated store's accuracy falls further below the rebuilt one's than the reshuffled
store's does, across seeds. Run (hours on a CPU; run it where nothing else runs):

    MILO_DATA=/work/shared/data HF_HUB_OFFLINE=1 .venv/bin/python tools/update_control.py \\
        --dataset banking77,trec --seeds 3 --shots 2048 --test 500 --threads 2 --out /tmp/update_control

``--corpus FILE --queries FILE`` (JSONL or CSV with input, output and id) replaces the data sets, with
``--model DIR`` any model `milo` loads: what the test runs at toy size.
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from milo_infer.building.config import BuildConfig  # noqa: E402
from milo_infer.building.shared_staging import encode_once  # noqa: E402
from milo_infer.building.update import update_store  # noqa: E402
from milo_infer.evaluation.evaluate import agreement, evaluate  # noqa: E402
from milo_infer.evaluation.methods import method_config, store_name  # noqa: E402
from milo_infer.models import load_model  # noqa: E402
from milo_infer.tasks.corpus import load_corpus, task_from_corpus  # noqa: E402
from milo_infer.tasks.datasets import load_dataset  # noqa: E402

RESHUFFLE = 1000  # the control's build seed: the run's seed + this
VARIANTS = ("updated", "rebuilt", "reshuffled")


def changes(train: list, shots: int, add: float, remove: float) -> tuple[list, list, list[str], list]:
    """(the store's demonstrations, those added, the ids removed (spread evenly), the corpus the update ends with)."""
    base = train[:shots]
    n_add, n_remove = round(shots * add), round(shots * remove)
    if shots + n_add > len(train):
        raise SystemExit(f"--add {add}: {n_add} more demonstrations than the {len(train) - shots} left")
    if n_remove >= shots:
        raise SystemExit(f"--remove {remove}: it would remove every demonstration")
    step = shots / n_remove if n_remove else 0
    removed = [base[int(i * step)].id for i in range(n_remove)]
    added = train[shots:shots + n_add]
    gone = set(removed)
    return base, added, removed, [d for d in base if d.id not in gone] + added


def build_variants(loaded, task, base, added, removed, final, config: BuildConfig, stores: dict, run_dir: Path,
                   seed: int) -> dict[str, Path]:
    """The three stores' folders (each holding every store of ``stores``): built, updated, rebuilt twice."""
    encode_once(loaded, base, task, dataclasses.replace(config, seed=seed), stores, run_dir / "base", progress=False)
    for name in stores:  # the update, once, on a hard-linked copy of the base store (resumable: done when renamed)
        target = run_dir / "updated" / name
        if not target.exists():
            work = run_dir / "updated" / f"{name}.updating"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(run_dir / "base" / name, work, copy_function=os.link)
            update_store(work, loaded, add=added, remove=removed, progress=False)
            work.rename(target)
    encode_once(loaded, final, task, dataclasses.replace(config, seed=seed), stores, run_dir / "rebuilt", progress=False)
    encode_once(loaded, final, task, dataclasses.replace(config, seed=seed + RESHUFFLE), stores,
                run_dir / "reshuffled", progress=False)
    return {v: run_dir / v for v in VARIANTS}


def control(loaded, train, test, task, args, dataset: str, seed: int) -> list[dict]:
    """One data set and seed: a row per store variant."""
    base, added, removed, final = changes(train, args.shots, args.add, args.remove)
    config = BuildConfig(block_size=args.block_size, context_blocks=args.context_blocks)
    method = store_name(args.method, args.ratio)
    stores = {"full": method_config("full", args.ratio, seed), method: method_config(args.method, args.ratio, seed)}
    run_dir = Path(args.out) / dataset / f"seed{seed}-shots{args.shots}-b{args.block_size}-w{args.context_blocks}"
    folders = build_variants(loaded, task, base, added, removed, final, config, stores, run_dir, seed)
    answers, rows = {}, []
    for variant, folder in folders.items():
        got = {}
        for label, name, prefill in (("full", "full", False), ("prefill", "full", True), ("method", method, False)):
            result = evaluate(loaded, folder / name, test, task, k=args.k, batch=args.batch, prefill=prefill,
                              predictions=folder / f"{label}-k{args.k}.jsonl")
            got[label] = result
        answers[variant] = got["method"]["answers"]
        rows.append({"dataset": dataset, "seed": seed, "variant": variant, "n": got["method"]["n"],
                     "accuracy": got["method"]["accuracy"], "full_accuracy": got["full"]["accuracy"],
                     "prefill_accuracy": got["prefill"]["accuracy"],
                     "agreement_full": agreement(got["method"]["answers"], got["full"]["answers"]),
                     "agreement_prefill": agreement(got["method"]["answers"], got["prefill"]["answers"]),
                     "added": len(added), "removed": len(removed)})
    for row in rows:
        row["agreement_rebuilt"] = agreement(answers[row["variant"]], answers["rebuilt"])
    return rows


def spread(values: list[float]) -> str:
    """The mean, then each seed's value."""
    return f"{statistics.fmean(values):.3f} ({' '.join(f'{v:.3f}' for v in values)})"


def table(rows: list[dict]) -> str:
    """Per data set and store: means over seeds, each seed's value in brackets."""
    lines = ["| data set | store | seeds | n | accuracy | Δ vs rebuilt | agreement with rebuilt | agreement with full | "
             "agreement with prefill | full / prefill accuracy |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == dataset]
        rebuilt = {r["seed"]: r["accuracy"] for r in mine if r["variant"] == "rebuilt"}
        for variant in VARIANTS:
            rs = [r for r in mine if r["variant"] == variant]
            column = lambda field: spread([r[field] for r in rs])  # noqa: E731
            lines.append(f"| {dataset} | {variant} | {len(rs)} | {rs[0]['n']} | {column('accuracy')} | "
                         f"{spread([r['accuracy'] - rebuilt[r['seed']] for r in rs])} | {column('agreement_rebuilt')} | "
                         f"{column('agreement_full')} | {column('agreement_prefill')} | "
                         f"{statistics.fmean(r['full_accuracy'] for r in rs):.3f} / "
                         f"{statistics.fmean(r['prefill_accuracy'] for r in rs):.3f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="banking77,trec", help="data sets (milo eval's names), comma-separated")
    ap.add_argument("--corpus", help="a demonstration file instead of the data sets (needs --queries)")
    ap.add_argument("--queries", help="the test items for --corpus")
    ap.add_argument("--model", default="default")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--shots", type=int, default=2048)
    ap.add_argument("--test", type=int, default=500, help="test items answered from every store")
    ap.add_argument("--add", type=float, default=0.01, help="share of --shots added by the update")
    ap.add_argument("--remove", type=float, default=0.01, help="share of --shots removed, spread over the store")
    ap.add_argument("--method", default="default", help="the store measured, a milo eval method (default: default)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--context-blocks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, required=True, help="stores, predictions (resumable) and results.json")
    args = ap.parse_args(argv)
    if (args.corpus is None) != (args.queries is None):
        ap.error("--corpus and --queries go together")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    rows = []
    for dataset in ([Path(args.corpus).stem] if args.corpus else args.dataset.split(",")):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            if args.corpus:
                train, test = load_corpus(args.corpus), load_corpus(args.queries)
                task = task_from_corpus(train)
            else:
                train, test, task = load_dataset(dataset, seed=seed)
            rows += control(loaded, train, test[:args.test], task, args, dataset, seed)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps(rows, indent=1))
            print(f"{dataset} seed {seed} done", file=sys.stderr, flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
