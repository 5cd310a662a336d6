"""`milo build` with its defaults, then `milo query`, on every accepted family's tiny model (`tests/infer/families.py`):
what a new user's first command does. Only the corpus is small (four demonstrations in blocks of two); everything
else is the CLI's own defaults, so a default that some family's layout cannot take (MLA's keys-only latent, issue 71)
fails here naming the family."""
import json

import pytest
import torch

import milo_infer.cli
from milo_infer.cli.main import main

from .. import families

QUERY = "my card was charged twice"


@pytest.fixture
def threads_restored():
    """``--threads 1`` (the tiny models run fastest on one thread of a shared CPU) sets torch's count for the
    process: put it back for the tests after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", list(families.TINY))
def test_default_build_answers(family, tmp_path, monkeypatch, capsys, threads_restored):
    loaded = families.tiny_model(family)
    monkeypatch.setattr(milo_infer.cli, "load_model", lambda spec, **options: loaded)
    corpus = tmp_path / "demos.jsonl"
    corpus.write_text("".join(json.dumps({"input": d.input, "output": d.output}) + "\n"
                              for d in families.demonstrations(4)))
    store = tmp_path / "store"
    assert main(["build", "--model", family, "--corpus", str(corpus), "--block-size", "2", "--threads", "1",
                 "--out", str(store)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["query", str(store), QUERY, "--model", family, "--k", "2", "--json"]) == 0, capsys.readouterr().err
    answer = json.loads(capsys.readouterr().out)
    assert sorted(answer["blocks"]) == [0, 1]
    assert 0 < answer["kv_bytes_stored"] < answer["kv_bytes_full"]
