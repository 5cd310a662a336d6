"""`milo update` and `update_store`: only changed blocks encoded, equality with a rebuild where the blocks are
the same, removed demonstrations gone, and the refusals (model, rows, ids, a second writer).

The tiny random Llama of test_build.py (2 layers, 2 KV heads, head_dim 16, the default tokenizer) builds
and updates a store in about a second; corpus-order stores of blocks of 2 with 1 context block, so a
rebuild of the final corpus lays out the same blocks where the update keeps the boundaries.
"""
import dataclasses
import json
import threading

import numpy as np
import pytest
import torch

import milo_infer.building.builder
import milo_infer.cli
from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig, BuildError, default_compression
from milo_infer.building.update import update_store
from milo_infer.cli.main import main
from milo_infer.models import load_model
from milo_infer.runtime.planning import EngineSettings
from milo_infer.runtime.session import MiloSession
from milo_infer.tasks.corpus import Demonstration, task_from_corpus
from milo_store import CompressionConfig, IncompatibleStoreError, MiloStore, StoreLockedError
from milo_store.cli.main import main as store_main
from milo_store.synthetic import store_contents

from ...store.format3 import format3_copy
from .test_build import no_model, snapshot, tiny, tiny_model_dir, tokenizer  # noqa: F401 (fixtures)

LABELS = ("refund", "card lost", "transfer")
QUERIES = ["message number 3 about my account", "customer number 12", "refund my card"]
IDENTITY = CompressionConfig(codec="identity", dtype="float16")


def demo(i: int) -> Demonstration:
    return Demonstration(f"customer message number {i} about my account", LABELS[i % 3], f"d{i}")


def config(compression=IDENTITY, **kw) -> BuildConfig:
    return BuildConfig(block_size=2, context_blocks=1, order="corpus", compression=compression, **kw)


TASK = task_from_corpus([demo(i) for i in range(3)])


def build(loaded, path, demos, compression=IDENTITY):
    build_store(path, loaded, demos, TASK, config(compression), progress=False)
    return path


contents = store_contents  # what a reader sees, where the bytes lie aside


def blocks(path) -> list[torch.Tensor]:
    with MiloStore.open(path) as s:
        assert s.verify_all() == []
        return [s.block(i).clone() for i in range(s.num_blocks)]


def logits(loaded, path) -> list[torch.Tensor]:
    with MiloStore.open(path) as store:
        session = MiloSession(loaded, store, EngineSettings(k=2))  # the tiny model has 128 positions
        return [session.logits(q) for q in QUERIES] + [session.answer(q).text for q in QUERIES]


def assert_same_answers(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_updates_equal_a_rebuild_where_the_blocks_are_the_same(tiny, tmp_path):
    """Appending (the last, short block filled, then new ones) and removing from the last block leave the
    blocks a rebuild of the final corpus has: the store is the rebuild's, array for array, and answers as it."""
    store = build(tiny, tmp_path / "s", [demo(i) for i in range(7)])
    before = blocks(store)
    summary = update_store(store, tiny, [demo(i) for i in range(7, 11)], progress=False)
    assert (summary["blocks"], summary["blocks_kept"], summary["blocks_encoded_now"]) == (6, 3, 3)
    after = blocks(store)
    assert all(torch.equal(after[i], before[i]) for i in range(3))  # the last block (d6) was filled, so encoded
    rebuilt = build(tiny, tmp_path / "r", [demo(i) for i in range(11)])
    assert contents(store) == contents(rebuilt)
    assert_same_answers(logits(tiny, store), logits(tiny, rebuilt))

    summary = update_store(store, tiny, remove=["d10"], progress=False)  # the last block [d10] goes
    assert (summary["blocks"], summary["blocks_kept"], summary["blocks_encoded_now"]) == (5, 5, 0)
    summary = update_store(store, tiny, remove=["d9"], progress=False)  # the last block becomes [d8]
    assert (summary["blocks_kept"], summary["blocks_encoded_now"]) == (4, 1)
    rebuilt = build(tiny, tmp_path / "r2", [demo(i) for i in range(9)])
    assert contents(store) == contents(rebuilt)
    assert_same_answers(logits(tiny, store), logits(tiny, rebuilt))


def test_a_bits_store_updates_and_answers(tiny, tmp_path):
    """`milo update` of a bits store: kept blocks byte for byte, new blocks with bases of their own under
    the store's channel weights, the ratio still met, and the engine answers from it."""
    bits = default_compression(0.5, codec="bits")
    store = build(tiny, tmp_path / "s", [demo(i) for i in range(6)], bits)
    before = blocks(store)
    with MiloStore.open(store) as s:
        weights = s.codec.weights.clone()
    summary = update_store(store, tiny, [demo(i) for i in range(6, 10)], progress=False)
    assert (summary["blocks"], summary["blocks_kept"], summary["blocks_encoded_now"]) == (5, 3, 2)
    after = blocks(store)
    assert all(torch.equal(after[i], before[i]) for i in range(3))
    with MiloStore.open(store) as s:
        assert s.meta["codec"] == "bits" and torch.equal(s.codec.weights, weights)
        assert s.accounting()["ratio"] <= 0.5 + 1e-3
    answers = logits(tiny, store)[len(QUERIES):]
    assert len(answers) == len(QUERIES) and all(isinstance(a, str) for a in answers)


def test_a_removal_encodes_its_block_and_the_next_and_leaves_nothing_of_it(tiny, tmp_path, capsys, tokenizer):
    store = build(tiny, tmp_path / "s", [demo(i) for i in range(8)], default_compression(0.5))
    before = blocks(store)
    with MiloStore.open(store) as s:
        old_checksums = set(s.checksums.tolist())
    summary = update_store(store, tiny, remove=["d3"], progress=False)  # block 1 [d2, d3] -> [d2]; block 2 re-encoded
    assert (summary["blocks"], summary["blocks_kept"], summary["blocks_encoded_now"]) == (4, 2, 2)
    after = blocks(store)
    assert torch.equal(after[0], before[0]) and torch.equal(after[3], before[3])
    with MiloStore.open(store) as s:
        examples, token_ids = s.examples(), np.concatenate([s.token_ids(i) for i in range(s.num_blocks)])
        assert {s.checksums[1], s.checksums[2]}.isdisjoint(old_checksums)  # K/V that saw d3 are gone
        assert 0.45 <= s.accounting()["ratio"] <= 0.5 * 1.02
    assert "d3" not in examples["id"] and demo(3).input not in examples["input"]
    removed = tokenizer(TASK.render(demo(3)), add_special_tokens=False).input_ids
    assert not any(token_ids[i:i + len(removed)].tolist() == removed for i in range(len(token_ids)))
    assert store_main(["verify", str(store), "--absent", "d3"]) == 0
    capsys.readouterr()

    summary = update_store(store, tiny, remove=["d4", "d5"], progress=False)  # block 2 emptied: block 3, now 2, has
    # another context block and is encoded again
    assert (summary["blocks"], summary["blocks_kept"], summary["blocks_encoded_now"]) == (3, 2, 1)
    assert torch.equal(blocks(store)[0], before[0])


def test_an_update_of_a_url_and_gc_of_what_it_removed(tiny, tiny_model_dir, tmp_path, s3_url, monkeypatch, capsys):
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    build(tiny, s3_url, [demo(i) for i in range(6)])
    corpus = tmp_path / "more.jsonl"
    corpus.write_text("".join(json.dumps(dataclasses.asdict(demo(i))) + "\n" for i in range(6, 8)))
    assert main(["update", s3_url, "--add", str(corpus), "--remove", "d1", "--model", str(tiny_model_dir),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["added"], summary["removed"], summary["blocks"]) == (2, 1, 4)
    assert store_main(["verify", s3_url, "--absent", "d1"]) == 1  # the previous version still holds it
    assert store_main(["gc", s3_url, "--only-current", "--older-than", "0"]) == 0
    assert store_main(["verify", s3_url, "--absent", "d1"]) == 0
    assert "1 demonstration(s) absent" in capsys.readouterr().out


def test_a_killed_update_resumes_from_what_it_staged(tiny, tmp_path, monkeypatch):
    store = build(tiny, tmp_path / "s", [demo(i) for i in range(4)])
    whole = build(tiny, tmp_path / "w", [demo(i) for i in range(4)])
    update_store(whole, tiny, [demo(i) for i in range(4, 10)], progress=False)
    real, calls = milo_infer.building.builder.encode_blocks, []

    def interrupt_second_block(*a, **k):  # the first call encodes the anchor (the model check)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(milo_infer.building.builder, "encode_blocks", interrupt_second_block)
    before = snapshot(store)
    with pytest.raises(KeyboardInterrupt):
        update_store(store, tiny, [demo(i) for i in range(4, 10)], progress=False)
    assert snapshot(store) == before  # the previous version, untouched
    monkeypatch.setattr(milo_infer.building.builder, "encode_blocks", real)
    summary = update_store(store, tiny, [demo(i) for i in range(4, 10)], progress=False)
    assert summary["blocks_encoded_now"] == 2  # of 3: one was staged before the interrupt
    assert contents(store) == contents(whole)


def test_a_model_that_did_not_build_the_store_is_refused(tiny, tiny_model_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    store = build(tiny, tmp_path / "s", [demo(i) for i in range(4)])
    before = snapshot(store)
    other = tmp_path / tiny_model_dir.name  # the same name and config, other weights
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_model_dir)).save_pretrained(other)
    tiny.tokenizer.save_pretrained(other)
    with pytest.raises(BuildError, match="K/V of the anchor differ from the store's"):
        update_store(store, load_model(other), [demo(5)], progress=False)
    deeper = tmp_path / "deeper"
    LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_model_dir, num_hidden_layers=3)).save_pretrained(deeper)
    tiny.tokenizer.save_pretrained(deeper)
    with pytest.raises(IncompatibleStoreError, match="built for another model"):
        update_store(store, load_model(deeper), [demo(5)], progress=False)
    assert snapshot(store) == before and not (tmp_path / "s.staging").exists()


def test_bad_rows_and_ids_are_named_before_the_model_loads_and_change_nothing(tiny, tmp_path, monkeypatch, capsys):
    store = build(tiny, tmp_path / "s", [demo(i) for i in range(4)])
    before = snapshot(store)
    rows = [dataclasses.asdict(demo(9)), {**dataclasses.asdict(demo(2))},  # d2 is in the store
            {"id": "x1", "input": "new", "output": "lost luggage"}, dataclasses.asdict(demo(10))]  # not a label
    corpus = tmp_path / "add.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(milo_infer.cli, "load_model", no_model)
    cases = [(["--add", str(corpus)], [f"{corpus}: 2 demonstration(s) cannot be added, nothing was changed",
                                       "row 2 (id 'd2'): this id is in the store already",
                                       "row 3 (id 'x1'): output 'lost luggage' is not one of the store's labels"]),
             (["--add", str(corpus), "--remove", "d2"], ["1 demonstration(s) cannot be added", "row 3 (id 'x1')"]),
             (["--remove", "d1,nope", "--remove", "d9"], ["no demonstration with id 'nope', 'd9' to remove"]),
             (["--remove", "d0,d1,d2,d3"], ["the update removes every demonstration"]),
             ([], ["nothing to update"]),
             (["--add", str(tmp_path / "absent.jsonl")], ["absent.jsonl: no such corpus file"]),
             (["--encode-batch", "0", "--remove", "d1"], ["--encode-batch must be at least 1"])]
    for extra, messages in cases:
        assert main(["update", str(store), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("milo update: "), err
        assert all(m in err for m in messages), (err, messages)
    assert main(["update", str(tmp_path / "nowhere"), "--remove", "d1"]) == 2
    assert "no such store directory" in capsys.readouterr().err and not (tmp_path / "nowhere.lock").exists()
    assert snapshot(store) == before and not (tmp_path / "s.staging").exists()


def test_a_second_update_while_one_runs_is_refused_and_the_first_commits(tiny, tmp_path, monkeypatch):
    store = build(tiny, tmp_path / "s", [demo(i) for i in range(4)])
    encoding, go_on = threading.Event(), threading.Event()
    real = milo_infer.building.builder.encode_blocks

    def held(*a, **k):
        encoding.set()
        go_on.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(milo_infer.building.builder, "encode_blocks", held)
    first = {}
    thread = threading.Thread(target=lambda: first.update(update_store(store, tiny, [demo(5)], progress=False)))
    thread.start()
    assert encoding.wait(60)  # the first update holds the lock and runs the model
    listing = snapshot(tmp_path)
    with pytest.raises(StoreLockedError, match="another writer"):
        update_store(store, tiny, remove=["d0"], progress=False)
    assert snapshot(tmp_path) == listing  # the second one wrote nothing, touched nothing
    go_on.set()
    thread.join()
    assert first["added"] == 1 and len(blocks(store)) == 3
    with MiloStore.open(store) as s:
        assert "d0" in s.examples()["id"] and "d5" in s.examples()["id"]


@pytest.mark.slow
def test_the_default_model_appends_as_a_rebuild(tmp_path, default_model):
    """The real model: appending to a corpus-order identity store equals rebuilding it, answers included."""
    from milo_infer.tasks.corpus import DEMO_CORPUS, DEMO_QUERIES, load_corpus

    demos = load_corpus(DEMO_CORPUS)[:12]
    task = task_from_corpus(demos)
    base = BuildConfig(block_size=4, context_blocks=1, order="corpus", compression=IDENTITY)
    build_store(tmp_path / "s", default_model, demos[:6], task, base, progress=False)
    summary = update_store(tmp_path / "s", default_model, demos[6:], progress=False)
    assert (summary["blocks_kept"], summary["blocks_encoded_now"]) == (1, 2)
    build_store(tmp_path / "r", default_model, demos, task, base, progress=False)
    assert contents(tmp_path / "s") == contents(tmp_path / "r")
    queries = [json.loads(line)["input"] for line in DEMO_QUERIES.read_text().splitlines()[:4]]
    answers = []
    for path in (tmp_path / "s", tmp_path / "r"):
        with MiloStore.open(path) as store:
            answers.append([a.text for a in MiloSession(default_model, store, EngineSettings(k=2)).answer_batch(queries)])
    assert answers[0] == answers[1]


def test_a_format_3_store_answers_as_before_and_its_first_update_migrates_it(tiny, tiny_model_dir, tmp_path, capsys):
    """A store written before format 4 mounts and answers as the same store in format 4 does; `milo update`
    on it says it migrates, and the new version (format 4) is the one an update of the format-4 store writes."""
    store = build(tiny, tmp_path / "s", [demo(i) for i in range(6)])
    old = format3_copy(store, tmp_path / "v3")
    with MiloStore.open(old) as s:
        assert s.format_version == 3 and not s.segmented
    assert_same_answers(logits(tiny, old), logits(tiny, store))
    corpus = tmp_path / "more.jsonl"
    corpus.write_text("".join(json.dumps(dataclasses.asdict(demo(i))) + "\n" for i in range(6, 8)))
    assert main(["update", str(old), "--add", str(corpus), "--remove", "d1", "--model", str(tiny_model_dir)]) == 0
    assert f"migrated {old}: format 3 to 4, once" in capsys.readouterr().out
    summary = update_store(store, tiny, [demo(i) for i in range(6, 8)], remove=["d1"], progress=False)
    assert "migrated_from" not in summary
    with MiloStore.open(old) as s:
        assert s.format_version == 4 and s.segmented
    assert contents(old) == contents(store)
    assert_same_answers(logits(tiny, old), logits(tiny, store))
