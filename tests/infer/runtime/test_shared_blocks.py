"""Blocks held once for every row that places them (issue 54): what is held, counted, kept, reused and let go.

That rows placing held blocks answer as rows holding their own copies is tests/infer/test_conformance.py's (every
family) and this module's first test (the engine's own test models, decoding); faults are tests/infer/runtime/
test_faults.py's, which runs with blocks held (the default).
"""
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

from milo_infer.models import FAMILIES
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.pages import PAGE_TOKENS, pages_for
from milo_infer.runtime.planning import EngineSettings, Request
from milo_infer.runtime.prefix import FETCH_STATS
from milo_infer.runtime.shared_blocks import HELD_CALL_COLUMNS, HELD_PLACEMENT_COLUMNS, HeldBlocks
from tests.infer.runtime.test_engine import ATOL, REQUESTS, free_form, setup  # noqa: F401 (a fixture)

WORTH_HOLDING = HeldBlocks.worth_holding  # the engine's rule, for the tests that check it


def hold_every_shared_block(monkeypatch) -> None:
    """The test models' blocks are a few tokens each, none worth holding once by the engine's rule (`worth_holding`):
    a test of the held path holds every block that two rows place, as the engine does large blocks many rows place."""
    monkeypatch.setattr(HeldBlocks, "worth_holding", staticmethod(lambda rows, tokens: rows > 1))


@pytest.fixture(autouse=True)
def every_shared_block_held(monkeypatch):
    hold_every_shared_block(monkeypatch)


SHARING = [Request("topic1 topic2", k=2), Request("topic2 topic3", k=2), Request("topic3 topic1 topic2", k=3)]


def engines(setup, **kwargs) -> tuple[Engine, Engine]:
    loaded, store = setup
    settings = EngineSettings(max_new_tokens=5)
    return (free_form(Engine(loaded, {"s": store}, settings, shared_blocks=True, **kwargs)),
            free_form(Engine(loaded, {"s": store}, settings, shared_blocks=False, **kwargs)))


def run(engine: Engine, batch, plans) -> dict:
    """Run ``batch`` to its end after admitting ``plans``: answers by plan."""
    done, events = {}, batch.admit(plans)
    while True:
        for e in events:
            assert e.error is None, e.error
            if e.finished:
                done[id(e.plan)] = e.answer.text
        if not len(batch):
            return done
        events = batch.step()


def test_rows_hold_each_block_once_and_count_it_once(setup):
    held, own = engines(setup)
    plans = [held.plan("s", r) for r in SHARING]
    union = set().union(*(p.blocks for p in plans))
    assert len(union) < sum(len(p.blocks) for p in plans)  # they share blocks, at other offsets
    batch = held.batch()
    batch.admit(plans)
    batch.step()
    blocks = {key[1]: b for key, b in batch.held.items()}
    assert set(blocks) == union | {None}  # each block once, and the store's anchor
    assert all(blocks[b].rows == sum(b in p.blocks for p in plans) for b in union) and blocks[None].rows == 3
    assert batch.fetch_stats["blocks"] == 7 and batch.fetch_stats["unique_blocks"] == len(union)
    assert batch.most_held == {"held_blocks": len(union), "placed_blocks": 7, "held_placements": 7}
    page_bytes = held.page_bytes
    own_columns = sum(p.prompt_tokens + p.max_new_tokens - p.prefix_tokens for p in plans)
    block_columns = sum(b.tokens for b in blocks.values())
    assert batch.kv_bytes_needed == (own_columns + block_columns) * page_bytes // PAGE_TOKENS
    in_use = sum(pages_for(p.prompt_tokens + p.max_new_tokens) - p.prefix_tokens // PAGE_TOKENS for p in plans) + sum(
        pages_for(b.tokens) for b in blocks.values())
    assert batch.kv_bytes_held == in_use * page_bytes == batch.pages.in_use_bytes()
    assert batch.held_counts()["kv_bytes_kept"] == 0
    alone = own.batch()
    alone.admit([own.plan("s", r) for r in SHARING])
    alone.step()
    assert batch.kv_bytes_needed < alone.kv_bytes_needed


def test_rows_placing_held_blocks_decode_as_rows_holding_their_own(setup):
    """Rows joining a running batch one by one, prefilled in chunks, some leaving before others join: the same
    answers and every logit a decoder saw within 1e-4."""
    from milo_infer.runtime.engine import Batch

    loaded, store = setup
    settings = EngineSettings(max_new_tokens=6, prefill_chunk=7)
    seen = {True: [], False: []}
    answers = {}
    for shared in (True, False):
        engine = free_form(Engine(loaded, {"s": store}, settings, shared_blocks=shared))
        advance = Batch._advance

        def recording(self, row, logits, shared=shared):
            seen[shared].append((row.plan.request.text, logits.clone()))
            return advance(self, row, logits)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Batch, "_advance", recording)
            batch, done, events = engine.batch(), {}, []
            for r in REQUESTS + SHARING:
                events += batch.admit([engine.plan("s", r)]) + batch.step()
            while len(batch):
                done.update({e.plan.request.text: e.answer.text for e in events if e.finished})
                events = batch.step()
            done.update({e.plan.request.text: e.answer.text for e in events if e.finished})
        answers[shared] = done
    assert answers[True] == answers[False] and len(answers[True]) == len(set(r.text for r in REQUESTS + SHARING))
    assert [t for t, _ in seen[True]] == [t for t, _ in seen[False]]
    assert max((a - b).abs().max() for (_, a), (_, b) in zip(seen[True], seen[False])) <= ATOL


def test_a_row_joining_later_reuses_held_blocks_without_a_read(setup):
    held, own = engines(setup)
    batch = held.batch()
    plans = [held.plan("s", r) for r in SHARING[:2]]
    shared = sorted(set(plans[0].blocks) & set(plans[1].blocks))
    run(held, batch, plans)  # they share a block: held once, with the anchor
    assert all(b.rows == 0 for b in batch.held.values()) and {key[1] for key in batch.held} == {*shared, None}
    counts = batch.held_counts()  # kept after their rows left
    assert counts["kv_bytes_held"] == 0 and counts["kv_bytes_kept"] == batch.pages.in_use_bytes() > 0
    request = Request(SHARING[0].text, k=len(shared))
    again = run(held, batch, [held.plan("s", request, block_ids=shared)])  # alone, its blocks held: it places them
    assert batch.fetch_stats["bytes"] == 0 and batch.fetch_stats["staged_bytes"] == 0  # nothing read or staged
    assert set(FETCH_STATS) <= set(batch.fetch_stats)  # what a fetch reports, all of it, zero
    assert list(again.values()) == list(run(own, own.batch(), [own.plan("s", request, block_ids=shared)]).values())
    batch.idle()  # nothing to answer: the blocks no row holds go (their pages free; the pools stay)
    assert not batch.held and batch.pages.in_use_bytes() == 0


def test_a_lone_row_or_one_sharing_nothing_holds_its_own_copy(setup):
    """A row none of whose blocks another row places or the batch holds is answered as before: its own copy of its
    whole prefix in its pages, nothing held; beside rows that share, it keeps its own."""
    held, own = engines(setup)
    batch = held.batch()
    batch.admit([held.plan("s", SHARING[0])])
    assert not batch.held and batch.rows[0].own_from == 0 and not batch.rows[0].held
    loner = Request("topic4", k=1)
    plans = [held.plan("s", r) for r in (*SHARING[:2], loner)]
    assert not set(plans[2].blocks) & (set(plans[0].blocks) | set(plans[1].blocks))
    batch = held.batch()
    batch.admit(plans)
    assert [bool(row.held) for row in batch.rows] == [True, True, False]
    assert batch.rows[2].plan.blocks[0] not in {key[1] for key in batch.held}
    for a, b in zip(held.logits(plans), own.logits([own.plan("s", r) for r in (*SHARING[:2], loner)])):
        assert (a - b).abs().max() <= ATOL


def test_blocks_no_row_holds_go_when_their_pages_are_needed(setup):
    """A budget that holds two rows sharing their blocks: the next two rows' blocks take the pages of the first
    two's, as many as they need."""
    loaded, store = setup
    probe = Engine(loaded, {"s": store})
    pairs = [[Request("topic1 topic2", k=2), Request("topic2 topic1", k=2)],
             [Request("topic4 topic0", k=2), Request("topic0 topic4", k=2)]]
    plans = [[probe.plan("s", r) for r in pair] for pair in pairs]
    assert not set(plans[0][0].blocks) & set(plans[1][0].blocks)
    need = max(sum(pages_for(p.prompt_tokens + p.max_new_tokens) for p in pair) + 2 + len(pair[0].blocks)
               for pair in plans)
    held, own = engines(setup, kv_cache_memory=need * probe.page_bytes)
    batch = held.batch()
    answers = [run(held, batch, [held.plan("s", r) for r in pair]) for pair in pairs]
    assert set(plans[1][0].blocks) | {None} <= {key[1] for key in batch.held}
    assert not set(plans[0][0].blocks) <= {key[1] for key in batch.held}  # the first rows' went, as many as needed
    assert batch.pages.in_use_bytes() <= held.kv_budget
    assert [list(a.values()) for a in answers] == [list(run(own, own.batch(), [own.plan("s", r) for r in pair]).values())
                                                  for pair in pairs]


def test_a_cancelled_row_never_leaves_a_block_unwritten_for_the_next(setup):
    """Rows cancelled before their first forward: their admission is given up, and the blocks it was to write are no
    row's to find (the next rows read them again)."""
    held, own = engines(setup)
    batch = held.batch()
    plans = [held.plan("s", r) for r in SHARING[:2]]
    batch.admit(plans)
    assert batch.held
    for plan in plans:
        batch.cancel(plan)
    assert not batch.held and not batch.admissions and batch.pages.in_use_bytes() == 0
    answer = run(held, batch, [held.plan("s", r) for r in SHARING[:2]])
    assert batch.fetch_stats["bytes"] > 0  # read again
    assert list(answer.values()) == list(run(own, own.batch(), [own.plan("s", r) for r in SHARING[:2]]).values())


def test_logits_with_a_block_held_by_one_row_only_equal_the_row_alone(setup):
    held, own = engines(setup)
    plans = [held.plan("s", r) for r in SHARING]
    for a, b in zip(held.logits(plans), own.logits([own.plan("s", r) for r in SHARING])):
        assert (a - b).abs().max() <= ATOL


def test_a_family_whose_keys_are_not_a_rotation_holds_its_own_copies(setup, monkeypatch):
    loaded, store = setup
    family = loaded.model.config.model_type
    monkeypatch.setitem(FAMILIES, family, dataclasses.replace(FAMILIES[family], query_turns=False))
    engine = Engine(loaded, {"s": store})
    assert not engine.shared_blocks
    batch = engine.batch()
    batch.admit([engine.plan("s", SHARING[0])])
    batch.step()
    assert not batch.held and batch.rows[0].own_from == 0


def test_a_turned_query_is_the_query_rotated_at_the_difference():
    """RopeTables.turn: a query rotated at m, turned back by p, is the query rotated at m − p, scaled tables too."""
    from milo_infer.models.rope import RopeTables
    from milo_kernels.cpu import rope

    positions, d = 64, 8
    angle = torch.arange(positions)[:, None] * torch.tensor([0.3, 0.05, 0.3, 0.05]).repeat(2)[None]
    scale = 1.3  # YaRN's attention factor, folded into the tables
    tables = RopeTables(scale * angle.cos(), scale * angle.sin(), 1)
    q = torch.randn(3, 1, d)
    m, p = 50, 17
    cos, sin = tables.layer(0)
    at_m = rope(q, cos[m:m + 1], sin[m:m + 1], False)
    turn_cos, turn_sin = tables.turn(0)
    turned = rope(at_m, turn_cos[p:p + 1], -turn_sin[p:p + 1], False)
    assert torch.allclose(turned, rope(q, cos[m - p:m - p + 1], sin[m - p:m - p + 1], False), atol=1e-5)


def test_a_row_keeps_the_blocks_only_it_places_in_its_own_pages_before_its_query(setup):
    """Two rows sharing one block hold it (and the anchor) once; each keeps the block only it places in its own
    pages, packed just before its query, and the counters say which placements are held (issue 64)."""
    held, own = engines(setup)
    store = setup[1]
    plans = [held.plan("s", r) for r in SHARING[:2]]
    shared = set(plans[0].blocks) & set(plans[1].blocks)
    assert shared and all(set(p.blocks) - shared for p in plans)
    batch = held.batch()
    batch.admit(plans)
    batch.step()
    assert {key[1] for key in batch.held} == shared | {None}
    for row, plan in zip(batch.rows, plans):
        kept = [b for b in plan.blocks if b not in shared]
        assert [block.block for block, _ in row.held] == [None, *(b for b in plan.blocks if b in shared)]
        assert row.rebuilt.blocks == kept and not row.rebuilt.anchor
        assert row.own_from == plan.prefix_tokens - int(store.block_tokens[kept].sum())
    counts = batch.held_counts()
    assert (counts["placed_blocks"], counts["held_placements"], counts["held_blocks"]) == (4, 2, 1)
    for a, b in zip(held.logits(plans), own.logits([own.plan("s", r) for r in SHARING[:2]])):
        assert (a - b).abs().max() <= ATOL


def test_blocks_too_small_for_a_page_stay_in_the_rows_pages(setup, monkeypatch):
    """The engine's own rule: the test store's blocks, a few tokens each, would take a whole page held once for the
    rows that place them: every row keeps its own copy and the batch needs no more K/V than without sharing."""
    monkeypatch.setattr(HeldBlocks, "worth_holding", staticmethod(WORTH_HOLDING))
    held, own = engines(setup)
    store = setup[1]
    plans = [held.plan("s", r) for r in SHARING]
    assert all(len(plans) * int(store.block_tokens[b]) <= PAGE_TOKENS for p in plans for b in p.blocks)
    batch, alone = held.batch(), own.batch()
    for b, engine in ((batch, held), (alone, own)):
        b.admit([engine.plan("s", r) for r in SHARING])
        b.step()
    assert not batch.held and all(row.own_from == 0 and row.rebuilt is row.executed.placement for row in batch.rows)
    assert batch.kv_bytes_needed == alone.kv_bytes_needed and batch.held_counts()["held_placements"] == 0


@given(rows=st.integers(1, 256), tokens=st.integers(1, 4096))
def test_a_block_is_held_once_only_where_it_takes_fewer_columns_than_its_rows_copies(rows, tokens):
    pages = pages_for(tokens) * PAGE_TOKENS
    if WORTH_HOLDING(rows, tokens):
        assert rows * tokens > pages  # never more K/V than the rows' own copies
        # the columns not read pay for the block's attention call and its rows' merge
        assert (rows - 1) * tokens >= HELD_CALL_COLUMNS + rows * HELD_PLACEMENT_COLUMNS
    elif rows >= 2 and tokens % PAGE_TOKENS == 0:  # whole pages placed twice are held where they pay
        assert (rows - 1) * tokens < HELD_CALL_COLUMNS + rows * HELD_PLACEMENT_COLUMNS
