import json
import shutil

from milo_store import MiloStore, StoreCorruptedError
from milo_store.cli.main import main
from milo_store.synthetic import block_location, flipped_copy, store_arrays


def test_stat_json_reports_planned_and_actual_ratio(small_store, capsys):
    assert main(["stat", str(small_store), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["planned_ratio"] == 0.5
    assert abs(info["actual_ratio"] - 0.5) <= 0.01
    assert info["blocks"] == 4 and info["tokens"] == 23 + 40 + 9 + 31
    assert len(info["rank_histogram_per_layer"]["key"]) == 3


def test_human_output_and_ls(small_store, capsys):
    assert main(["stat", str(small_store)]) == 0
    out = capsys.readouterr().out
    assert "planned 0.5000" in out and "4 blocks" in out
    assert main(["ls", str(small_store), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in rows] == [23, 40, 9, 31]


def test_verify_exit_codes_name_the_block(small_store, capsys):
    assert main(["verify", str(small_store)]) == 0
    assert "OK" in capsys.readouterr().out
    chunk, at = block_location(small_store, 3)
    raw = bytearray(chunk.read_bytes())
    raw[at + 3] ^= 1
    chunk.write_bytes(bytes(raw))
    assert main(["verify", str(small_store), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and "block 3" in report["problems"][0]


def test_not_a_store_is_a_clear_error(tmp_path, capsys):
    assert main(["stat", str(tmp_path)]) == 2
    assert "not a milo store" in capsys.readouterr().err


def test_ls_pages_and_counts_demonstrations_with_or_without_the_index(small_store, capsys):

    assert main(["ls", str(small_store), "--offset", "1", "--limit", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["block"], r["tokens"], r["demonstrations"]) for r in rows] == [(1, 40, 1), (2, 9, 1)]
    assert main(["ls", str(small_store), "--limit", "3"]) == 0
    assert "blocks 0..2 of 4 listed" in capsys.readouterr().out
    shutil.rmtree(small_store / "indexes")  # a store written before the index: counted from the demonstrations
    assert main(["ls", str(small_store), "--offset", "1", "--limit", "2", "--json"]) == 0
    assert [r["demonstrations"] for r in json.loads(capsys.readouterr().out)] == [1, 1]
    assert main(["ls", str(small_store), "--limit", "-1"]) == 2
    assert "must not be negative" in capsys.readouterr().err


def _names(problem: str, array: str) -> bool:
    """Whether a problem line names this array (an index's arrays are named within their index)."""
    parts = array.split("/")
    if array == "factors" or parts[0] == "chunks":
        return "(corrupted factor bytes)" in problem
    if parts[0].startswith("segment-"):
        return f"text segment {parts[0].removeprefix('segment-')} " in problem and f"{parts[1]} fails" in problem
    return f"index {parts[1]}: {parts[2]} " in problem if parts[0] == "indexes" else f"array {array} " in problem


def _every_read_fails(path) -> bool:
    """Whether mounting the store, or reading anything a query reads from it, is refused as corruption."""
    try:
        with MiloStore.open(path, tier="disk") as store:
            reads = [lambda: store.blocks(list(range(store.num_blocks))), store.anchor_kv, store.examples,
                     lambda: [store.index_arrays(n) for n in store.index_names()], store.segmented_index,
                     lambda: [store.token_ids(i) for i in range(store.num_blocks)]]
            for read in reads:
                try:
                    read()
                except StoreCorruptedError:
                    return True
    except StoreCorruptedError:
        return True
    return False


def test_a_flipped_byte_in_any_array_is_named_by_verify_and_refused_when_read(small_store, tmp_path, capsys):
    arrays = store_arrays(small_store)
    assert {"ranks", "block_tokens", "checksums", "anchor_kv", "chunk_ids", "chunk_sizes", "extents", "segments",
            "segment-0/input_bytes", "segment-0/output_starts", "segment-0/id_bytes", "segment-0/block_starts",
            "segment-0/posting_tf", "indexes/bm25/terms", "indexes/bm25/idf"} <= set(arrays)
    assert any(a.startswith("chunks/") for a in arrays)
    for array in arrays:
        damaged = flipped_copy(small_store, array, tmp_path / array.replace("/", "-"))
        assert main(["verify", str(damaged), "--json"]) == 1, array
        problems = json.loads(capsys.readouterr().out)["problems"]
        assert any(_names(p, array) for p in problems), (array, problems)
        assert _every_read_fails(damaged), array
