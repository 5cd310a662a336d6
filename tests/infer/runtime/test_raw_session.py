"""Raw units through a real model: a raw fp16 store answers with the full store's logits, and raw
INT8 and frontier stores (raw and factored units mixed) answer within their measured bytes.

One encoding (8 demonstrations of the demo corpus, blocks of 4) serves every store of the module.
"""
import pytest

from milo_infer.evaluation.methods import method_config
from milo_infer.runtime.session import MiloSession
from milo_infer.runtime.planning import EngineSettings
from milo_store.format import FORMAT_VERSION
from milo_store.layout import RAW_RANK

from tests.infer.demo_stores import encoded_demo_stores

QUERY = "I lost my card yesterday, what should I do?"
METHODS = ("full", "raw", "raw+int8", "milo+int8-frontier-qaw")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stores(tmp_path_factory, default_model):
    yield from encoded_demo_stores(tmp_path_factory, default_model, {m: method_config(m, 0.5) for m in METHODS})


def test_raw_stores_share_the_full_stores_encoding(stores):
    _, summaries = stores
    assert {m: s["blocks_encoded_now"] for m, s in summaries.items()} == {m: 2 if m == "full" else 0 for m in METHODS}


def test_raw_fp16_store_gives_the_full_stores_logits(stores, default_model):
    """Both hold X in fp16 (full as A = X, Σ = 1, B = I): the rebuilt caches, so the logits, agree."""
    opened, _ = stores
    raw, full = opened["raw"], opened["full"]
    assert (raw.ranks == RAW_RANK).all() and raw.meta["format_version"] == FORMAT_VERSION
    assert raw.accounting()["ratio"] < full.accounting()["ratio"]  # no B = I
    ref, ours = (MiloSession(default_model, s, settings=EngineSettings(k=2)).logits(QUERY) for s in (full, raw))
    assert (ref - ours).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("method", ["raw+int8", "milo+int8-frontier-qaw"])
def test_quantized_raw_stores_answer_within_their_measured_bytes(stores, default_model, method):
    opened, _ = stores
    store = opened[method]
    raw = store.ranks == RAW_RANK
    assert raw.all() if method == "raw+int8" else (raw.any() and not raw.all())
    acc = store.accounting()
    # raw INT8 is half the fp16 bytes plus each channel's scale and minimum (4d per ~60-token unit here)
    assert 0.5 < acc["ratio"] < 0.55 if method == "raw+int8" else acc["ratio"] <= 0.5
    answer = MiloSession(default_model, store, settings=EngineSettings(k=2)).answer(QUERY)
    stored = sum(int(store.offsets[b + 1] - store.offsets[b]) for b in answer.blocks) * store.itemsize
    assert answer.kv_bytes_stored == stored < answer.kv_bytes_full
    ref, ours = (MiloSession(default_model, s, settings=EngineSettings(k=2)).logits(QUERY) for s in (opened["full"], store))
    assert (ref - ours).abs().max() < 0.1 * ref.abs().max()  # quantization: close, not exact
