"""A fault ends only the rows it touches: an unreadable block (computed from its token ids, or failing the rows
that need it), a decoder that raises, an admission the device has no memory for. Random tiny Qwen2, fp32."""
import logging

import pytest
import torch

from milo_infer.building.builder import BuildConfig, build_store
from milo_infer.runtime.engine import Batch, Engine
from milo_infer.runtime.errors import AdmissionOutOfMemory, BlockLoadError, RowFailed
from milo_infer.runtime.planning import Request
from milo_infer.tasks.corpus import load_corpus, task_from_corpus
from milo_store import CompressionConfig, MiloStore

from tests.infer.demo_stores import DEMO, corrupted_block
from tests.infer.runtime.test_engine import ATOL, random_qwen2
from tests.infer.runtime.test_shared_blocks import hold_every_shared_block


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A clean identity store and a copy with one block's bytes damaged, both read from disk (checked)."""
    loaded = random_qwen2()
    demos = load_corpus(DEMO)[:24]
    config = BuildConfig(block_size=4, context_blocks=1, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    root = tmp_path_factory.mktemp("faults")
    build_store(root / "clean", loaded, demos, task_from_corpus(load_corpus(DEMO)), config, progress=False)
    bad = corrupted_block(root / "clean", root / "bad", span=64)
    with MiloStore.open(root / "clean", tier="disk") as clean, MiloStore.open(root / "bad", tier="disk") as damaged:
        yield loaded, clean, damaged, bad


def plans_for(engine: Engine, bad: int):
    """A row that needs the damaged block, in another context than it was encoded in (so computing it in
    context differs from its stored K/V), and a row that does not need it."""
    needs = engine.plan("s", Request("my card is gone"), block_ids=[bad] if bad > 0 else [3, bad])
    other = [b for b in range(engine.stores["s"].store.num_blocks) if b not in needs.blocks][:2]
    return needs, engine.plan("s", Request("refund please"), block_ids=other)


def test_an_unreadable_block_is_computed_by_the_model_and_the_other_rows_load(stores):
    loaded, clean, damaged, bad = stores
    engine, reference = Engine(loaded, {"s": damaged}, on_load_error="recompute"), Engine(loaded, {"s": clean})
    needs, other = plans_for(engine, bad)
    assert bad in needs.blocks and bad not in other.blocks
    got = engine.logits([needs, other])
    ref_needs, ref_other = plans_for(reference, bad)
    recomputed = reference.stores["s"].without_blocks(ref_needs, {bad})
    assert bad not in recomputed.blocks and len(recomputed.recompute) == int(clean.block_tokens[bad])
    want = reference.logits([recomputed, ref_other])
    loaded_as_stored = reference.logits([ref_needs])[0]
    assert torch.isfinite(got[0]).all()  # the NaN bytes were never read into the cache
    assert (got[0] - want[0]).abs().max() <= ATOL and (got[1] - want[1]).abs().max() <= ATOL
    q = len(needs.query_ids)
    assert (got[0][-q:] - loaded_as_stored[-q:]).abs().max() > 10 * ATOL  # computed in context, not as stored


def test_recompute_reaches_the_answer_and_is_logged_once_per_block(stores, caplog):
    loaded, _, damaged, bad = stores
    engine = Engine(loaded, {"s": damaged}, on_load_error="recompute")
    with caplog.at_level(logging.ERROR, logger="milo.engine"):
        for _ in range(2):
            needs, other = plans_for(engine, bad)
            stats = {}
            answers = engine.answer([needs, other], stats)
            assert answers[0].recomputed_blocks == [bad] and answers[1].recomputed_blocks == []
            assert answers[0].prefill_tokens == len(needs.query_ids) + int(damaged.block_tokens[bad])
            assert stats["unreadable_blocks"] == 1
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert f"block {bad} cannot be read" in caplog.records[0].getMessage() and len(caplog.records) == 1


def test_under_fail_only_the_rows_needing_the_block_fail(stores):
    loaded, clean, damaged, bad = stores
    engine = Engine(loaded, {"s": damaged})  # the default: fail
    needs, other = plans_for(engine, bad)
    batch = engine.batch()
    events = batch.admit([needs, other])
    failed = [e for e in events if e.error is not None]
    assert [e.plan for e in failed] == [needs] and isinstance(failed[0].error, BlockLoadError)
    assert f"store 's': block {bad} cannot be read" in str(failed[0].error)
    text = run_to_end(batch, events)
    alone = Engine(loaded, {"s": clean}).answer([plans_for(Engine(loaded, {"s": clean}), bad)[1]])[0]
    assert text[id(other)].strip() == alone.text
    with pytest.raises(BlockLoadError):
        engine.answer([needs])
    with pytest.raises(ValueError, match="on_load_error must be one of recompute, fail"):
        Engine(loaded, {"s": damaged}, on_load_error="ignore")


def run_to_end(batch: Batch, events) -> dict:
    text = {}
    while True:
        for e in events:
            if e.error is None:
                text[id(e.plan)] = text.get(id(e.plan), "") + e.delta
        if not len(batch):
            return text
        events = batch.step()


def test_a_decoder_that_raises_ends_its_row_alone(stores):
    loaded, clean, _, bad = stores
    engine = Engine(loaded, {"s": clean})
    engine.stores["s"].queries.trie = None  # free-form: several steps
    plans = [engine.plan("s", Request(t, max_new_tokens=6)) for t in ("my card is gone", "refund please")]
    alone = [engine.answer([p])[0].text for p in plans]
    batch = engine.batch()
    events = batch.admit(plans)

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a test's broken decoder")

    batch.rows[0].decoder.accept = broken
    text, ended = {}, {}
    while len(batch):
        for e in events + batch.step():
            if e.error is not None:
                ended[id(e.plan)] = e.error
            else:
                text[id(e.plan)] = text.get(id(e.plan), "") + e.delta
        events = []
    assert list(ended) == [id(plans[0])] and isinstance(ended[id(plans[0])], RowFailed)
    assert "UnicodeDecodeError" in str(ended[id(plans[0])]) and text[id(plans[1])].strip() == alone[1]


def test_an_admission_without_memory_is_put_off_in_halves_and_fails_only_what_cannot_fit(stores, monkeypatch):
    """Rows whose first forward the device has no memory for: half of them wait for a later step, again and
    again; a row that cannot join even alone ends with `AdmissionOutOfMemory`, the others answer as alone."""
    loaded, clean, _, _ = stores
    engine = Engine(loaded, {"s": clean})
    texts = ["my card is gone", "refund please", "where is my money", "a very long query that cannot fit"]
    plans = [engine.plan("s", Request(t)) for t in texts]
    alone = [engine.answer([p])[0].text for p in plans]
    forward, tried = Batch._forward, []

    def tight(self, pack, ids, positions, keep, joining):
        if joining:
            tried.append(len(joining))
        if len(joining) > 1 or any(row.plan is plans[3] for row in joining):
            raise torch.OutOfMemoryError("a test's device is full")
        return forward(self, pack, ids, positions, keep, joining)

    monkeypatch.setattr(Batch, "_forward", tight)
    batch = engine.batch()
    events = batch.admit(plans)
    text, errors = {}, {}
    while len(batch):
        for e in events:
            if e.error is not None:
                errors[id(e.plan)] = e.error
            else:
                text[id(e.plan)] = text.get(id(e.plan), "") + e.delta
        events = batch.step()
    assert tried == [4, 2, 1, 3, 1, 2, 1, 1]
    assert list(errors) == [id(plans[3])] and isinstance(errors[id(plans[3])], AdmissionOutOfMemory)
    assert [text[id(p)].strip() for p in plans[:3]] == alone[:3]


def test_rows_holding_blocks_once_recompute_an_unreadable_one_alone(stores, monkeypatch):
    """Rows sharing blocks, two of them the damaged one: those two let their held blocks go and compute it as rows of
    their own; the row that does not need it keeps the blocks it shares with them, held once, and its logits."""
    hold_every_shared_block(monkeypatch)
    loaded, clean, damaged, bad = stores
    engine, reference = Engine(loaded, {"s": damaged}, on_load_error="recompute"), Engine(loaded, {"s": clean})
    good = [b for b in range(clean.num_blocks) if b != bad][:2]
    orders = [[good[0], bad], [good[0], good[1]], [good[1], bad]]
    plans = [engine.plan("s", Request("my card is gone"), block_ids=o) for o in orders]
    batch = Batch(engine, keep_all=True)
    got = batch.prefill_logits(plans)
    held = {id(row.plan): bool(row.held) for row in batch.rows}
    assert [held[id(p)] for p in plans] == [False, True, False]  # only the row without it holds blocks once
    assert {key[1] for key in batch.held} == {None, *good}
    assert batch.fetch_stats["unreadable_blocks"] == 1
    mounted = reference.stores["s"]
    want = reference.logits([mounted.without_blocks(p, {bad}) if bad in o else p
                             for p, o in zip([reference.plan("s", Request("my card is gone"), block_ids=o)
                                              for o in orders], orders)])
    for ours, theirs in zip(got, want):
        assert torch.isfinite(ours).all() and (ours - theirs).abs().max() <= ATOL
