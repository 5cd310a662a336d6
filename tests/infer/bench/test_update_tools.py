"""tools/bench_update.py and tools/update_control.py at toy size (the tiny random Llama, a corpus of 24): every
change runs in a directory and at a URL, with its goals computed from what was measured, and the control
builds, updates and answers every store it compares."""
import sys
from pathlib import Path

from milo_store import format as fmt

from ..building.test_build import tiny_model_dir, tokenizer, write_corpus  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import bench_update  # noqa: E402
import update_control  # noqa: E402


def test_bench_update_measures_each_change_in_a_directory_and_at_a_url(tiny_model_dir, tmp_path, s3_url, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "milo"))
    monkeypatch.setattr(fmt, "MAX_CHUNK_BYTES", 1)  # a chunk per block, as blocks of real stores have
    corpus = write_corpus(tmp_path / "c.jsonl", 24)
    rows = bench_update.main(["--shots", "18", "--threads", "1", "--corpus", str(corpus), "--model", str(tiny_model_dir),
                              "--block-size", "2", "--context-blocks", "1", "--url", s3_url, "--work", str(tmp_path / "w")])
    assert [(r["change"], r["where"]) for r in rows] == [(c, w) for c in ("add1", "remove1-block", "remove1-spread")
                                                         for w in ("local", "url")]
    for r in rows:  # at this size the metadata and the anchor outweigh 5% of the store: the bytes goal is not held
        assert 0 < r["update_blocks"] < r["rebuild_blocks"]
        assert r["copied_bytes"] == 0 and 0 < r["encoded_bytes"] <= r["update_bytes"] < r["rebuild_bytes"], r
        goals = bench_update.goals(r)
        assert goals["size"][2] and goals["bytes"][1] == r["encoded_bytes"] + 0.05 * r["rebuild_bytes"], (r, goals)
        if r["where"] == "url":
            assert r["fetched_blocks"] == r["update_blocks"] and goals["fetched"][2]
    for local, url in zip(rows[::2], rows[1::2]):  # the URL's rebuild is the directory's, pushed
        assert url["rebuild_blocks"] == local["rebuild_blocks"] and url["rebuild_s"] > local["rebuild_s"]
        assert url["rebuild_bytes"] >= url["rebuild_disk_bytes"], url  # every byte the pushed rebuild holds was PUT
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == len(rows) + 2 and all(line.count("|") == 12 for line in table)
    gets = bench_update.gets_per_query(tmp_path / "w" / "base", k=2, queries=20)
    assert gets["format 4"] == 2 and 1 <= gets["format 3"] <= 2  # a chunk per block; format 3: one chunk in all
    assert "range GETs per query" in out


def test_update_control_answers_from_every_store_it_compares(tiny_model_dir, tmp_path):
    corpus, queries = write_corpus(tmp_path / "c.jsonl", 24), write_corpus(tmp_path / "q.jsonl", 3)
    argv = ["--corpus", str(corpus), "--queries", str(queries), "--model", str(tiny_model_dir), "--seeds", "2",
            "--shots", "12", "--test", "3", "--add", "0.1", "--remove", "0.1", "--k", "2", "--batch", "2",
            "--block-size", "2", "--context-blocks", "1", "--out", str(tmp_path / "out")]
    rows = update_control.main(argv)
    assert [(r["seed"], r["variant"]) for r in rows] == [(s, v) for s in (0, 1) for v in update_control.VARIANTS]
    for r in rows:
        assert r["n"] == 3 and r["added"] == 1 and r["removed"] == 1
        assert all(0 <= r[k] <= 1 for k in ("accuracy", "agreement_full", "agreement_prefill", "agreement_rebuilt"))
    assert all(r["agreement_rebuilt"] == 1 for r in rows if r["variant"] == "rebuilt")
    assert update_control.main(argv) == rows  # resumed: every store and prediction is reused
