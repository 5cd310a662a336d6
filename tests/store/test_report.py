"""`milo_store.report.block_demonstrations`: a few blocks' demonstrations, read through checked arrays."""
import pytest

from milo_store import Layout, MiloStore, StoreCorruptedError
from milo_store.report import block_demonstrations
from milo_store.synthetic import build_synthetic_store, flipped_copy


def test_block_demonstrations_are_those_of_the_blocks_in_store_order(tmp_path):
    texts = [f"demonstration {i}" for i in range(10)]
    blocks = [2, 0, 1, 2, 0, 2, 1, 0, 2, 1]  # not in block order: rows are found by their block column
    path = build_synthetic_store(tmp_path / "s", Layout(1, 1, 8), [6, 6, 6, 6], texts=texts, example_block=blocks)
    with MiloStore.open(path, tier="disk") as store:
        found = block_demonstrations(store, [2, 0, 2, 3])
        examples = store.examples()
    expected = {b: [(t, o) for t, o, blk in zip(examples["input"], examples["output"], examples["block"]) if blk == b]
                for b in (0, 2, 3)}
    assert found == expected
    assert [t for t, _ in found[2]] == ["demonstration 0", "demonstration 3", "demonstration 5", "demonstration 8"]
    assert found[3] == []  # a block without demonstrations


def test_shown_demonstrations_are_checked_and_ids_are_not_read(tmp_path, monkeypatch):
    path = build_synthetic_store(tmp_path / "s", Layout(1, 1, 8), [6, 6], texts=["a x", "b y", "c z"],
                                 example_block=[0, 1, 0])
    with MiloStore.open(path, tier="disk") as store:
        monkeypatch.setattr(MiloStore, "examples", lambda self: (_ for _ in ()).throw(AssertionError("read all")))
        read = []
        original = MiloStore.example_array
        monkeypatch.setattr(MiloStore, "example_array", lambda self, name: read.append(name) or original(self, name))
        assert block_demonstrations(store, [1]) == {1: [("b y", "x")]}
    assert sorted(read) == ["block", "input", "output"]
    damaged = flipped_copy(path, "segment-0/input_bytes", tmp_path / "damaged")
    with MiloStore.open(damaged, tier="disk") as store, pytest.raises(StoreCorruptedError, match="input_bytes"):
        block_demonstrations(store, [1])
