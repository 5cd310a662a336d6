"""`milo_store.report.block_demonstrations`: a few blocks' demonstrations, read without the others' text."""
import numpy as np

from milo_store import Layout, MiloStore
from milo_store.report import block_demonstrations
from milo_store.synthetic import build_synthetic_store


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


def test_only_the_blocks_rows_are_read(tmp_path, monkeypatch):
    path = build_synthetic_store(tmp_path / "s", Layout(1, 1, 8), [6, 6], texts=["a x", "b y", "c z"],
                                 example_block=[0, 1, 0])
    with MiloStore.open(path, tier="disk") as store:
        monkeypatch.setattr(MiloStore, "examples", lambda self: (_ for _ in ()).throw(AssertionError("read all")))
        rows = []
        array = type(store.group["examples/input"])
        original = array.get_orthogonal_selection
        monkeypatch.setattr(array, "get_orthogonal_selection",
                            lambda self, selection, **kw: rows.append(np.asarray(selection).tolist())
                            or original(self, selection, **kw))
        assert block_demonstrations(store, [1]) == {1: [("b y", "x")]}
    assert rows == [[1], [1]]  # input and output, row 1 alone
