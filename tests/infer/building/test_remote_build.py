"""`milo build --out s3://…`, then `milo query` and `milo-store verify` on the URL, as their local forms."""
import json
from pathlib import Path

import pytest

from milo_infer.cli.main import main as milo
from milo_infer.tasks.corpus import DEMO_CORPUS
from milo_infer.models import ModelUnavailable, default_gguf_path
from milo_store.cli.main import main as milo_store

CORPUS = DEMO_CORPUS
QUERY = "I still have not received my new card"


@pytest.mark.slow
def test_build_query_verify_on_an_s3_url(tmp_path, s3_url, capsys):
    try:
        default_gguf_path()
    except ModelUnavailable as exc:
        pytest.skip(f"default model unavailable: {exc}")
    build = ["build", "--corpus", str(CORPUS), "--shots", "8", "--block-size", "4", "--context-blocks", "1"]
    local = str(tmp_path / "local")
    assert milo(build + ["--out", local]) == 0
    assert milo(build + ["--out", s3_url]) == 0
    capsys.readouterr()
    answers = []
    for store in (local, s3_url):
        assert milo(["query", store, QUERY, "--k", "2", "--tier", "disk", "--json",
                     "--cache-dir", str(tmp_path / "cache")]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0]["answer"] == answers[1]["answer"] and answers[0]["blocks"] == answers[1]["blocks"]
    assert answers[0]["kv_bytes_stored"] == answers[1]["kv_bytes_stored"]
    assert "remote" in answers[1]["seconds"] and "remote" not in answers[0]["seconds"]
    assert milo_store(["verify", s3_url]) == 0
    assert milo(build + ["--out", s3_url]) == 2  # a store is there: --force replaces it
    assert "already holds a store" in capsys.readouterr().err
