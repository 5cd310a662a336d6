"""The demo's comparison: each answer beside the full cache's for the same query, agreement and bytes first,
expected labels second."""
import pytest

from tests.infer.demo_stores import encoded_demo_stores
from milo_infer.building.config import default_compression
from milo_infer.tasks.corpus import load_corpus
from milo_infer.evaluation.demo import Comparison, compare, render
from milo_infer.tasks.corpus import DEMO_QUERIES
from milo_infer.evaluation.methods import method_config
from milo_infer.runtime.session import MiloSession
from milo_infer.runtime.planning import EngineSettings

MIB = 2**20


def test_render_puts_agreement_and_bytes_before_the_expected_labels():
    rows = [Comparison("my card was stolen", "lost card", "lost card", "lost card", MIB, 4 * MIB),
            Comparison("where is my refund", "refund request", "refund request", "card arrival", 2 * MIB, 4 * MIB)]
    lines = render(rows).splitlines()
    assert [r.agrees for r in rows] == [True, False]
    row = next(line for line in lines if line.startswith("where is my refund"))
    assert "'refund request'" in row and "'card arrival'" in row and " NO " in row and "2.00 ( 4.00)" in row
    summary = lines.index(next(line for line in lines if line.startswith("agreement with the full cache")))
    assert lines[summary] == ("agreement with the full cache: 1/2 answers the same, reading 1.50 MiB of K/V per query "
                              "where the full cache holds 4.00 MiB of fp16 K/V (0.38x)")
    assert lines[summary + 1] == "expected labels (secondary): 2/2 from the store, 1/2 from the full cache"


@pytest.fixture(scope="module")
def stores(tmp_path_factory, default_model):
    yield from encoded_demo_stores(tmp_path_factory, default_model, {
        "milo": default_compression(0.5), "full": method_config("full", 1.0)})


def test_compare_answers_each_query_from_the_store_and_from_the_full_cache(stores, default_model):
    opened, _ = stores
    queries = load_corpus(DEMO_QUERIES)[:2]
    sessions = {name: MiloSession(default_model, opened[name], settings=EngineSettings(k=1)) for name in ("milo", "full")}
    rows = compare(sessions["milo"], sessions["full"], queries)
    for row, q in zip(rows, queries):
        alone = {name: s.answer(q.input) for name, s in sessions.items()}
        assert (row.query, row.expected) == (q.input, q.output)
        assert (row.answer, row.full_answer) == (alone["milo"].text, alone["full"].text)
        assert (row.kv_bytes, row.full_kv_bytes) == (alone["milo"].kv_bytes_stored, alone["full"].kv_bytes_full)
        assert row.kv_bytes < 0.6 * row.full_kv_bytes
