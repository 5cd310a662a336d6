"""The evaluation harness at CI size: shared encodings, measured bytes, resumable scoring, the tables.

The model tests build three tiny stores (8 demonstrations of the demo corpus, blocks of 4) once per
module and answer two demo queries from each.
"""
import dataclasses
import json
from argparse import Namespace

import pytest
import torch

from milo_infer.building.config import BuildConfig
from milo_infer.cli import CommandError
from milo_infer.cli.eval import check
from milo_infer.tasks.corpus import load_corpus, task_from_corpus
from milo_infer.cli.build import add_arguments as build_arguments, compression_config
from milo_infer.evaluation.evaluate import agreement, evaluate
from milo_infer.evaluation.methods import default_method, fixed_ratio, method_config, resolve, split_recompute, store_name
from milo_infer.building.shared_staging import encode_once
from milo_infer.evaluation.tables import write_tables

DEMO = "milo_infer/tasks/data/demo_corpus.jsonl"
QUERIES = "milo_infer/tasks/data/demo_queries.jsonl"
METHODS = ("full", "milo-fullrank", "milo")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On a shared CPU, torch's threads fight other jobs for cores: one thread is many times faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model):
    corpus = load_corpus(DEMO)
    task = task_from_corpus(corpus)
    base = BuildConfig(block_size=4, context_blocks=1, order="corpus")
    stores = {store_name(m, 0.5): method_config(m, 0.5) for m in METHODS}
    root = tmp_path_factory.mktemp("eval") / "stores"
    summaries = encode_once(default_model, corpus[:8], task, base, stores, root, progress=False)
    return root, summaries, task, load_corpus(QUERIES)[:2]


@pytest.mark.slow
def test_one_encoding_per_codec_and_stores_are_reused(built, default_model):
    root, summaries, task, _ = built
    encoded = {name: s["blocks_encoded_now"] for name, s in summaries.items()}
    # only the identity store runs the model: the SVD staging is factored from its K/V, then shared
    assert encoded == {"full": 2, "milo-fullrank": 0, "milo-r0.5": 0}
    assert len([p for p in root.iterdir() if p.name.startswith("staging-") and p.is_dir()]) == 2
    assert not list(root.glob("*.staging"))
    again = encode_once(default_model, load_corpus(DEMO)[:8], task, BuildConfig(block_size=4, context_blocks=1,
                        order="corpus"), {"milo-r0.5": method_config("milo", 0.5)}, root, progress=False)
    assert again["milo-r0.5"]["reused"] is True


@pytest.mark.slow
def test_full_rank_matches_identity_and_bytes_are_measured(built, default_model, tmp_path):
    root, _, task, queries = built
    results = {name: evaluate(default_model, root / name, queries, task, k=2, predictions=tmp_path / f"{name}.jsonl")
               for name in ("full", "milo-fullrank", "milo-r0.5")}
    preds = {name: [json.loads(l)["prediction"] for l in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
             for name in results}
    assert preds["milo-fullrank"] == preds["full"]  # fp16 factors at full rank: the codec loses nothing that matters
    assert results["milo-fullrank"]["accuracy"] == results["full"]["accuracy"]
    assert all(r["n"] == 2 for r in results.values())
    milo, full = results["milo-r0.5"], results["full"]
    assert milo["store_ratio"] <= 0.5 + 1e-3 < full["store_ratio"]
    assert milo["query_kv_bytes_stored"] < milo["query_kv_bytes_full"] == full["query_kv_bytes_full"]
    assert full["query_kv_bytes_stored"] > full["query_kv_bytes_full"]  # identity also stores Σ = 1 and B = I
    assert {"retrieve", "rebuild", "model"} <= set(full["seconds"])


@pytest.mark.slow
def test_a_bits_store_is_built_from_the_shared_staging_and_answers(built, default_model, tmp_path):
    """The bits codec through the real build (calibration attention from the model, in context for one
    pool) and the engine's rebuild (its blocks decoded to fp16 factors): near-full-rank it answers as the
    full cache does."""
    root, _, task, queries = built
    base = BuildConfig(block_size=4, context_blocks=1, order="corpus")
    names = {store_name("bits", r): method_config("bits", r) for r in (0.9, 0.25)}
    names[store_name("bits-shared", 0.25)] = method_config("bits-shared", 0.25)  # errors in context, one pool
    summaries = encode_once(default_model, load_corpus(DEMO)[:8], task, base, names, root, progress=False)
    assert all(s["blocks_encoded_now"] == 0 for s in summaries.values())  # the shared SVD staging, no encoding
    full = evaluate(default_model, root / "full", queries, task, k=2, predictions=tmp_path / "full.jsonl")
    for name, ratio in (("bits-r0.9", 0.9), ("bits-r0.25", 0.25), ("bits-shared-r0.25", 0.25)):
        result = evaluate(default_model, root / name, queries, task, k=2, predictions=tmp_path / f"{name}.jsonl")
        assert result["n"] == 2 and result["store_ratio"] <= ratio
        assert result["query_kv_bytes_stored"] < result["query_kv_bytes_full"]
    answers = lambda name: [json.loads(l)["prediction"] for l in (tmp_path / f"{name}.jsonl").read_text().splitlines()]  # noqa: E731
    assert answers("bits-r0.9") == answers("full") and full["n"] == 2


@pytest.mark.slow
def test_an_interrupted_run_resumes_and_refuses_foreign_lines(built, default_model, tmp_path):
    root, _, task, queries = built
    log = tmp_path / "p.jsonl"
    first = evaluate(default_model, root / "milo-r0.5", queries, task, k=2, n=1, predictions=log)
    with log.open("a") as f:
        f.write('{"key": "torn')  # a write cut short by a kill
    asked = []
    second = evaluate(default_model, root / "milo-r0.5", queries, task, k=2, predictions=log, on_answer=asked.append)
    assert [r["id"] for r in asked] == [queries[1].id]
    assert second["n"] == 2 and first["n"] == 1
    assert len(log.read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="another store, k"):
        evaluate(default_model, root / "milo-r0.5", queries, task, k=1, predictions=log)
    # a label's length is its trie's: --max-new-tokens does not change label answers, nor their log
    assert evaluate(default_model, root / "milo-r0.5", queries, task, k=2, predictions=log, max_new_tokens=8)["n"] == 2
    free_form = dataclasses.replace(task, answer_kind="number")
    with pytest.raises(ValueError, match="--max-new-tokens"):  # free-form answers of another length
        evaluate(default_model, root / "milo-r0.5", queries, free_form, k=2, predictions=log, max_new_tokens=8)


def _row(method, dataset, accuracy, store_bytes):
    return {"method": method, "dataset": dataset, "seed": 0, "accuracy": accuracy, "n": 10,
            "store_bytes": store_bytes, "store_full_fp16_bytes": 1000, "query_kv_bytes_stored": store_bytes * 4,
            "query_kv_bytes_full": 4000, "seconds": {}}


def test_table_is_methods_by_datasets_with_average_and_measured_ratio(tmp_path):
    rows = [_row("full", "a", 0.8, 1000), _row("full", "b", 0.6, 1000), _row("milo", "a", 0.7, 250),
            _row("milo", "b", 0.5, 250)]
    md, js = write_tables(rows, tmp_path)
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| Method | a | b | Avg. |")
    assert lines[2].startswith("| full | 80.0 | 60.0 | 70.0 | 1.000 (1.00× smaller)")
    assert lines[3].startswith("| milo | 70.0 | 50.0 | 60.0 | 0.250 (4.00× smaller)")
    assert json.loads(js.read_text()) == rows


def test_table_labels_rows_by_ratio_and_block_size_only_where_they_vary(tmp_path):
    rows = [{**_row("full", "a", 0.8, 1000), "ratio_setting": 1.0, "block_size": 16},
            {**_row("milo", "a", 0.6, 500), "ratio_setting": 0.5, "block_size": 16},
            {**_row("milo", "a", 0.4, 250), "ratio_setting": 0.25, "block_size": 16}]
    text = write_tables(rows, tmp_path)[0].read_text()
    assert "| full | 80.0 |" in text and "| milo ρ=0.5 | 60.0 |" in text and "| milo ρ=0.25 | 40.0 |" in text
    rows.append({**_row("milo", "a", 0.3, 250), "ratio_setting": 0.25, "block_size": 32})
    text = write_tables(rows, tmp_path)[0].read_text()
    assert "| full m=16 |" in text and "| milo ρ=0.25 m=32 | 30.0 |" in text


def test_table_marks_a_missing_cell_and_gives_no_average(tmp_path):
    md, _ = write_tables([_row("full", "a", 0.8, 1000), _row("milo", "b", 0.5, 250)], tmp_path)
    assert "| full | 80.0 | – | – |" in md.read_text()


def test_method_names_compose_a_base_modifiers_and_a_quantization():
    c = method_config("milo+int8-layer-ks0.3", 0.25, seed=2)
    assert (c.codec, c.dtype, c.key_share, c.scope, c.ratio, c.seed) == ("svd", "int8", 0.3, "layer", 0.25, 2)
    assert method_config("milo-energy", 0.5).policy == "energy" and method_config("full+kivi", 0.5).dtype == "int2"
    assert method_config("global-proj+int4", 0.5).codec == "global-proj"
    assert store_name("milo+int8-fullrank", 0.25) == "milo+int8-fullrank" and store_name("full+kivi", 0.3) == "full+kivi"
    for bad, message in [("full-energy", "not a modifier of full"), ("milo+int8+int4", "one quantization per method"),
                         ("milo+fp8", r"\+fp8 is not a quantization"), ("milo--energy", "cannot read"),
                         ("svd", "must start with"), ("milo-ks1.5", "not a modifier"), ("milo-ks.3", "not a modifier"),
                         ("milo-qaw+int8", "write it as 'milo\\+int8-qaw'"), ("milo-layer-energy", "milo-energy-layer"),
                         ("milo-energy-uniform", "one modifier of each kind"), ("milo-entropy", "not a modifier"),
                         ("milo+int2", "not a quantization")]:
        with pytest.raises(ValueError, match=message):
            method_config(bad, 0.5)


def test_the_bits_method_names_its_codec_and_takes_only_a_key_share_or_one_pool():
    c = method_config("bits-ks0.3", 0.125)
    assert (c.codec, c.dtype, c.query_aware, c.key_share) == ("bits", "float16", True, 0.3)
    assert store_name("bits", 0.125) == "bits-r0.125"
    pooled = method_config("bits-shared", 0.125)
    assert (pooled.codec, pooled.kv_split, pooled.key_share) == ("bits", "shared", 0.5)
    measured = method_config("bits-ks0.25-ctx", 0.125)
    assert (measured.in_context, measured.key_share) == (True, 0.25) and not method_config("bits", 0.125).in_context
    with pytest.raises(ValueError, match="apply to the bits codec"):
        method_config("milo-ctx", 0.125)
    assert build_config("--ratio", "0.125", "--codec", "bits", "--kv-split", "shared").kv_split == "shared"
    for bad in ("bits+int4", "bits-energy", "bits-qaw", "bits-shared-ks0.3"):
        with pytest.raises(ValueError, match="only -ks<share>, -shared or -ctx|one modifier of each kind"):
            method_config(bad, 0.125)


def test_raw_methods_are_plain_kv_quantization_at_the_formats_ratio():
    c = method_config("raw+kivi", 0.25)
    assert (c.codec, c.dtype, c.query_aware) == ("raw", "int2", False)
    assert store_name("raw+int8", 0.25) == store_name("raw+int8", 0.5) == "raw+int8"
    assert method_config("milo+int8-frontier-qaw", 0.5).policy == "frontier"
    for bad in ("raw-energy", "raw+int8-qaw"):
        with pytest.raises(ValueError, match="not a modifier of raw"):
            method_config(bad, 0.5)


def build_config(*flags):
    import argparse

    parser = argparse.ArgumentParser()
    build_arguments(parser)
    return compression_config(parser.parse_args(["--dataset", "banking77", "--out", "x", *flags]))


@pytest.mark.parametrize("ratio", [0.5, 0.25, 0.125])
def test_default_method_is_what_milo_build_writes(ratio):
    """`--methods default` follows milo build's defaults: its config equals the CLI's with only the ratio given."""
    args = build_config("--ratio", str(ratio))
    assert method_config("default", ratio) == args
    assert method_config(default_method(ratio), ratio) == args
    assert store_name("default", ratio) == store_name(default_method(ratio), ratio)


def test_build_allocation_defaults_follow_the_dtype_and_yield_to_flags():
    def allocation(*flags):
        c = build_config(*flags)
        return c.dtype, c.policy, c.scope, c.kv_split

    assert allocation("--ratio", "0.5") == ("int8", "frontier", "global", "shared")
    assert allocation("--ratio", "0.25") == ("int4", "frontier", "global", "shared")
    assert allocation("--ratio", "0.125", "--codec", "svd") == ("int4", "entropy", "head", "separate")
    bits = build_config("--ratio", "0.125")  # below 0.2 the default is the bits codec, keys on a quarter ...
    assert (bits.codec, bits.dtype, bits.query_aware, bits.key_share) == ("bits", "float16", True, 0.25)
    assert default_method(0.125) == "bits-ks0.25" and build_config("--ratio", "0.1", "--key-share", "0.4").key_share == 0.4
    for flags in (("--dtype", "int4"), ("--policy", "energy"), ("--no-query-aware",)):  # ... unless a flag asks for low rank
        assert build_config("--ratio", "0.125", *flags).codec == "svd"
    assert build_config("--ratio", "0.2").codec == "svd" and build_config("--ratio", "0.5").key_share == 0.5
    assert allocation("--ratio", "0.5", "--dtype", "float16") == ("float16", "entropy", "head", "separate")
    assert allocation("--ratio", "0.5", "--policy", "energy") == ("int8", "energy", "global", "shared")
    assert allocation("--ratio", "0.5", "--key-share", "0.3") == ("int8", "frontier", "global", "separate")
    raw = build_config("--codec", "raw", "--ratio", "0.25")
    assert (raw.codec, raw.ratio, raw.dtype, raw.policy) == ("raw", 1.0, "int8", "entropy")


def test_agreement_counts_equal_answers_on_shared_items(tmp_path):
    assert agreement({"a": "x", "b": "y", "c": "z"}, {"a": "x", "b": "q", "d": "z"}) == 0.5
    assert agreement({"a": "x"}, {}) is None
    rows = [{**_row("full", "a", 0.8, 1000), "agreement": None},
            {**_row("raw+int8", "a", 0.7, 520), "agreement": 0.9},
            {**_row("default", "a", 0.75, 500), "resolved": "milo+int8-qaw", "agreement": 0.96}]
    text = write_tables(rows, tmp_path)[0].read_text()
    assert "| full | 80.0 | 80.0 |" in text and "| raw+int8 | 70.0 [90%] |" in text
    assert "| default = milo+int8-qaw | 75.0 [96%] |" in text


def test_table_gives_agreement_with_prefill_beside_full_and_time_to_first_token(tmp_path):
    rows = [{**_row("full", "a", 0.8, 1000), "agreement": None, "agreement_prefill": 0.9,
             "first_token_seconds": 0.5, "prefill_tokens": 12},
            {**_row("prefill", "a", 0.85, 1000), "agreement": 0.9, "first_token_seconds": 20.0,
             "prefill_tokens": 4800},
            {**_row("milo", "a", 0.7, 250), "agreement": 0.95, "agreement_prefill": 0.88}]
    text = write_tables(rows, tmp_path)[0].read_text()
    assert "| full | 80.0 [– · 90%] | 80.0 | 1.000 (1.00× smaller) | 0.00 MiB of 0.00 MiB fp16 | 0.50 s | 12 |" in text
    assert "| prefill | 85.0 [90% · –] | 85.0 | no store | none (the model prefills) | 20.00 s | 4,800 |" in text
    assert "| milo | 70.0 [95% · 88%] | 70.0 |" in text and text.rstrip().endswith("| – | – |")
    rows[0]["context_blocks"], rows[2]["context_blocks"] = 0, 2
    text = write_tables(rows, tmp_path)[0].read_text()
    assert "| full w=0 | 80.0 [– · 90%] |" in text and "| milo w=2 |" in text and "| prefill | 85.0" in text


def test_prefill_is_fulls_retrieval_without_a_store_of_its_own():
    assert store_name("prefill", 0.25) == "full" and method_config("prefill", 0.25).codec == "identity"
    assert fixed_ratio("prefill")


def test_methods_and_arguments_are_checked_before_any_model_load():
    with pytest.raises(ValueError, match="unknown method"):
        method_config("milo-typo", 0.5)
    assert method_config("milo-fullrank", 0.5).full_rank and method_config("full", 0.5).codec == "identity"
    assert store_name("full", 0.5) == "full" and store_name("milo-energy", 0.25) == "milo-energy-r0.25"
    args = Namespace(methods="full,milo", dataset="banking77", corpus=None, queries=None, ratio=0.5, shots=8,
                     test=2, seeds=1, k=2, batch=8, block_size=4, context_blocks=1, threads=None, max_new_tokens=64,
                     first_seed=0)
    assert check(args) == (["banking77"], ["full", "milo"])
    lists = Namespace(**{**vars(args), "ratio": "0.25,0.5,0.25", "block_size": "4,8"})
    check(lists)
    assert lists.ratios == [0.25, 0.5] and lists.block_sizes == [4, 8]
    for change, message in [({"methods": "full,nope"}, "unknown method 'nope'"), ({"dataset": "imdb"}, "unknown imdb"),
                            ({"ratio": 1.5}, "ratio"), ({"ratio": "0.5,x"}, "comma-separated numbers"),
                            ({"block_size": "8,0"}, "--block-size must be at least 1"),
                            ({"first_seed": -1}, "--first-seed"), ({"max_new_tokens": 0}, "--max-new-tokens"), ({"k": 0}, "--k"), ({"batch": 0}, "--batch"), ({"threads": 0}, "--threads"), ({"corpus": DEMO}, "--queries")]:
        with pytest.raises(CommandError, match=message):
            check(Namespace(**{**vars(args), **change}))


def test_a_recompute_method_answers_from_its_base_methods_store():
    assert split_recompute("default-recompute16") == ("default", 16) and split_recompute("full") == ("full", 0)
    assert store_name("full-recompute4", 0.5) == "full" and fixed_ratio("full-recompute4")
    assert store_name("default-recompute4", 0.5) == store_name("default", 0.5) and not fixed_ratio("default-recompute4")
    assert resolve("default-recompute4", 0.5) == default_method(0.5) + "-recompute4"
    assert method_config("milo-energy-recompute8", 0.25) == method_config("milo-energy", 0.25)
    for bad, message in [("prefill-recompute4", "prefill computes every token"), ("full-recompute0", "1 or more"),
                         ("full-recompute08", "no leading zeros"), ("nope-recompute4", "unknown method 'nope'")]:
        with pytest.raises(ValueError, match=message):
            method_config(bad, 0.5)
