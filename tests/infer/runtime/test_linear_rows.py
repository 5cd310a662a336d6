"""A hybrid model's linear layers in the engine (`milo_infer.runtime.linear_rows`, issue 61): a block put back after
the anchor answers as prefill does; an unreadable block is computed for its rows alone. Tiny random Qwen3.5 and
Qwen3-Next (three Gated DeltaNet layers, one attention layer), fp32 identity stores encoded after the anchor alone.
Every test runs twice: with the CPU's own staging, and with its staged layers in buffers later layers' copies reuse,
as CUDA's are (`prefetch`, MILO_REUSE_STAGED), so that a row keeping a view of a staged layer goes red here."""
import pytest
import torch

from milo_infer.building.builder import BuildConfig, build_store
from milo_infer.evaluation.conformance import Deviation
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request
from milo_store import CompressionConfig, MiloStore

from tests.infer import families
from tests.infer.demo_stores import corrupted_block

QUERY = "my card was charged twice"


@pytest.fixture(autouse=True, params=["fresh", "reused"])
def staging(request, monkeypatch):
    """The CPU's staging as it is ("fresh": each layer a new tensor), or as CUDA's ("reused")."""
    if request.param == "reused":
        monkeypatch.setenv("MILO_REUSE_STAGED", "1")
    return request.param


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid", "nemotron_h", "lfm2"])
def hybrid(request, tmp_path_factory):
    loaded = families.tiny_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    config = BuildConfig(block_size=2, context_blocks=0, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    build_store(root / "clean", loaded, families.demonstrations(8), families.TASK, config, progress=False)
    bad = corrupted_block(root / "clean", root / "bad", span=64)
    with MiloStore.open(root / "clean", tier="disk") as clean, MiloStore.open(root / "bad", tier="disk") as damaged:
        yield request.param, loaded, clean, damaged, bad


@torch.inference_mode()
def test_a_block_put_back_after_the_anchor_answers_as_prefill(hybrid):
    """Encoded after the anchor alone, a block placed right after it is exactly what prefill computes there: its
    attention layers' K/V and its linear layers' state (the anchor's carried through its pair) and conv tail; every
    query token's logits within 1e-4."""
    family, loaded, clean, _, _ = hybrid
    engine = Engine(loaded, {"s": clean})
    anchor = [int(t) for t in clean.meta["build"]["anchor_token_ids"]]
    for block in range(clean.num_blocks):
        plan = engine.plan("s", Request(QUERY), block_ids=[block])
        ids = anchor + clean.token_ids(block).tolist() + plan.query_ids
        prefill = loaded.model(torch.tensor([ids])).logits[0, -len(plan.query_ids):].float()
        assert Deviation.of(engine.logits([plan])[0], prefill).relative <= 1e-4, (family, block)


def test_an_unreadable_block_is_computed_for_its_row_alone(hybrid):
    """A row placing a damaged block gets its state from the blocks it read, then the damaged block's tokens computed
    by the model from there (as the same row without that block, its tokens fed); a row beside it is unaffected."""
    family, loaded, clean, damaged, bad = hybrid
    engine, reference = Engine(loaded, {"s": damaged}, on_load_error="recompute"), Engine(loaded, {"s": clean})
    others = [b for b in range(clean.num_blocks) if b != bad]
    plans = [engine.plan("s", Request(QUERY), block_ids=[others[0], bad]),
             engine.plan("s", Request("refund please"), block_ids=others[1:3])]
    got = engine.logits(plans)
    expected = [reference.stores["s"].without_blocks(reference.plan("s", Request(QUERY), block_ids=[others[0], bad]),
                                                     {bad}),
                reference.plan("s", Request("refund please"), block_ids=others[1:3])]
    assert bad not in expected[0].blocks and len(expected[0].recompute) == int(clean.block_tokens[bad])
    want = reference.logits(expected)
    assert torch.isfinite(got[0]).all()
    for ours, theirs in zip(got, want):
        assert Deviation.of(ours, theirs).relative <= 1e-5, family


def test_a_row_fed_after_its_rebuilds_forward_starts_from_its_own_state(hybrid):
    """Rows seated together, the later ones fed only in later forwards (a prefill chunk of 4 tokens): by then the
    rebuild's staged layers are gone (reused, as on CUDA); each row still answers as it does alone."""
    family, loaded, clean, _, _ = hybrid
    chunked, alone = Engine(loaded, {"s": clean}, EngineSettings(prefill_chunk=4)), Engine(loaded, {"s": clean})
    orders = [[0, 1], [2, 3], [1, 2]]
    got = chunked.logits([chunked.plan("s", Request(QUERY), block_ids=o) for o in orders])
    for order, ours in zip(orders, got):
        theirs = alone.logits([alone.plan("s", Request(QUERY), block_ids=order)])[0]
        assert torch.isfinite(ours).all() and Deviation.of(ours, theirs).relative <= 1e-4, (family, order)
