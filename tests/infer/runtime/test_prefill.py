"""The true-prefill baseline: the same retrieval as a store's, the model prefilling the stored token ids.

Through the batched engine (rows of different lengths packed into one forward, explicit positions) a
prefill row must have the logits of a plain forward over its [anchor][blocks][query] ids (fp32, random
tiny Qwen2 and Llama models); tests/infer/runtime/test_session.py holds it to `full` with the default model.
"""
import pytest
import torch

from milo_infer.bench import synthetic_model
from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig
from milo_infer.tasks.corpus import load_corpus, task_from_corpus
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.planning import EngineSettings, Request
from milo_store import CompressionConfig, MiloStore

from tests.infer.runtime.test_engine import ATOL, random_llama, random_qwen2

DEMO = "milo_infer/tasks/data/demo_corpus.jsonl"
QUERIES = [Request("my card is gone", k=1, prefill=True),
           Request("please change the colour of the sweater I ordered, it never arrived", k=3, prefill=True),
           Request("refund", k=2, prefill=True)]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def setup(request, tmp_path_factory):
    loaded = random_qwen2() if request.param == "qwen2" else random_llama()
    demos = load_corpus(DEMO)[:24]
    config = BuildConfig(block_size=4, context_blocks=1, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    path = tmp_path_factory.mktemp(request.param) / "full"
    build_store(path, loaded, demos, task_from_corpus(load_corpus(DEMO)), config, progress=False)
    with MiloStore.open(path) as store:
        yield loaded, store


def test_a_prefill_plan_feeds_the_stored_ids_of_the_same_retrieval(setup):
    loaded, store = setup
    engine = Engine(loaded, {"s": store})
    for request in QUERIES:
        prefill = engine.plan("s", request)
        rebuilt = engine.plan("s", Request(request.text, k=request.k))
        assert prefill.groups == rebuilt.groups and rebuilt.blocks
        assert prefill.blocks == [] and prefill.prefix_tokens == 0 and prefill.placement.kv_bytes_stored == 0
        expected = (store.meta["build"]["anchor_token_ids"]
                    + [int(t) for b in rebuilt.blocks for t in store.token_ids(b)] + rebuilt.query_ids)
        assert prefill.query_ids == expected
        assert prefill.prompt_tokens == rebuilt.prompt_tokens


def test_prefill_rows_of_a_batch_equal_plain_forwards(setup):
    loaded, store = setup
    engine = Engine(loaded, {"s": store})
    plans = [engine.plan("s", r) for r in QUERIES]
    assert len({len(p.query_ids) for p in plans}) == len(plans)  # rows of different lengths
    for p, got in zip(plans, engine.logits(plans)):
        with torch.inference_mode():
            plain = loaded.model(input_ids=torch.tensor([p.query_ids])).logits[0].float()
        assert got.shape == plain.shape
        assert (got - plain).abs().max() <= ATOL


def test_prefill_answers_report_the_tokens_prefilled_and_time_to_first_token(setup):
    loaded, store = setup
    engine = Engine(loaded, {"s": store})
    plans = [engine.plan("s", r) for r in QUERIES]
    for p, answer in zip(plans, engine.answer(plans)):
        assert answer.prefill_tokens == len(p.query_ids) and answer.groups == p.groups
        assert answer.first_token_seconds > 0 and answer.kv_bytes_moved == 0
    stored = engine.answer([engine.plan("s", Request("refund", k=2))])[0]
    assert stored.prefill_tokens == len(engine.stores["s"].queries.query_ids(Request("refund")))


def test_a_store_without_token_ids_cannot_be_prefilled(tmp_path):
    loaded = random_qwen2()
    paths = synthetic_model.synthetic_stores(tmp_path, loaded, demos=16, block_size=8, demo_tokens=5, ratios=(0.5,),
                                             token_ids=False)
    with MiloStore.open(paths["full"]) as store:
        engine = Engine(loaded, {"s": store})
        with pytest.raises(RequestError, match="keeps no token ids"):
            engine.plan("s", Request("topic1", k=1, prefill=True))
