"""A hybrid model's linear layers in the engine (`milo_infer.runtime.linear_rows`, issue 61): a block put back after
the anchor answers as prefill does; an unreadable block is computed for its rows alone. Tiny random Qwen3.5 and
Qwen3-Next (three Gated DeltaNet layers, one attention layer), fp32 identity stores encoded after the anchor alone.
Every test runs with the CPU's own staging and with its staged layers in buffers later layers' copies reuse, as
CUDA's are (`prefetch`, MILO_REUSE_STAGED), so that a row keeping a view of a staged layer goes red here (the costlier
ones split their cases between the two, or run reused alone)."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_infer.building.builder import BuildConfig, build_store
from milo_infer.evaluation.conformance import Deviation
from milo_infer.models import FAMILIES
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request
from milo_store import CompressionConfig, MiloStore, StoreCorruptedError

from tests.infer import families
from tests.infer.demo_stores import corrupted_block

QUERY = "my card was charged twice"


@pytest.fixture(autouse=True, params=["fresh", "reused"])
def staging(request, monkeypatch):
    """The CPU's staging as it is ("fresh": each layer a new tensor), or as CUDA's ("reused"); a test may ask for one
    (``indirect``)."""
    if request.param == "reused":
        monkeypatch.setenv("MILO_REUSE_STAGED", "1")
    return request.param


HYBRIDS = [family for family in families.TINY if FAMILIES[family].linear]  # the conformance suite's hybrids


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, tmp_path_factory):
    loaded = families.tiny_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    config = BuildConfig(block_size=2, context_blocks=0, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    build_store(root / "clean", loaded, families.demonstrations(8), families.TASK, config, progress=False)
    bad = corrupted_block(root / "clean", root / "bad", span=64)
    # each block encoded after the anchor and every block before it: placed in that order, exactly what prefill computes
    build_store(root / "exact", loaded, families.demonstrations(8), families.TASK,
                dataclasses.replace(config, context_blocks=8), progress=False)
    with (MiloStore.open(root / "clean", tier="disk") as clean, MiloStore.open(root / "bad", tier="disk") as damaged,
          MiloStore.open(root / "exact", tier="disk") as exact):
        yield request.param, loaded, clean, damaged, bad, exact


@pytest.mark.parametrize("staging", ["fresh"], indirect=True)  # one forward feeds its every token: nothing to alias
@torch.inference_mode()
def test_a_block_put_back_after_the_anchor_answers_as_prefill(hybrid, staging):
    """Encoded after the anchor alone, a block placed right after it is exactly what prefill computes there: its
    attention layers' K/V and its linear layers' state (the anchor's carried through its pair) and conv tail; every
    query token's logits within 1e-4."""
    family, loaded, clean, *_ = hybrid
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
    family, loaded, clean, damaged, bad, _ = hybrid
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


@pytest.mark.parametrize("staging", ["reused"], indirect=True)  # the fresh staging cannot alias: the reused is stronger
def test_a_row_fed_after_its_rebuilds_forward_starts_from_its_own_state(hybrid, staging):
    """Rows seated together, the later ones fed only in later forwards (a prefill chunk of 4 tokens): by then the
    rebuild's staged layers are gone (reused, as on CUDA); each row still answers as it does alone."""
    family, loaded, clean, *_ = hybrid
    chunked, alone = Engine(loaded, {"s": clean}, EngineSettings(prefill_chunk=4)), Engine(loaded, {"s": clean})
    orders = [[0, 1], [2, 3]]
    got = chunked.logits([chunked.plan("s", Request(QUERY), block_ids=o) for o in orders])
    for order, ours in zip(orders, got):
        theirs = alone.logits([alone.plan("s", Request(QUERY), block_ids=order)])[0]
        assert torch.isfinite(ours).all() and Deviation.of(ours, theirs).relative <= 1e-4, (family, order)


@pytest.mark.parametrize("unreadable, staging", [((1,), "fresh"), ((0, 2), "reused")], indirect=["staging"],
                         ids=["middle", "first-and-third"])
def test_unreadable_blocks_anywhere_are_composed_in_order(hybrid, unreadable, staging, monkeypatch):
    """Blocks placed as encoded (each after the anchor and the blocks before it), those in ``unreadable`` failing
    their reads: the pairs before each carry the state to its start, the model computes its tokens from there, the
    pairs after it carry what they leave; every query logit within 1e-4 of transformers' forward over all the tokens.
    A prefill chunk of 7 tokens puts some joins inside a forward's span and others past it, and a row beside it whose
    blocks all read (its span never cut) answers as alone."""
    family, loaded, *_, exact = hybrid
    read = exact.blocks

    def blocks(ids, *args, **kwargs):
        if failing := sorted(set(ids) & set(unreadable)):
            raise StoreCorruptedError(f"block {failing[0]}: checksum mismatch (the test's)")
        return read(ids, *args, **kwargs)

    monkeypatch.setattr(exact, "blocks", blocks)
    engine = Engine(loaded, {"s": exact}, EngineSettings(prefill_chunk=7), on_load_error="recompute")
    order = list(range(exact.num_blocks))
    plan = engine.plan("s", Request(QUERY), block_ids=order)
    anchor = [int(t) for t in exact.meta["build"]["anchor_token_ids"]]
    ids = anchor + [int(t) for b in order for t in exact.token_ids(b)] + plan.query_ids
    prefill = loaded.model(torch.tensor([ids])).logits[0, -len(plan.query_ids):].float()
    readable = [b for b in order if b not in unreadable]
    beside = engine.plan("s", Request("refund please"), block_ids=readable)
    with torch.inference_mode():
        got = engine.logits([plan, beside])
        alone = Engine(loaded, {"s": exact}).logits([beside])[0]
    ours = got[0][-len(plan.query_ids):]  # the unreadable blocks' tokens' logits first
    assert Deviation.of(ours, prefill).relative <= 1e-4, (family, unreadable)
    assert Deviation.of(got[1], alone).relative <= 1e-5, (family, unreadable)
