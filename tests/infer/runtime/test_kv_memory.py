"""The engine's KV memory: one budget, its pools made once and never copied, pages handed out and taken back.

A tiny random Qwen2 whose config has 131,072 positions (Llama-3.1's) and a synthetic store built for it:
16 long rows (k = 8 blocks of 160 tokens) need ~1,300 columns each. A batch's pools are made at the budget's pages
when its first row is seated and never move (issue 73: growing them copied every layer's K/V); what its rows reach
of them is their columns rounded up to a page per row, and on a CPU only that much is resident.
"""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milo_infer.bench import synthetic_model
from milo_infer.models import LoadedModel, model_identity
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.pages import (FULL, PAGE_TOKENS, WINDOW, PageAllocator, PageGroups, kv_budget_bytes,
                                     parse_kv_memory, split_budget)
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


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def pools(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


def test_the_pools_are_the_budget_made_once_and_16_long_rows_reach_their_need_rounded_to_a_page(long_context):
    """Made at the budget (2 GiB here) when the first row is seated, on a CPU only the pages rows reach are resident;
    rows joining one by one, each needing pages no row gave back, never copy a pool (red before issue 73: each such
    admission grew, and so copied, every layer's pools)."""
    loaded, store = long_context
    budget = 2 << 30
    engine = Engine(loaded, {"s": store}, EngineSettings(k=K), shared_blocks=False, kv_cache_memory=budget)
    assert engine.max_positions == POSITIONS
    plans = [engine.plan("s", Request(q)) for q in long_queries()]
    assert min(len(p.blocks) for p in plans) == K and min(p.prompt_tokens for p in plans) > 1000
    need, rounded = rows_need(engine, plans)
    batch, events = engine.batch(), []
    before = resident_bytes()
    events += batch.admit(plans[:1])
    made = [t.data_ptr() for t in pools(batch.cache)]
    assert sum(t.numel() * t.element_size() for t in pools(batch.cache)) == engine.kv_pages * engine.page_bytes
    assert need // ROWS <= batch.kv_bytes_allocated <= rounded // ROWS + engine.page_bytes  # one row's, to a page
    reached = [batch.pages.reached()[FULL]]
    for p in plans[1:]:
        events += batch.step()
        events += batch.admit([p])
        assert [t.data_ptr() for t in pools(batch.cache)] == made  # no pool copied, resized or made again
        reached.append(batch.pages.reached()[FULL])
    assert len(set(reached)) > 3  # admissions that needed pages no row gave back: before, each grew the pools
    while len(batch):
        events += batch.step()
    assert all(e.error is None for e in events) and sum(e.finished for e in events) == ROWS
    assert batch.kv_bytes_allocated <= rounded  # the rows' columns, each row rounded up to a page, at most
    assert resident_bytes() - before < budget // 4  # the untouched pages of the budget are not resident
    batch.idle()
    assert [t.data_ptr() for t in pools(batch.cache)] == made  # an idle batch keeps its pools for the next rows


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


def test_the_budget_summary_counts_the_pages_and_the_rows_of_the_stores_prefix(long_context):
    loaded, store = long_context
    engine = Engine(loaded, {"s": store}, EngineSettings(k=K), kv_cache_memory=64 << 20)
    group = store.group_tokens()
    columns = engine.stores["s"].prefix.anchor_len + int(K * group.mean()) + engine.settings.max_new_tokens
    pages = engine.kv_pages  # no window layers: the whole budget in pages of every layer
    assert engine.group_pages == {FULL: pages}
    assert engine.budget_summary() == (f"K/V budget 0.1 GiB: {pages:,} pages of {PAGE_TOKENS} columns, up to "
                                       f"{pages // -(-columns // PAGE_TOKENS):,} rows of store 's''s prefix ({K} groups "
                                       f"and the answer budget: {columns:,} columns, queries aside)")


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


def test_pages_are_consecutive_where_a_free_run_allows_and_never_over_the_capacity():
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=100, deadline=None)
    @given(st.integers(1, 16), st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=40))
    def check(capacity, ops):
        pages, held, highest, taken = PageAllocator(capacity), [], 0, False
        for take, n in ops:
            if take and pages.fits(n):
                free = set(pages.free)
                got = pages.take(n)
                assert len(got) == n == len(set(got)) and not set(got) & {p for h in held for p in h}
                runs = [p for p in sorted(free) if all(p + i in free for i in range(n))]
                if runs:  # a free run was there: the lowest is taken whole
                    assert got == list(range(runs[0], runs[0] + n))
                else:  # else the lowest free pages
                    assert got == sorted(free)[:n]
                held.append(got)
                highest, taken = max(highest, *got), True
            elif take:
                with pytest.raises(ValueError, match="do not fit"):
                    pages.take(n)
            elif held:
                pages.give(held.pop(0))
            assert pages.capacity == capacity and pages.in_use == sum(map(len, held)) <= capacity
            assert pages.reached == (highest + 1 if taken else 0) <= capacity  # one past the highest ever taken
            assert sorted(pages.free) == pages.free and set(pages.free).isdisjoint(p for h in held for p in h)
            assert set(pages.free) | {p for h in held for p in h} == set(range(capacity))
    check()


def test_a_budget_split_between_page_groups_fits_its_bytes_and_any_row_the_budget_admits():
    """Each group's pages of the budget (`split_budget`): within it in bytes, in the shares a typical row takes as
    nearly as whole pages allow, and each group holding the longest row the whole budget admits."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.integers(0, 50), st.integers(0, 50), st.integers(1, 5000), st.integers(1, 40), st.integers(1, 40))
    def check(full_bytes, window_bytes, budget, row_full, row_window):
        each = {FULL: full_bytes, **({WINDOW: window_bytes} if window_bytes else {})}
        row = {FULL: row_full, WINDOW: min(row_window, row_full)}  # a row's window pages are never more
        pages = split_budget(each, budget, row)
        assert PageGroups(each, pages).bytes_of(pages) <= budget
        full_bytes = max(1, full_bytes)  # a group of no bytes: a byte a page
        if not window_bytes:
            assert pages == {FULL: budget // full_bytes}
            return
        longest = budget // (full_bytes + window_bytes)
        assert pages[FULL] >= longest and pages[WINDOW] >= longest
        rows = budget / (row[FULL] * full_bytes + row[WINDOW] * window_bytes)  # as many typical rows fit each group
        assert pages[WINDOW] >= int(rows * row[WINDOW])
        assert pages[WINDOW] > int(rows * row[WINDOW]) or pages[FULL] >= int(rows * row[FULL])  # else raised to longest
    check()


def test_page_groups_fit_each_group_within_its_pages():
    """Two page groups of fixed pages: ``fits`` says yes exactly when every group stays within its pages, and what
    rows take never passes them."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 9), st.integers(0, 9), st.integers(1, 20), st.integers(1, 20),
           st.lists(st.tuples(st.booleans(), st.integers(1, 8), st.integers(1, 8)), max_size=30))
    def check(full_bytes, window_bytes, full_pages, window_pages, ops):
        each = {FULL: full_bytes, **({WINDOW: window_bytes} if window_bytes else {})}
        capacities = {FULL: full_pages, WINDOW: window_pages}
        groups, held = PageGroups(each, capacities), []
        for take, full, window in ops:
            more = {FULL: full, **({WINDOW: window} if groups.windowed else {})}
            fits = all(groups[g].in_use + n <= capacities[g] for g, n in more.items())
            assert groups.fits(more) == fits
            if take and fits:
                held.append({g: groups.take(g, n) for g, n in more.items()})
            elif held:
                for g, table in held.pop(0).items():
                    groups.give(g, table)
            assert groups.in_use_bytes() == sum(len(t) * each[g] for h in held for g, t in h.items())
            assert groups.in_use_bytes() <= groups.bytes_of({g: capacities[g] for g in each})
    check()
