"""`milo build` and `build_store`: input errors before any long work, resume after an interrupt, ratio.

Most tests use a tiny random Llama (2 layers, 2 KV heads, head_dim 16) saved with the default
model's real tokenizer, so a whole build takes well under a second; only the last test loads the
real model (marked slow). Input errors are checked through ``milo_infer.cli.main.main`` with the
model loader replaced by a failure, which proves they are found before the model is loaded.
"""
import json
import math
from pathlib import Path

import pytest
import torch

import milo_infer.building.builder
import milo_infer.cli.build
from milo_infer.building.builder import build_store
from milo_infer.building.config import CUDA_ENCODE_BATCH, BuildConfig, BuildError, default_encode_batch
from milo_infer.cli.main import main
from milo_infer.tasks.corpus import DEMO_CORPUS, Demonstration, task_from_corpus
from milo_infer.models import ModelUnavailable, default_gguf_path, load_model
from milo_store import CompressionConfig, Layout, MiloStore, NotAStoreError
from milo_store.cli.main import main as store_main
from milo_store.synthetic import build_synthetic_store, store_contents

TINY_CONTEXT = 128  # max_position_embeddings of the tiny model: a long demonstration exceeds it


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer alone, from its converted cache (no 135M weights loaded)."""
    from transformers import AutoTokenizer

    from milo_infer.models import _converted_gguf

    try:
        return AutoTokenizer.from_pretrained(_converted_gguf(default_gguf_path()))
    except ModelUnavailable as exc:
        pytest.skip(f"default tokenizer unavailable: {exc}")


@pytest.fixture(scope="module")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """A tiny random Llama with the real tokenizer, saved as a Hugging Face folder for ``--model``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_CONTEXT,
                         tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny model as `build_store` takes it."""
    return load_model(tiny_model_dir)


def write_corpus(path: Path, n: int, numeric: bool = False) -> Path:
    labels = ("refund", "card lost", "transfer")
    rows = [{"id": f"d{i}", "input": f"customer message number {i} about my account",
             "output": str(i * 3) if numeric else labels[i % 3]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def snapshot(path: Path) -> dict:
    """Every file under ``path`` with its bytes: what "nothing was overwritten" compares."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the input was checked")


# --- input errors, found before the model is loaded --------------------------------------------

CORPORA = {
    "good.jsonl": None,  # written by write_corpus
    "empty.jsonl": b"\n",
    "fields.jsonl": b'{"input": "hello", "output": "greet"}\n{"input": "no output here"}\n',
    "latin1.csv": "input,output\ncaf\xe9 au lait,drink\n".encode("latin-1"),
}


@pytest.mark.parametrize("extra, message", [
    (["--corpus", "{dir}/empty.jsonl"], "empty.jsonl: the corpus is empty"),
    (["--corpus", "{dir}/fields.jsonl"], "fields.jsonl:2: missing field 'output'"),
    (["--corpus", "{dir}/latin1.csv"], "latin1.csv:2: not UTF-8 text"),
    (["--corpus", "{dir}/absent.jsonl"], "absent.jsonl: no such corpus file"),
    (["--corpus", "{dir}/good.jsonl", "--block-size", "13"], "--block-size 13 is larger than the 12 demonstrations"),
    (["--corpus", "{dir}/good.jsonl", "--shots", "4", "--block-size", "5"], "larger than the 4 demonstrations"),
    (["--corpus", "{dir}/good.jsonl", "--block-size", "0"], "--block-size must be at least 1; got 0"),
    (["--corpus", "{dir}/good.jsonl", "--ratio", "0"], "--ratio must be in (0, 1]; got 0.0"),
    (["--corpus", "{dir}/good.jsonl", "--ratio", "1.01"], "--ratio must be in (0, 1]; got 1.01"),
    (["--corpus", "{dir}/good.jsonl", "--ratio", "nan"], "--ratio must be in (0, 1]; got nan"),
    (["--corpus", "{dir}/good.jsonl", "--ratio", "half"], "argument --ratio: invalid float value: 'half'"),
    (["--corpus", "{dir}/good.jsonl", "--shots", "0"], "--shots must be at least 1; got 0"),
    (["--corpus", "{dir}/good.jsonl", "--encode-batch", "0"], "--encode-batch must be at least 1; got 0"),
    (["--corpus", "{dir}/good.jsonl", "--threads", "0"], "--threads must be at least 1; got 0"),
    (["--corpus", "{dir}/good.jsonl", "--shots", "13"], "--shots 13: {dir}/good.jsonl has only 12 demonstrations"),
    (["--corpus", "{dir}/good.jsonl", "--context-blocks", "-1"], "--context-blocks must be at least 0"),
    (["--corpus", "{dir}/good.jsonl", "--template", "Q: {input}"], "--template: task 'custom': template must contain"),
    (["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
    (["--corpus", "{dir}/good.jsonl", "--dataset", "trec"], "not allowed with argument"),
])
def test_bad_input_is_one_clear_line_before_the_model_loads(tmp_path, monkeypatch, capsys, extra, message):
    for name, content in CORPORA.items():
        if content is None:
            write_corpus(tmp_path / name, 12)
        else:
            (tmp_path / name).write_bytes(content)
    monkeypatch.setattr(milo_infer.cli, "load_model", no_model)
    out = tmp_path / "store"
    argv = ["build", *[a.replace("{dir}", str(tmp_path)) for a in extra], "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("milo build: "), err
    assert message.replace("{dir}", str(tmp_path)) in err
    assert not out.exists() and not Path(f"{out}.staging").exists()


@pytest.mark.parametrize("occupant", ["directory", "file", "store"])
def test_occupied_output_is_refused_and_left_alone(tmp_path, monkeypatch, capsys, occupant):
    corpus = write_corpus(tmp_path / "c.jsonl", 6)
    out = tmp_path / "out"
    if occupant == "directory":
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
        message = f"{out} exists and is not a milo store; refusing to overwrite it"
    elif occupant == "file":
        out.write_text("not a directory")
        message = f"{out} exists and is not a milo store"
    else:
        build_synthetic_store(out, Layout(2, 2, 16), [10, 12])
        message = f"{out} already holds a store; pass force=True (--force)"
    before = snapshot(out)
    monkeypatch.setattr(milo_infer.cli, "load_model", no_model)
    assert main(["build", "--corpus", str(corpus), "--block-size", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert snapshot(out) == before


def test_output_under_a_file(tmp_path, monkeypatch, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", 6)
    monkeypatch.setattr(milo_infer.cli, "load_model", no_model)
    assert main(["build", "--corpus", str(corpus), "--block-size", "2", "--out", str(corpus / "store")]) == 2
    assert f"{corpus} is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("out", ["/proc/x", "/proc/x/y", "/sys/x"])
def test_unwritable_output_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, out):
    corpus = write_corpus(tmp_path / "c.jsonl", 6)
    monkeypatch.setattr(milo_infer.cli, "load_model", no_model)
    assert main(["build", "--corpus", str(corpus), "--block-size", "2", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"milo build: {out}: cannot write a store there" in err, err


def test_unknown_model_path(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", 6)
    out = tmp_path / "out"
    assert main(["build", "--corpus", str(corpus), "--block-size", "2", "--model", str(tmp_path / "nomodel"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("milo build: --model: ") and "no such file or directory" in err and "nomodel" in err
    assert not out.exists()


def test_demonstration_longer_than_the_context(tiny_model_dir, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    rows = [{"input": "short one", "output": "a"}, {"id": "long", "input": "word " * 200, "output": "b"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["build", "--corpus", str(corpus), "--block-size", "1", "--model", str(tiny_model_dir),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("milo build: demonstration 'long' is ") and f"context of {TINY_CONTEXT}" in err
    assert not out.exists() and not Path(f"{out}.staging").exists()


def test_encoding_context_longer_than_the_model(tiny_model_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", 12)
    out = tmp_path / "out"
    assert main(["build", "--corpus", str(corpus), "--block-size", "6", "--model", str(tiny_model_dir),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"exceeds the model's {TINY_CONTEXT}; use a smaller --block-size or fewer --context-blocks" in err
    assert not out.exists()


@pytest.mark.parametrize("demos, block_size, message", [
    ([], 1, "the corpus is empty"),
    ([Demonstration("a", "x", "1")], 2, "block size 2 is larger than the corpus (1 demonstrations)"),
    ([Demonstration("a", "x", "1")], 0, "block size must be at least 1"),
    ([Demonstration("?!", "x", "1"), Demonstration("--", "y", "2")], 1, "no demonstration's input contains a letter"),
])
def test_build_store_checks_its_own_input(tiny, tmp_path, demos, block_size, message):
    task = task_from_corpus([Demonstration("a", "x", "1")])
    with pytest.raises(BuildError) as info:
        build_store(tmp_path / "out", tiny, demos, task, BuildConfig(block_size=block_size), progress=False)
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()


# --- builds with the tiny model ------------------------------------------------------------------

def build_json(capsys, *argv) -> dict:
    assert main(["build", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_interrupted_build_resumes_to_the_same_store(tiny_model_dir, tmp_path, monkeypatch, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", 12)
    args = ["--corpus", corpus, "--model", tiny_model_dir, "--block-size", "2", "--context-blocks", "1"]
    whole = build_json(capsys, *args, "--out", tmp_path / "whole")
    assert whole["blocks"] == 6 and whole["blocks_encoded_now"] == 6

    real, calls = milo_infer.building.builder.encode_blocks, []

    def interrupt_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(milo_infer.building.builder, "encode_blocks", interrupt_third)
    out = tmp_path / "resumed"
    assert main(["build", *map(str, args), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert f"interrupted with 2 block(s) staged in {out}.staging; rerun the same command to resume" in err
    with pytest.raises(NotAStoreError):
        MiloStore.open(out)
    monkeypatch.setattr(milo_infer.building.builder, "encode_blocks", real)

    resumed = build_json(capsys, *args, "--out", out)
    assert resumed["blocks_encoded_now"] == 6 - 2
    assert resumed["tokens_encoded_now"] < resumed["tokens"] == whole["tokens"]
    assert not Path(f"{out}.staging").exists()
    assert store_contents(tmp_path / "whole") == store_contents(out)


@pytest.mark.parametrize("encode_batch", [1, 2])
def test_a_damaged_staged_block_is_encoded_again(tiny, tmp_path, encode_batch):
    """A staged block that fails its checksum is encoded again, with the blocks of its encoding batch,
    so the batch it is computed in (and the store's bytes) are those of an uninterrupted build."""
    demos = [Demonstration(f"customer message number {i} about my account", ("refund", "card lost")[i % 2], str(i))
             for i in range(8)]
    task, config = task_from_corpus(demos), BuildConfig(block_size=2, context_blocks=1, encode_batch=encode_batch)
    build_store(tmp_path / "whole", tiny, demos, task, config, progress=False, keep_staging=True)
    staged = tmp_path / "whole.staging"
    damaged = staged / "block_000001.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0x10
    damaged.write_bytes(bytes(data))
    (staged / ".block_000002.tmp").write_bytes(b"a write cut short")
    resumed = build_store(tmp_path / "resumed", tiny, demos, task, config, progress=False, staging_dir=staged)
    assert resumed["blocks_encoded_now"] == encode_batch
    assert store_contents(tmp_path / "resumed") == store_contents(tmp_path / "whole")


def test_ratio_summary_and_force(tiny_model_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl", 12)
    out = tmp_path / "store"
    args = ["--corpus", str(corpus), "--model", str(tiny_model_dir), "--block-size", "3", "--context-blocks", "1",
            "--ratio", "0.5", "--out", str(out)]
    assert main(["build", *args]) == 0
    human = capsys.readouterr().out
    assert "4 blocks, 12 demonstrations, " in human and "(ratio 0." in human and "tok/s" in human
    assert store_main(["stat", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["planned_ratio"] == 0.5 and abs(info["actual_ratio"] - 0.5) <= 0.02 * 0.5
    assert info["blocks"] == 4 and info["demonstrations"] == 12
    with MiloStore.open(out) as store:  # query-aware weighting is milo build's default for svd
        assert store.meta["allocation"]["query_aware"] is True and store.meta["allocation"]["dtype"] == "int8"
    build_json(capsys, *args, "--force", "--no-query-aware")
    with MiloStore.open(out) as store:
        assert "query_aware" not in store.meta["allocation"]  # False: left out of the record
    # One budget per (layer, kind, head) over 4 small blocks leaves up to one rank unit unspent per group;
    # a global scope spends the budget to within a unit of the whole store.
    summary = build_json(capsys, *args, "--force", "--ratio", "0.25", "--scope", "global")
    assert abs(summary["ratio"] - 0.25) <= 0.02 * 0.25
    with MiloStore.open(out) as store:  # --dtype auto: int4 below ratio 0.4
        assert store.meta["allocation"]["dtype"] == "int4" and store.verify_all() == []
    assert set(summary) >= {"blocks", "demonstrations", "tokens", "full_fp16_bytes", "stored_bytes", "ratio",
                            "encode_s", "factorize_s", "write_s", "load_s", "total_s"}


def test_empty_anchor_builds(tiny, tmp_path):
    """A numeric corpus gets no default anchor; with a tokenizer that adds no prefix that is zero tokens."""
    demos = [Demonstration(f"what is {i} times 3", str(3 * i), str(i)) for i in range(4)]
    task = task_from_corpus(demos)
    assert task.anchor == "" and tiny.tokenizer("", add_special_tokens=True).input_ids == []
    summary = build_store(tmp_path / "s", tiny, demos, task, BuildConfig(block_size=2), progress=False)
    with MiloStore.open(summary["store"]) as store:
        assert store.anchor_kv().shape == (2, 2, 2, 0, 16) and store.num_blocks == 2


def test_query_aware_builds_verified_stores_within_the_ratio(tiny, tmp_path, monkeypatch):
    """Query-aware stores run the model once more, on a calibration sample no longer than its context."""
    demos = [Demonstration(f"customer message number {i} about my account", ("refund", "card lost")[i % 2], str(i))
             for i in range(12)]
    task = task_from_corpus(demos)
    samples, real = [], milo_infer.building.builder.channel_scales
    monkeypatch.setattr(milo_infer.building.builder, "channel_scales", lambda model, ids: samples.append(ids) or real(model, ids))
    stores = {}
    for codec, aware in (("example-svd", False), ("example-svd", True), ("svd", False), ("svd", True)):
        config = BuildConfig(block_size=3, context_blocks=1,
                             compression=CompressionConfig(codec=codec, ratio=0.5, query_aware=aware))
        stores[codec, aware] = build_store(tmp_path / f"{codec}-{aware}", tiny, demos, task, config,
                                           progress=False)["store"]
    assert len(samples) == 2 and 0 < len(samples[0]) <= TINY_CONTEXT  # only the query-aware ones calibrate
    assert samples[0][:3] == tiny.tokenizer(task.anchor, add_special_tokens=True).input_ids[:3]
    for codec, groups in (("example-svd", 4), ("svd", 4)):
        with MiloStore.open(stores[codec, True]) as aware, MiloStore.open(stores[codec, False]) as plain:
            assert aware.verify_all() == [] and aware.meta["allocation"]["query_aware"]
            assert aware.num_blocks == plain.num_blocks and aware.num_groups == groups
            assert 0.4 < aware.accounting()["ratio"] <= 0.5
            assert any(not torch.equal(aware.block(i), plain.block(i)) for i in range(plain.num_blocks))


# --- the real model ------------------------------------------------------------------------------

@pytest.mark.slow
def test_real_model_build_from_the_demo_corpus(tmp_path, capsys):
    corpus = DEMO_CORPUS
    out = tmp_path / "store"
    try:
        default_gguf_path()
    except ModelUnavailable as exc:
        pytest.skip(f"default model unavailable: {exc}")
    summary = build_json(capsys, "--corpus", corpus, "--shots", 8, "--block-size", 4, "--context-blocks", 1,
                         "--out", out)
    assert summary["blocks"] == 2 and summary["demonstrations"] == 8
    assert math.isclose(summary["ratio"], 0.5, abs_tol=0.01)
    with MiloStore.open(out) as store:
        assert store.meta["model"]["num_layers"] == 30 and store.verify_all() == []


def test_key_share_out_of_range_is_a_clear_error(tmp_path, capsys):
    from milo_infer.cli.main import main
    code = main(["build", "--corpus", "milo_infer/tasks/data/demo_corpus.jsonl", "--out", str(tmp_path / "s"),
                 "--key-share", "1.5"])
    assert code == 2
    assert "key share 1.5 must be in (0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_infeasible_ratio_is_refused_before_encoding(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import milo_infer.building.builder as build_module

    def never(*args, **kwargs):
        raise AssertionError("encoded a block before refusing the ratio")

    monkeypatch.setattr(build_module, "encode_blocks", never)
    corpus = str(write_corpus(tmp_path / "c.jsonl", 8))
    for codec, message in (("svd", "but rank 1 everywhere needs"), ("bits", "index and channel weights alone need")):
        code = main(["build", "--corpus", corpus, "--model", str(tiny_model_dir), "--out", str(tmp_path / "s"),
                     "--block-size", "2", "--context-blocks", "0", "--ratio", "0.001", "--codec", codec])
        assert code == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "s").exists()


def test_allocating_and_writing_show_progress(tiny, tmp_path, capsys):
    """After the encoding bar, pass two's stages have bars of their own, each run to its end."""
    demos = [Demonstration(f"customer message number {i}", ("refund", "card lost")[i % 2], str(i)) for i in range(6)]
    build_store(tmp_path / "s", tiny, demos, task_from_corpus(demos), BuildConfig(block_size=2), progress=True)
    err = capsys.readouterr().err
    assert "encoding" in err and "allocating: 100%" in err and "writing: 100%" in err, err
    assert err.index("encoding") < err.index("allocating") < err.index("writing")


def test_the_default_encode_batch_is_one_on_a_cpu_and_the_cuda_default_on_a_gpu():
    assert default_encode_batch("cpu") == 1
    assert default_encode_batch(torch.device("cuda", 0)) == CUDA_ENCODE_BATCH == 8


@pytest.mark.parametrize("rule", ["gated_delta", "mamba2", "conv"])
def test_an_empty_anchors_state_section_hands_any_state_on_unchanged(rule):
    """An anchor of no tokens (no instruction, no tokenizer prefix) carries a row's state through as it is: M the
    identity (a Mamba2 layer's ones), C zero, its conv tail zeros."""
    from milo_infer.building.builder import unchanged_section
    from milo_infer.runtime.prefix import carried
    from milo_store import Layout
    from milo_store.layers import ATTENTION, LINEAR, LayerSpec

    heads = dict(kv_heads=0, head_dim=0) if rule == "conv" else dict(kv_heads=3, head_dim=4, value_dim=5)
    layout = Layout.of([LayerSpec(LINEAR, **heads, conv_dim=7, conv_kernel=4, rule=rule), LayerSpec(ATTENTION, 2, 8)])
    section = layout.state_section(0, unchanged_section(layout, 0))
    state = torch.randn(section["C"].shape)
    torch.testing.assert_close(carried(section, state), state, rtol=0, atol=0)
    assert not section["conv"].any() and not section["C"].any()
