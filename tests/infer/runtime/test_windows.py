"""A window layer reads, rebuilds and holds pages only for what its window reaches (issue 46, item 3): the same
answers as reading and holding every layer of every block, fewer bytes. CI: about 75 s here.

Tiny random models of the window families (windows of 8 tokens, layer 0 sliding, layer 1 full) over an identity
store of six blocks of ~120 tokens placed in a query's prefix (~740 tokens, six pages): each window layer reaches
the last block and holds two pages (its own and the spill page), a full layer every block and page.
"""
import functools
import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from milo_infer.bench.synthetic_model import synthetic_queries, synthetic_stores
from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig
from milo_infer.runtime import attention, engine as engine_module
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.pages import PAGE_TOKENS, pages_for
from milo_infer.runtime.planning import Request
from milo_infer.runtime.prefix import BlockPlacement
from milo_store import CompressionConfig, MiloStore

from .. import families
from ..demo_stores import corrupted_block

QUERIES = ["my card was charged twice", "cash pin fee", "my pin"]
TOLERANCE = 1e-5  # fp32: the same columns attended, the unreached ones masked either way (seen: 0.0)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """family -> (its tiny model, an identity store of six blocks of three demonstrations)."""
    made = {}

    def make(family):
        if family not in made:
            loaded = families.tiny_model(family)
            path = tmp_path_factory.mktemp(family) / "s"
            config = BuildConfig(block_size=3, context_blocks=1, order="corpus",
                                 compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
            build_store(path, loaded, families.demonstrations(18), families.TASK, config, progress=False)
            made[family] = loaded, MiloStore.open(path)
        return made[family]
    yield make
    for _, store in made.values():
        store.close()


def answers(loaded, store, *, window_reach: bool, recompute: int = 0):
    engine = Engine(loaded, {"s": store}, window_reach=window_reach)
    plans = [engine.plan("s", Request(text=q, recompute=recompute), block_ids=list(range(store.num_blocks)))
             for q in QUERIES]
    stats: dict = {}
    logits = engine.logits(plans)
    texts = [a.text for a in engine.answer(plans, stats)]
    return plans, logits, texts, stats


@pytest.mark.parametrize("family, path", [("gemma3_text", "rows"), ("gemma2", "rows"), ("gpt_oss", "rows"),
                                          ("cohere2", "rows"), ("gemma3_text", "flex"), ("gpt_oss", "flex")])
def test_reading_only_what_the_windows_reach_answers_as_reading_everything(family, path, stores, monkeypatch):
    if path == "flex":  # uncompiled on the CPU, as the conformance suite runs it
        monkeypatch.setattr(engine_module, "choose_attention", lambda name, device: "flex")
        monkeypatch.setattr(attention, "flex_rows", functools.partial(attention.flex_rows, compiled=False))
    loaded, store = stores(family)
    plans, windowed, texts, stats = answers(loaded, store, window_reach=True)
    _, everything, all_texts, all_stats = answers(loaded, store, window_reach=False)
    reach = plans[0].placement.reach
    assert reach is not None and len(reach[0]) < store.num_blocks  # the windows bite: layer 0 slides
    assert len(reach[1]) == store.num_blocks  # layer 1 attends in full
    for ours, theirs in zip(windowed, everything):
        assert (ours - theirs).abs().max() <= TOLERANCE
    assert texts == all_texts
    assert stats["staged_bytes"] < all_stats["staged_bytes"] and stats["bytes"] < all_stats["bytes"]
    assert stats["kv_bytes_allocated"] < all_stats["kv_bytes_allocated"]
    assert stats["kv_bytes_needed"] < all_stats["kv_bytes_needed"]


def test_recomputed_tokens_move_the_reach_back_and_answer_as_reading_everything(stores):
    """A recomputed token sits in the prefix: the windows reach back from it, so more blocks are read."""
    loaded, store = stores("gemma3_text")
    plans, windowed, texts, _ = answers(loaded, store, window_reach=True, recompute=2)
    plain, _, _, _ = answers(loaded, store, window_reach=True)
    _, everything, all_texts, _ = answers(loaded, store, window_reach=False, recompute=2)
    assert len(plans[0].placement.reach[0]) > len(plain[0].placement.reach[0])
    for ours, theirs in zip(windowed, everything):
        assert (ours - theirs).abs().max() <= TOLERANCE
    assert texts == all_texts


def test_the_bytes_read_are_each_layers_reached_blocks_only(stores):
    """What the prefetcher stages and moves is, per layer, the factor slices of the blocks some row's window
    reaches there, exactly (red with the reach left out of the plan: every layer of every block)."""
    loaded, store = stores("gemma3_text")
    plans, _, _, stats = answers(loaded, store, window_reach=True)
    blocks = plans[0].blocks
    union = {l: sorted({p.blocks[i] for p in plans for i in p.placement.layer_blocks(l)})
             for l in range(store.layout.num_layers)}
    expected = sum(int(np.diff(store.block_layer_bounds(b))[l]) * store.itemsize
                   for l, reached in union.items() for b in reached)
    everything = int(store.block_bytes(blocks).sum())
    assert stats["staged_bytes"] == stats["bytes"] == expected < everything
    assert len(union[0]) < len(blocks)


def test_a_window_layer_holds_pages_from_the_first_its_window_reaches(stores):
    """Each row's window layers hold its pages from the one holding column (first fed position − W + 1) on, and one
    spill page for the columns before; its full layers every page (red with window_reach off: every layer every
    page)."""
    loaded, store = stores("gemma3_text")
    engine = Engine(loaded, {"s": store}, shared_blocks=False)  # rows holding their own prefixes
    plans = [engine.plan("s", Request(text=q), block_ids=list(range(store.num_blocks))) for q in QUERIES]
    batch = engine.batch()
    batch.admit(plans)
    window = loaded.model.config.sliding_window
    need = [pages_for(p.prompt_tokens + p.max_new_tokens) for p in plans]
    skip = [(p.prefix_tokens - window + 1) // PAGE_TOKENS for p in plans]
    assert all(s > 0 for s in skip)
    assert [row.window_pages_held() for row in batch.rows] == [sorted(set(row.window_pages)) for row in batch.rows]
    assert [len(row.window_pages_held()) for row in batch.rows] == [n - s + 1 for n, s in zip(need, skip)]
    assert [row.window_pages[:s] == [row.window_pages[0]] * s for row, s in zip(batch.rows, skip)] == [True] * 3
    full, windowed = engine.group_page_bytes[False], engine.group_page_bytes[True]
    window_need = sum(n - s + 1 for n, s in zip(need, skip))
    assert batch.pages.reached() == {False: sum(need), True: window_need}
    assert batch.kv_bytes_allocated == sum(need) * full + window_need * windowed < sum(need) * engine.page_bytes
    pools = engine.group_pages[False] * full + engine.group_pages[True] * windowed  # each group's share, made at once
    assert batch.cache.allocated_bytes == pools <= engine.kv_budget
    while len(batch):
        batch.step()
    batch.idle()
    assert batch.cache.allocated_bytes == pools  # every page given back, the pools kept for the next rows


def test_a_model_without_windows_plans_and_reads_as_before(stores):
    loaded, store = stores("llama")
    plans, _, _, stats = answers(loaded, store, window_reach=True)
    assert all(p.placement.reach is None for p in plans)
    assert stats["bytes"] == int(store.block_bytes(plans[0].blocks).sum())
    engine = Engine(loaded, {"s": store})
    assert not engine.window_layers and not engine.batch().pages.windowed


def test_a_placement_without_windows_is_left_as_it_is():
    placement = BlockPlacement("s", [7, 5], np.array([4, 24]), np.zeros(0), 34, 0, 0)
    assert placement.windowed(34, [None, None]) is placement and placement.windowed(34, None) is placement
    assert placement.windowed(34, [11, None]).reach == ((1,), (0, 1))  # from 34 a window of 11 sees 24 on
    assert placement.windowed(34, [11, None]).layer_blocks(1) == [0, 1]


def test_a_block_computed_instead_of_read_moves_the_reach_and_the_window_pages_back(stores, tmp_path):
    """An unreadable block in the middle is computed by the model at its own positions: the row's first fed token
    moves back to it, so its windows reach further back and its window layers are given pages from there; the
    answers equal reading every layer of the same damaged store."""
    loaded, store = stores("gemma3_text")
    bad = corrupted_block(store.path, tmp_path / "bad", span=64)
    with MiloStore.open(tmp_path / "bad", tier="disk") as damaged:
        got = {}
        for reach in (True, False):
            engine = Engine(loaded, {"s": damaged}, on_load_error="recompute", window_reach=reach,
                            shared_blocks=False)
            plans = [engine.plan("s", Request(text=q), block_ids=list(range(store.num_blocks))) for q in QUERIES]
            if reach:
                batch = engine.batch()
                batch.admit(plans)
                row = batch.rows[0]
                assert bad in row.plan.blocks and bad not in row.executed.blocks
                first = int(row.executed.positions[0])
                assert first < row.plan.prefix_tokens
                skip = max(0, first - loaded.model.config.sliding_window + 1) // PAGE_TOKENS
                assert len(row.window_pages_held()) == len(row.pages) - skip + (1 if skip else 0)
            got[reach] = engine.logits(plans), [a.text for a in engine.answer(plans)]
        for ours, theirs in zip(got[True][0], got[False][0]):
            assert torch.isfinite(ours).all() and (ours - theirs).abs().max() <= TOLERANCE
        assert got[True][1] == got[False][1]


def test_bench_windows_counts_through_the_engine_what_each_engine_read_and_held():
    """tools/bench_windows.py at a tiny Gemma 3 shape where the windows bite on the pages too (prefix ~380, W 16):
    the window engine stages fewer factor bytes and its pools take fewer bytes, with the same answers."""
    path = Path(__file__).resolve().parents[3] / "tools" / "bench_windows.py"
    spec = importlib.util.spec_from_file_location("bench_windows", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    loaded = bench.gemma3_model(layers=2, kv_heads=1, head_dim=16, window=16, full_every=2)
    with tempfile.TemporaryDirectory() as tmp:
        paths = synthetic_stores(tmp, loaded, demos=30, block_size=10, demo_tokens=12, ratios=[0.5])
        with MiloStore.open(paths["milo-r0.5"]) as store:
            m = bench.measure(loaded, store, synthetic_queries(2, 3, 3))
            layer = [int(store.block_layer_bounds(b)[1]) * store.itemsize for b in range(3)]  # layer 0's slices
    assert m["prefix_tokens"] > 2 * PAGE_TOKENS + 16  # two pages skipped, one spill page held
    assert m["every"]["staged"] - m["window"]["staged"] >= min(layer)  # layer 0 skips one block at least
    assert m["window"]["held"] < m["every"]["held"]
    assert m["same_answers"] == 2 and m["logits_apart"] <= TOLERANCE


def test_a_device_tier_keeps_whole_blocks_and_answers_as_reading_everything(stores):
    """With a device tier, a block joins it whole (a later query may place it within a window's reach), and a
    second batch reads the blocks it needs from the tier: the same answers as reading every layer."""
    loaded, store = stores("gemma3_text")
    engine = Engine(loaded, {"s": store}, device_cache_bytes=1 << 30)
    plans = [engine.plan("s", Request(text=q), block_ids=list(range(store.num_blocks))) for q in QUERIES[:1]]
    first, again = {}, {}
    texts = [a.text for a in engine.answer(plans, first)]
    assert [a.text for a in engine.answer(plans, again)] == texts
    assert first["device_hits"] == 0 and again["device_hits"] == store.num_blocks and again["bytes"] == 0
    assert len(engine.device_tier) == store.num_blocks and engine.device_tier.bytes == int(
        store.block_bytes(list(range(store.num_blocks))).sum())
    _, _, all_texts, _ = answers(loaded, store, window_reach=False)
    assert texts == all_texts[:1]
