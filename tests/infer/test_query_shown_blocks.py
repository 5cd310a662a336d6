"""`milo query` on a store of the shipped demo corpus: demonstrations are read only when shown, and only
the retrieved blocks'; --threads sets torch's CPU threads."""
import json

import pytest
import torch

import milo_infer.cli.query
from tests.infer.demo_stores import encoded_demo_stores
from milo_infer.cli.main import main
from milo_store import CompressionConfig, MiloStore

QUERY = "I was charged twice for one purchase"


@pytest.fixture(scope="module")
def store(tmp_path_factory, default_model):
    yield from encoded_demo_stores(tmp_path_factory, default_model, {"s": CompressionConfig(ratio=0.5)})


@pytest.fixture
def spies(monkeypatch):
    """Calls of `block_demonstrations` (the blocks asked for) and of `MiloStore.examples`, and --threads."""
    calls = {"blocks": [], "examples": 0, "threads": []}
    shown = milo_infer.cli.query.block_demonstrations
    examples = MiloStore.examples

    def spy_blocks(store, blocks):
        calls["blocks"].append(sorted(set(blocks)))
        return shown(store, blocks)

    def spy_examples(self):
        calls["examples"] += 1
        return examples(self)

    monkeypatch.setattr(milo_infer.cli.query, "block_demonstrations", spy_blocks)
    monkeypatch.setattr(MiloStore, "examples", spy_examples)
    monkeypatch.setattr(torch, "set_num_threads", calls["threads"].append)
    return calls


def query(store, capsys, *flags):
    path = str(store[0]["s"].path)
    assert main(["query", path, QUERY, "--k", "1", "--threads", "1", *flags]) == 0
    return capsys.readouterr().out


def test_without_show_blocks_no_demonstration_is_read(store, capsys, spies):
    out = query(store, capsys)
    assert "->" in out and "block 0:" not in out and "block 1:" not in out
    assert spies == {"blocks": [], "examples": 0, "threads": [1]}


def test_show_blocks_lists_the_retrieved_blocks_demonstrations(store, capsys, spies):
    result = json.loads(query(store, capsys, "--json"))
    (block,) = result["blocks"]
    assert spies["blocks"] == [[block]] and spies["examples"] == 0
    examples = store[0]["s"].examples()
    expected = [f"{i} => {o}" for i, o, b in zip(examples["input"], examples["output"], examples["block"]) if b == block]
    assert expected and result["block_demonstrations"] == [{"block": block, "demonstrations": expected}]
    text = query(store, capsys, "--show-blocks")
    assert f"  block {block}:" in text and all(f"    {line}" in text for line in expected)


def test_threads_below_one_is_a_one_line_error(store, capsys):
    assert main(["query", str(store[0]["s"].path), QUERY, "--threads", "0"]) == 2
    assert "milo query: --threads must be at least 1; got 0" in capsys.readouterr().err
