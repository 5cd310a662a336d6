"""tools/bench_scale.py at toy size (the varied corpus, one mount probe over a small store) and tools/agreement.py."""
import sys
from pathlib import Path

import numpy as np

from milo_infer.runtime.retrieval import store_retriever
from milo_store import CompressionConfig, Layout, MiloStore, report
from milo_store.synthetic import build_synthetic_store

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
from bench_scale import probe_mount, varied_corpus  # noqa: E402

BASE = ["how do I top up my card", "my transfer is still pending", "what rate do you use"]


def test_varied_corpus_keeps_the_base_then_varies_each_copy_deterministically():
    texts = varied_corpus(BASE, 10)
    assert len(texts) == 10 and texts[:3] == BASE
    assert texts == varied_corpus(BASE, 10)
    assert all(t not in BASE for t in texts[3:])
    vocabulary = {w for t in BASE for w in t.split()}
    assert all(set(t.split()) <= vocabulary for t in texts)


def test_probe_mount_measures_a_store(tmp_path, monkeypatch):
    """It times what it names: a mount without and with verification, `ls` and `stat`, the first query, and
    each query's retrieval (and the same on a format-3 index) and the lookup of the blocks that query retrieved."""
    texts = varied_corpus(BASE, 64)
    blocks = np.arange(64) // 32
    path = build_synthetic_store(tmp_path / "s", Layout(1, 1, 8), [16, 16], CompressionConfig(ratio=0.5),
                                 texts=texts, example_block=blocks.tolist())
    queries = ["top up", "pending transfer", "nothing"]
    with MiloStore.open(path, tier="disk") as store:
        retriever = store_retriever(store)
        expected_blocks = [b for q in queries for b in store.blocks_of(retriever.select(q, k=1))]
    calls = {"open": [], "block": [], "ls": [], "stat": 0}
    real_open, real_block = MiloStore.open.__func__, MiloStore.block
    real_rows, real_describe = report.block_rows, report.describe

    def open_(cls, *args, **kwargs):
        calls["open"].append(kwargs.get("verify"))
        return real_open(cls, *args, **kwargs)

    def block(self, i):
        calls["block"].append(i)
        return real_block(self, i)

    def rows(store, offset=0, limit=0):
        calls["ls"].append((offset, limit))
        return real_rows(store, offset, limit)

    def describe(store):
        calls["stat"] += 1
        return real_describe(store)

    monkeypatch.setattr(MiloStore, "open", classmethod(open_))
    monkeypatch.setattr(MiloStore, "block", block)
    monkeypatch.setattr(report, "block_rows", rows)
    monkeypatch.setattr(report, "describe", describe)
    out = probe_mount(str(path), queries, k=1)
    assert calls == {"open": [False, False, True, False, False], "block": expected_blocks, "ls": [(0, 20)], "stat": 1}
    assert set(out) == {"mount_s_verify_False", "mount_s_verify_True", "rss_mount_verify_False",
                        "rss_mount_verify_True", "cli_ls_s", "cli_stat_s", "first_query_s", "rss_after_first_query",
                        "retrieve_ms", "lookup_ms", "format3_retrieve_ms"}
    assert out["mount_s_verify_True"] > 0 and out["cli_ls_s"] > 0 and out["cli_stat_s"] > 0 and out["first_query_s"] > 0
    for name in ("retrieve_ms", "lookup_ms", "format3_retrieve_ms"):
        p50, p99 = out[name]
        assert 0 < p50 <= p99


def test_agreement_counts_only_items_both_answered(tmp_path):
    import json

    from agreement import compare, read

    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(dict(zip(("id", "prediction", "correct"), r))) + "\n" for r in rows))
        return str(path)

    full = read(write("f.jsonl", [("a", "x", True), ("b", "y", False), ("c", "z", True), ("d", "x", False)]))
    other = read(write("o.jsonl", [("b", "y", False), ("a", "w", False), ("c", "z", True)]))
    assert compare(full, other) == {"n": 3, "reference_accuracy": 2 / 3, "other_accuracy": 1 / 3, "agree": 2}
    assert compare(full, other, first=1) == {"n": 1, "reference_accuracy": 1.0, "other_accuracy": 0.0, "agree": 0}
