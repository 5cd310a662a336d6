"""The baselines through a real model: an example-svd store (one store block per demonstration)
gives a query the same demonstrations, in the same order, as the block store of the same build.

One encoding (8 demonstrations of the demo corpus, blocks of 4) serves every store of the module.
"""
import pytest
import torch
from tests.infer.demo_stores import encoded_demo_stores

from milo_infer.evaluation.methods import method_config
from milo_infer.runtime.session import MiloSession
from milo_infer.runtime.planning import EngineSettings
from milo_store import CompressionConfig

QUERY = "I lost my card yesterday, what should I do?"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stores(tmp_path_factory, default_model):
    yield from encoded_demo_stores(tmp_path_factory, default_model, {
        "full": method_config("full", 1.0),
        "example-fullrank": CompressionConfig(codec="example-svd", full_rank=True, ratio=1.0),
        "example-svd": method_config("example-svd", 0.5),
        "global-proj": method_config("global-proj", 0.5)})


def test_one_encoding_serves_every_baseline(stores):
    _, summaries = stores
    assert {name: s["blocks_encoded_now"] for name, s in summaries.items()} == {
        "full": 2, "example-fullrank": 0, "example-svd": 0, "global-proj": 0}


def test_groups_expand_to_the_same_demonstrations_in_the_same_order(stores, default_model):
    opened, _ = stores
    full, ex = opened["full"], opened["example-fullrank"]
    assert ex.num_blocks == 8 and ex.num_groups == full.num_blocks == 2
    a, b = MiloSession(default_model, full, settings=EngineSettings(k=2)), MiloSession(default_model, ex, settings=EngineSettings(k=2))
    groups = a.select(QUERY)
    assert b.select(QUERY) == groups and full.blocks_of(groups) == groups
    ids_full, ids_ex = full.examples(), ex.examples()
    demos_full = [i for g in groups for i, blk in zip(ids_full["id"], ids_full["block"]) if blk == g]
    assert [ids_ex["id"][blk] for blk in ex.blocks_of(groups)] == demos_full
    # the context's tokens: a group's store blocks hold its demonstrations' tokens, concatenated
    for g in groups:
        assert torch.equal(torch.from_numpy(full.token_ids(g)),
                           torch.cat([torch.from_numpy(ex.token_ids(blk)) for blk in ex.blocks_of([g])]))
    ref, ours = a.logits(QUERY), b.logits(QUERY)
    assert (ref - ours).abs().max() < 0.05 * ref.abs().max()  # fp16 factors: rounding only
    assert torch.equal(ref.argmax(-1), ours.argmax(-1))


def test_compressed_baselines_answer_within_their_measured_bytes(stores, default_model):
    opened, _ = stores
    for name in ("example-svd", "global-proj"):
        store = opened[name]
        acc = store.accounting()
        assert 0.4 < acc["ratio"] <= 0.5 + 1e-9, (name, acc)
        answer = MiloSession(default_model, store, settings=EngineSettings(k=1)).answer(QUERY)
        assert len(answer.groups) == 1 and answer.blocks == store.blocks_of(answer.groups)
        assert 0 < answer.kv_bytes_stored < answer.kv_bytes_full
