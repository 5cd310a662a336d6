"""The engine's KV memory follows what its rows need, for a model with real-size positions (issue 40).

A tiny random Qwen2 whose config has 131,072 positions (Llama-3.1's) and a synthetic store built for it:
16 long rows (k = 8 blocks of 160 tokens) need ~1,300 columns each, and the KV buffers a batch allocates
(numel × element size of every tensor its cache's layers hold, whatever they are called) must not exceed
those columns rounded up to a page per row. A cache sized by the model's positions holds 100× that.
"""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milo_infer.bench import synthetic_model
from milo_infer.models import LoadedModel, model_identity
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.pages import (FULL, GROWTH_HEADROOM, PAGE_TOKENS, WINDOW, PageAllocator, PageGroups,
                                     kv_budget_bytes, parse_kv_memory)
from milo_infer.runtime.planning import EngineSettings, Request
from milo_store import MiloStore

POSITIONS = 131_072
ROWS, K, BLOCKS = 16, 8, 8


def long_context_model() -> LoadedModel:
    torch.manual_seed(0)
    config = Qwen2Config(**{**synthetic_model.SHAPES["tiny"], "max_position_embeddings": POSITIONS},
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM._from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=synthetic_model.byte_tokenizer(), identity=model_identity(model))


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    loaded = long_context_model()
    paths = synthetic_model.synthetic_stores(tmp_path_factory.mktemp("long"), loaded, demos=8 * BLOCKS, block_size=8,
                                             demo_tokens=20, ratios=(0.5,))
    with MiloStore.open(paths["milo-r0.5"]) as store:
        assert store.meta["model"]["max_position_embeddings"] == POSITIONS
        yield loaded, store


def long_queries(n: int = ROWS) -> list[str]:
    return synthetic_model.synthetic_queries(n, BLOCKS, K)


def kv_buffer_bytes(cache) -> int:
    """numel × element size of every tensor the cache's layers hold."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in vars(layer).values()
               if isinstance(t, torch.Tensor))


def rows_need(engine: Engine, plans) -> tuple[int, int]:
    """The columns the rows need, and those rounded up to a page each, in bytes."""
    layout = engine.stores[plans[0].store].prefix.layout
    column = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 4
    columns = [p.prompt_tokens + p.max_new_tokens for p in plans]
    return sum(columns) * column, sum(-(-c // PAGE_TOKENS) * PAGE_TOKENS for c in columns) * column


def test_the_kv_buffers_of_16_long_rows_take_their_need_rounded_to_a_page(long_context):
    loaded, store = long_context
    engine = Engine(loaded, {"s": store}, EngineSettings(k=K), shared_blocks=False)  # each row all its columns
    assert engine.max_positions == POSITIONS
    plans = [engine.plan("s", Request(q)) for q in long_queries()]
    assert min(len(p.blocks) for p in plans) == K and min(p.prompt_tokens for p in plans) > 1000
    need, rounded = rows_need(engine, plans)
    batch = engine.batch()
    events = batch.admit(plans)
    assert len(batch.rows) == ROWS
    seen = [kv_buffer_bytes(batch.cache)]
    while len(batch):
        events += batch.step()
        seen.append(kv_buffer_bytes(batch.cache))
    assert all(e.error is None for e in events) and sum(e.finished for e in events) == ROWS
    assert need <= max(seen) <= rounded  # the rows' columns, each row rounded up to a page
    assert max(seen) == batch.kv_bytes_allocated and seen[-1] == max(seen)  # the pools stay for the next rows
    batch.idle()
    assert kv_buffer_bytes(batch.cache) == 0  # and go when the batch's owner says it is idle


def test_rows_joining_one_by_one_grow_the_pools_within_an_eighth_of_their_need(long_context):
    loaded, store = long_context
    engine = Engine(loaded, {"s": store}, EngineSettings(k=K))
    plans = [engine.plan("s", Request(q)) for q in long_queries()]
    batch, events, seen = engine.batch(), [], []
    for p in plans:
        events += batch.admit([p])
        seen.append(kv_buffer_bytes(batch.cache))
        events += batch.step()
    rounded = rows_need(engine, plans)[1]
    # a pool that grows while rows hold pages takes an eighth more (GROWTH_HEADROOM), so a longer row copies nothing
    assert seen == sorted(seen) and seen[-1] <= rounded + rounded // GROWTH_HEADROOM
    while len(batch):
        events += batch.step()
    assert all(e.error is None for e in events) and sum(e.finished for e in events) == ROWS


def test_rows_wait_for_pages_under_a_small_budget_and_answer_as_alone(long_context):
    loaded, store = long_context
    plain = Engine(loaded, {"s": store}, EngineSettings(k=K))
    plans = [plain.plan("s", Request(q)) for q in long_queries(6)]
    need, rounded = rows_need(plain, plans)
    budget = rounded // 3  # about two rows at once
    small = Engine(loaded, {"s": store}, EngineSettings(k=K), kv_cache_memory=budget)
    assert small.kv_pages == budget // small.page_bytes
    stats = {}
    answers = small.answer([small.plan("s", p.request) for p in plans], stats)
    assert [a.text for a in answers] == [a.text for a in plain.answer(plans)]
    assert 0 < stats["kv_bytes_allocated"] <= small.kv_pages * small.page_bytes < need


def test_a_request_that_cannot_fit_alone_is_refused_naming_the_sizes(long_context):
    loaded, store = long_context
    engine = Engine(loaded, {"s": store}, EngineSettings(k=K))
    plan = engine.plan("s", Request("topic1 topic2"))
    budget = 2 * engine.page_bytes + 1
    tight = Engine(loaded, {"s": store}, EngineSettings(k=K), kv_cache_memory=budget)
    with pytest.raises(RequestError, match=rf"needs {plan.prompt_tokens + plan.max_new_tokens} KV columns "
                                           rf".* more than the whole KV budget of {budget} bytes \(2 pages\)"):
        tight.plan("s", Request("topic1 topic2"))
    events = tight.batch().admit([plan])  # planned elsewhere: refused at admission, not left waiting for ever
    assert len(events) == 1 and isinstance(events[0].error, RequestError)
    with pytest.raises(ValueError, match="holds no page"):
        Engine(loaded, {"s": store}, kv_cache_memory=engine.page_bytes - 1)


def test_the_kv_budget_is_bytes_or_a_share_of_free_memory():
    cpu = torch.device("cpu")
    assert parse_kv_memory("8G") == 8 << 30 and parse_kv_memory("0.5") == 0.5 and parse_kv_memory("1") == 1.0
    assert parse_kv_memory("4096") == 4096
    with pytest.raises(ValueError):
        parse_kv_memory("-0.5")
    assert kv_budget_bytes(1 << 20, cpu) == 1 << 20
    share = kv_budget_bytes(0.25, cpu)
    assert 0 < share < kv_budget_bytes(0.5, cpu) + (1 << 26)  # free memory moves between the two reads
    assert kv_budget_bytes(0.5, cpu, reserved=1 << 62) == 0  # the device cache takes it all
    with pytest.raises(ValueError):
        kv_budget_bytes(1.5, cpu)


def test_pages_are_consecutive_where_a_free_run_allows_and_never_over_the_limit():
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
    def check(ops):
        pages, held, peak = PageAllocator(limit=16), [], 0
        for take, n in ops:
            if not n:  # the owner is idle: the pool goes if no row holds a page
                had = pages.capacity
                assert pages.release() == (not held and had > 0) and pages.capacity == (had if held else 0)
            elif take and pages.fits(n):
                free = set(pages.free)
                got = pages.take(n)
                assert len(got) == n == len(set(got)) and not set(got) & {p for h in held for p in h}
                runs = [p for p in sorted(free) if all(p + i in free for i in range(n))]
                if runs:  # a free run was there: the lowest is taken whole
                    assert got == list(range(runs[0], runs[0] + n))
                held.append(got)
            elif held:
                pages.give(held.pop(0))
            assert pages.in_use == sum(map(len, held)) <= pages.limit
            peak = max(peak, pages.in_use)
            assert pages.capacity <= peak  # take grows by what the free pages lack, no more
            assert pages.capacity <= pages.limit and (pages.capacity > 0 or not held)
            assert sorted(pages.free) == pages.free and set(pages.free).isdisjoint(p for h in held for p in h)
    check()


def test_page_groups_never_take_more_than_the_budget_in_bytes():
    """Two page groups at their own bytes a page under one budget: ``fits`` says yes exactly when every group stays
    within its limit and their bytes within the budget, and what rows take never passes it. (The pools may: a take
    grows its group while the other's free pages stay; growth for headroom never adds past the budget.)"""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 9), st.integers(0, 9), st.integers(10, 200),
           st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8), st.integers(1, 8)), max_size=30))
    def check(full_bytes, window_bytes, budget, ops):
        each = {FULL: full_bytes, **({WINDOW: window_bytes} if window_bytes else {})}
        groups, held = PageGroups(each, budget), []
        for op, full, window in ops:
            more = {FULL: full, **({WINDOW: window} if groups.windowed else {})}
            after = {g: groups[g].in_use + n for g, n in more.items()}
            fits = all(after[g] * each[g] <= budget for g in after) and groups.bytes_of(after) <= budget
            assert groups.fits(more) == fits
            if op == 0 and fits:
                held.append({g: groups.take(g, n) for g, n in more.items()})
            elif op == 1 and held:
                for g, table in held.pop(0).items():
                    groups.give(g, table)
            elif op == 2:  # headroom: never past the budget (nor grown where a take left the pools past it)
                before = groups.allocated_bytes()
                groups.grow(more)
                assert groups.allocated_bytes() <= max(budget, before)
            assert groups.in_use_bytes() <= min(budget, groups.allocated_bytes())
            assert groups.in_use_bytes() == sum(len(t) * each[g] for h in held for g, t in h.items())
    check()
