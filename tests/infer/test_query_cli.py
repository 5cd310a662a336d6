"""`milo query` on damaged stores and bad input: a one-line error and a non-zero exit, never an answer
from corrupted bytes. The model is loaded once (the CLI's own load is replaced by the session's)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import milo_infer.cli
from milo_infer.cli.main import main as milo
from milo_store import CompressionConfig
from milo_store.synthetic import flipped_copy, store_arrays

from tests.infer.demo_stores import encoded_demo_stores

QUERY = "I still have not received my new card"
ROOT = Path(__file__).resolve().parents[2]
# kept for rebuilding blocks and for evaluation, a query never reads them: each text segment's token ids and ids
NOT_READ_BY_A_QUERY = ("/token_ids", "/id_bytes", "/id_starts")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory, default_model):
    for opened, _ in encoded_demo_stores(tmp_path_factory, default_model, {"svd": CompressionConfig(ratio=0.5)}):
        yield opened["svd"].path


@pytest.fixture
def query(default_model, monkeypatch, capsys):
    """Run `milo query` on the shared model: (exit code, stdout, stderr)."""
    monkeypatch.setattr(milo_infer.cli, "load_model", lambda name: default_model)

    def run(*argv):
        code = milo(["query", *map(str, argv), "--k", "2", "--tier", "disk"])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def test_no_query_answers_from_a_store_with_a_flipped_byte_in_any_array(store, query, tmp_path):
    code, clean, _ = query(store, QUERY, "--json")
    assert code == 0
    arrays = store_arrays(store)
    assert "segment-0/token_ids" in arrays and "anchor_kv" in arrays and "segment-0/input_bytes" in arrays
    for array in arrays:
        damaged = flipped_copy(store, array, tmp_path / array.replace("/", "-"))
        code, out, err = query(damaged, QUERY, "--json")
        if array.endswith(NOT_READ_BY_A_QUERY):
            assert code == 0 and json.loads(out)["answer"] == json.loads(clean)["answer"], array
        else:
            assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (array, err)
            assert array.split("/")[-1] in err or "factor bytes" in err, (array, err)


def test_show_blocks_into_a_closed_pipe_ends_quietly(store):
    """`milo query … --show-blocks | head -1`: no BrokenPipeError once the reader has gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "milo_infer.cli.main", "query", str(store), QUERY, "--k", "2",
                               "--show-blocks"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    finally:
        os.close(write)
    assert done.returncode == 141 and "Error" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("text", ["", "zyxw qqvv"])
def test_a_query_retrieval_cannot_match_is_answered_with_a_warning(store, query, text):
    code, out, err = query(store, text, "--json")
    assert code == 0 and json.loads(out)["retrieval_matched"] is False
    assert "retrieval matched nothing, the blocks are arbitrary" in err
    code, out, err = query(store, QUERY, "--json")
    assert code == 0 and json.loads(out)["retrieval_matched"] is True and "matched nothing" not in err
    result = json.loads(out)  # one row: it holds its own copy of its blocks, nothing held once; its factors staged
    batch, blocks = result["batch"], result["blocks"]
    assert batch["rows"] == 1 and batch["held_blocks"] == 0 and batch["placed_blocks"] == len(blocks) > 0
    assert batch["kv_bytes_held"] > 0 and 0 < batch["factor_bytes_staged"] <= result["kv_bytes_stored"]


def test_a_query_longer_than_the_model_is_told_so_not_to_lower_k(store, query):
    code, out, err = query(store, "card " * 9000)
    assert code == 2 and err.count("\n") == 1 and "the query itself is too long" in err and "lower k" not in err, err
