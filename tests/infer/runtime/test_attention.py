"""Attention over the paged cache against per-row SDPA over each row's own contiguous K/V (the slot cache's).

fp32 on the CPU, 1e-4: rows of one token (on consecutive pages and on scattered ones) and of prefill chunks
(positions with gaps, as recomputed tokens have), a chunk over two query blocks that sees pages whole and in
part, pages consecutive and scattered, GQA. FlexAttention runs uncompiled here (it materialises the scores: small sizes only) and once compiled.
"""
import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from milo_infer.runtime import attention
from milo_infer.runtime.cache import Pack, Segment, pool_columns
from milo_infer.runtime.pages import FULL, PAGE_TOKENS, pages_for, run_start
from milo_infer.runtime.planning import EngineSettings, Request
from tests.infer.runtime.test_engine import REQUESTS, free_form, setup  # noqa: F401 (a fixture)

ATOL = 1e-4
Hq, H, d = 4, 2, 16


def rows_case(seed: int):
    """A pool and a pack of rows: (pages, positions fed) each, with keys up to each row's last position."""
    g = torch.Generator().manual_seed(seed)
    rows = [([3], torch.tensor([40])),  # one decode token on one page
            ([0, 1, 2], torch.tensor([300])),  # consecutive pages
            ([9, 4, 7, 5], torch.cat([torch.tensor([130, 131, 200]), torch.arange(300, 480)])),  # gaps, 2 q blocks
            ([8, 6], torch.arange(129, 140)),  # a chunk starting on the row's second page
            ([11, 10], torch.tensor([200]))]  # one decode token on scattered pages
    pool = 12
    k = torch.randn(1, H, pool * PAGE_TOKENS, d, generator=g)
    v = torch.randn(1, H, pool * PAGE_TOKENS, d, generator=g)
    segments, at = [], 0
    for pages, positions in rows:
        keys = int(positions[-1]) + 1
        assert pages_for(keys) == len(pages)
        n = len(positions)
        mask = None if n == 1 else torch.arange(keys)[None, :] <= positions[:, None]
        segments.append(Segment(pages, torch.tensor(pages), run_start(pages), at, at + n, keys, positions, mask))
        at += n
    query = torch.randn(1, Hq, at, d, generator=g)
    return query, k, v, Pack(segments, torch.cat([pool_columns(p, pos) for p, pos in rows]), attention="flex"), rows


def per_row_reference(query, k, v, rows) -> torch.Tensor:
    """SDPA per row over its columns copied out contiguously: what the slot cache attended to."""
    out, at = [], 0
    for pages, positions in rows:
        keys, n = int(positions[-1]) + 1, len(positions)
        where = pool_columns(pages, torch.arange(keys))
        mask = torch.arange(keys)[None, :] <= positions[:, None]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, at:at + n], k[:, :, where], v[:, :, where], attn_mask=mask, enable_gqa=True))
        at += n
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("seed", [0, 1])
def test_flex_and_the_per_row_loop_equal_per_row_sdpa(seed):
    query, k, v, pack, rows = rows_case(seed)
    want = per_row_reference(query, k, v, rows)
    assert pack.segments[1].run == 0 and pack.segments[2].run is None and pack.segments[4].run is None
    got_rows = attention.sdpa_rows(query, k, v, pack, attention.LayerAttention())
    got_flex = attention.flex_rows(query, k, v, pack, None, compiled=False)
    assert got_rows.shape == got_flex.shape == want.shape
    assert (got_rows - want).abs().max() <= ATOL
    assert (got_flex - want).abs().max() <= ATOL
    layout = pack.scratch["flex"]
    assert layout["shape"] == (8, 256)  # rows and tokens padded to powers of two
    full = layout["block_mask"].full_kv_num_blocks
    assert [int(x) for x in full[2, 0]] == [1, 3]  # pages seen whole by the block skip the mask function


def eager_reference(query, k, v, rows, layer) -> torch.Tensor:
    """Each row's attention written out over its columns copied out contiguously, as transformers' eager
    attention does it: window (p - W < c <= p), soft-cap, then a sink logit per head beside the scores."""
    out, at = [], 0
    for pages, positions in rows:
        keys, n = int(positions[-1]) + 1, len(positions)
        where = pool_columns(pages, torch.arange(keys))
        columns = torch.arange(keys)[None, :]
        allowed = columns <= positions[:, None]
        if layer.window is not None:
            allowed &= columns > positions[:, None] - layer.window
        kk = k[:, :, where].repeat_interleave(Hq // H, dim=1)
        vv = v[:, :, where].repeat_interleave(Hq // H, dim=1)
        scores = query[:, :, at:at + n] @ kk.transpose(-1, -2) * (layer.scaling or d ** -0.5)
        if layer.softcap is not None:
            scores = layer.softcap * torch.tanh(scores / layer.softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if layer.sinks is not None:
            scores = torch.cat([scores, layer.sinks[None, :, None, None].expand(1, Hq, n, 1)], dim=-1)
        weights = scores.softmax(dim=-1)[..., :keys]
        out.append(weights @ vv)
        at += n
    return torch.cat(out, dim=2)


LAYERS = {  # what a layer hands its attention beyond causal softmax
    "window of 100": attention.LayerAttention(window=100),  # the 2-block chunk's window starts mid-page
    "window of 5": attention.LayerAttention(window=5),  # inside one page
    "window, cap and scale": attention.LayerAttention(scaling=0.3, window=130, softcap=2.0),  # Gemma 2's
    "window and sinks": attention.LayerAttention(window=64, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),  # gpt-oss
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_windows_caps_and_sinks_over_the_pages_equal_eager_attention(name):
    layer = LAYERS[name]
    query, k, v, pack, rows = rows_case(3)
    want = eager_reference(query, k, v, rows, layer)
    assert (attention.sdpa_rows(query, k, v, pack, layer) - want).abs().max() <= ATOL
    assert (attention.flex_rows(query, k, v, pack, layer, compiled=False) - want).abs().max() <= ATOL
    assert (eager_reference(query, k, v, rows, attention.LayerAttention()) - want).abs().max() > 1e-2  # it bites


def test_a_window_layers_flex_blocks_start_at_the_first_page_its_window_reaches():
    query, k, v, pack, rows = rows_case(4)
    attention.flex_rows(query, k, v, pack, LAYERS["window of 100"],
                        compiled=False)
    block_mask = pack.scratch["flex window 100"]["block_mask"]
    # row 2's second query block holds positions 425..479: its window reaches back to 326, on page 2 of 4
    assert int(block_mask.full_kv_num_blocks[2, 0, 1]) == 0
    assert int(block_mask.kv_num_blocks[2, 0, 1]) == 2
    assert [int(p) for p in block_mask.kv_indices[2, 0, 1, :2]] == [7, 5]


def test_flex_attention_compiled_equals_per_row_sdpa():
    """The compiled kernel (C++ on the CPU, Triton on CUDA) reads the block mask's pages, not only its
    mask function: a wrong page table would show here and not uncompiled."""
    query, k, v, pack, rows = rows_case(2)
    got = attention.flex_rows(query, k, v, pack, None, compiled=True)
    assert (got - per_row_reference(query, k, v, rows)).abs().max() <= ATOL
    for layer in (attention.LayerAttention(scaling=0.3, window=100, softcap=2.0),  # sinks: on the CPU, the row loop
                  attention.LayerAttention(window=100, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))):
        got = attention.flex_rows(query, k, v, pack, layer, compiled=True)
        assert (got - eager_reference(query, k, v, rows, layer)).abs().max() <= ATOL


def test_the_engine_answers_the_same_with_flex_attention(setup, monkeypatch):
    """Rows of different lengths joining a running batch, prefilled in chunks: every logit within 1e-4."""
    from milo_infer.runtime.engine import Engine

    monkeypatch.setattr(attention, "compiled_flex", lambda device_type: flex_attention)  # small: uncompiled
    loaded, store = setup
    settings = EngineSettings(max_new_tokens=5, prefill_chunk=7)
    rows = free_form(Engine(loaded, {"s": store}, settings=settings, attention="rows"))
    flex = free_form(Engine(loaded, {"s": store}, settings=settings, attention="flex"))
    assert (rows.attention, flex.attention) == ("rows", "flex")
    requests = REQUESTS + [Request("topic1 topic4 and a question long enough for several chunks", k=2)]
    for a, b in zip(rows.logits([rows.plan("s", r) for r in requests]),
                    flex.logits([flex.plan("s", r) for r in requests])):
        assert (a - b).abs().max() <= ATOL
    batch, done, events = flex.batch(), {}, []
    for r in requests:
        events += batch.admit([flex.plan("s", r)]) + batch.step()
    while len(batch):
        done.update({id(e.plan): e.answer for e in events if e.finished})
        events = batch.step()
    done.update({id(e.plan): e.answer for e in events if e.finished})
    assert sorted(a.text for a in done.values()) == sorted(a.text for a in rows.answer([rows.plan("s", r)
                                                                                         for r in requests]))


def reference_rows(query, key, value, pack: Pack, layer) -> torch.Tensor:
    """The per-row loop as it was before issue 47: SDPA with GQA over each row's columns, gathered by indexing
    (the tiny models here have no window, soft-cap or sinks: only the layer's scale)."""
    assert layer.window is None and layer.softcap is None and layer.sinks is None
    out = torch.empty_like(query)
    for s in pack.segments:
        where = pool_columns(s.pages, torch.arange(s.keys))
        out[:, :, s.start:s.stop] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s.start:s.stop], key[:, :, where], value[:, :, where], attn_mask=s.mask, scale=layer.scaling,
            enable_gqa=True)
    return out


def decode(engine, scattered: bool) -> tuple[list[str], list[torch.Tensor]]:
    """Free-form answers of REQUESTS in one batch (on reversed pages: none consecutive), and every logits row a
    decoder was given, in order."""
    from milo_infer.runtime.engine import Batch

    seen, advance = [], Batch._advance

    def recording(self, row, logits):
        seen.append(logits.clone())
        return advance(self, row, logits)

    batch, taken = engine.batch(), []
    if scattered:
        full = batch.pages[FULL]
        take = full.take
        full.take = lambda n: taken.append(take(n)[::-1]) or taken[-1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Batch, "_advance", recording)
        plans = [engine.plan("s", r) for r in REQUESTS]
        done, events = {}, batch.admit(plans)
        while len(batch):
            done.update({id(e.plan): e.answer.text for e in events if e.finished})
            events = batch.step()
        done.update({id(e.plan): e.answer.text for e in events if e.finished})
    assert not scattered or any(run_start(pages) is None for pages in taken)
    return [done[id(p)] for p in plans], seen


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
def test_the_per_row_loop_answers_as_it_did_before_issue_47(setup, monkeypatch, scattered):
    """The gather by index_select, made once a forward, and a decode token's query heads attended as their KV
    heads' groups: the same answers, every logit a decoder saw within 1e-4 of the loop before."""
    from milo_infer.runtime.engine import Engine

    loaded, store = setup
    engine = free_form(Engine(loaded, {"s": store}, settings=EngineSettings(max_new_tokens=6), attention="rows",
                              shared_blocks=False))  # the loop over each row's own copy of its prefix
    answers, logits = decode(engine, scattered)
    monkeypatch.setattr(attention, "sdpa_rows", reference_rows)
    before, before_logits = decode(engine, scattered)
    assert answers == before and len(logits) == len(before_logits) > len(REQUESTS)
    assert max((a - b).abs().max() for a, b in zip(logits, before_logits)) <= ATOL


def test_attention_names_are_checked():
    assert attention.choose_attention("auto", torch.device("cpu")) == "rows"
    assert attention.choose_attention("auto", torch.device("cuda")) == "flex"
    with pytest.raises(ValueError, match="attention must be one of auto, flex, rows"):
        attention.choose_attention("paged", torch.device("cpu"))


def test_compiled_flex_compiles_once_per_bucket_not_per_step(tmp_path):
    """Compiled FlexAttention's shapes are buckets (rows and tokens in powers of two, pools in powers of two of
    pages): batches of 1, 2 and 4 rows compile at most a prefill and a decode shape each, and 30 more forwards of
    other batch sizes and prefix lengths within those buckets compile nothing (counted, not timed). Before, each
    pool size was a shape of its own (the H200's first sweep stalled, 2026-12-04)."""
    from milo_infer.bench import synthetic_model
    from milo_infer.runtime.engine import Engine
    from milo_store import MiloStore

    torch.manual_seed(0)
    loaded = synthetic_model.random_model("tiny")
    paths = synthetic_model.synthetic_stores(tmp_path, loaded, demos=64, block_size=8, demo_tokens=12, ratios=(0.5,))
    queries = synthetic_model.synthetic_queries(4, 8, 8)
    with MiloStore.open(paths["milo-r0.5"]) as store:
        engine = Engine(loaded, {"s": store}, attention="flex", max_rows=4, kv_cache_memory=16 << 20)

        def forwards(k: int, batch: int) -> int:
            stats = {}
            engine.answer([engine.plan("s", Request(q, k=k)) for q in queries[:batch]], stats)
            return stats["steps"]

        before = attention.compiled_graphs()
        for batch in (1, 2, 4):
            forwards(8, batch)
        covering = attention.compiled_graphs() - before
        assert covering <= 3 * 2  # a prefill and a decode shape per rows bucket, or fewer where compiled already
        before, steps = attention.compiled_graphs(), 0
        for k, batch in ((5, 1), (6, 2), (7, 4), (6, 3), (6, 1), (7, 2), (5, 4)):
            steps += forwards(k, batch)
        assert steps >= 20 and attention.compiled_graphs() - before == 0
