"""The bits store codec (milo_store/codecs/bits.py): round trips, allocation under the budget, stores."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_store import CompressionConfig, Layout, MiloStore, StoreCorruptedError, factorize_block, write_store
from milo_store.codecs.baselines import WeightedBlocks
from milo_store.codecs.lowrank_reference import reconstruct, unpack_block
from milo_store.codecs import BitsCodec, LowRankCodec, open_codec
from milo_store.codecs.bits import component_bytes
from milo_store.codecs.quant import quantize
from milo_store.codecs.allocation import BudgetError
from milo_store.codecs.rate_distortion import WIDTHS, ContextAttention, roundtrip_columns
from ..conftest import bits_store, channel_scale, staged


def dense(flat, layout, ranks, T):
    x = torch.zeros(layout.num_layers, 2, layout.num_kv_heads, T, layout.head_dim)
    for idx, A, S, B in unpack_block(flat.float(), layout, ranks, T):
        x[idx] = reconstruct(A, S, B)
    return x


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 2), st.integers(1, 2), st.integers(2, 11), st.integers(1, 23))
def test_block_round_trip_at_any_widths(seed, L, H, d, T):
    """Odd T and d, T below d, every width incl. 0: the bytes are the format's size, the decoded fp16
    factors rebuild what the reference decodes, and that is each part quantized as the format says."""
    layout = Layout(L, H, d)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, 2, H, T, d, generator=g) * torch.rand(L, 2, H, 1, d, generator=g) * 10
    w = torch.rand(L, 2, H, d, generator=g) + 0.1
    xw = x * w.unsqueeze(-2)
    f = factorize_block(xw[:, 0], xw[:, 1], codec="svd")
    f.B = f.B / w.unsqueeze(-1)
    n = min(T, d)
    widths = np.zeros((1, L, 2, H, d), dtype=np.uint8)
    widths[..., :n] = np.array(WIDTHS)[torch.randint(len(WIDTHS), (L, 2, H, n), generator=g).numpy()]
    codec = BitsCodec(layout, widths, w, [T])
    data = codec.encode(0, f)
    assert data.dtype == torch.uint8 and data.numel() == int(component_bytes(T, widths, d).sum())
    reference = codec.decode_dense(0, data)
    decoded = codec.decode(0, data)
    assert decoded.dtype == torch.float16 and decoded.numel() == layout.block_offsets(codec.ranks, np.array([T]))[-1]
    torch.testing.assert_close(dense(decoded, layout, codec.ranks[0], T), reference, rtol=2e-3, atol=2e-3 * float(reference.abs().max()) + 1e-3)
    c, V = f.A * f.S.unsqueeze(-2), f.B * w.unsqueeze(-1)  # what the format keeps, part by part
    for idx in np.ndindex(L, 2, H):
        keep = torch.nonzero(torch.from_numpy(widths[0][idx][:n].astype(np.int64))).flatten()
        want = torch.zeros(T, d)
        if len(keep):
            coeffs = roundtrip_columns(c[idx][:, keep], torch.from_numpy(widths[0][idx][keep.numpy()].astype(np.int64)))
            codes, scale, low = quantize(V[idx][:, keep], 0, 8)
            basis = codes.float() * scale.float() + low.float()
            want = coeffs @ (basis / w[idx].unsqueeze(-1)).T
        torch.testing.assert_close(reference[idx], want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-5)


def test_a_width_past_the_components_is_refused():
    layout = Layout(1, 1, 8)
    x = torch.randn(1, 2, 1, 3, 8)
    f = factorize_block(x[:, 0], x[:, 1], codec="svd")
    widths = np.zeros((1, 1, 2, 1, 8), dtype=np.uint8)
    widths[..., 5] = 2  # a block of 3 tokens has 3 components
    with pytest.raises(ValueError, match="past its 3 components"):
        BitsCodec(layout, widths, torch.ones(1, 2, 1, 8), [3]).encode(0, f)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**16), st.lists(st.integers(1, 40), min_size=1, max_size=4), st.floats(0.03, 1.0),
       st.sampled_from([0.3, 0.5, 0.7]))
def test_allocation_never_spends_past_the_budget(tmp_path_factory, seed, tokens, ratio, key_share):
    """Everything counted (blocks, channel weights, index with widths) stays within ρ; more budget never
    makes the error larger."""
    layout = Layout(2, 1, 8)
    staging, _ = staged(tmp_path_factory.mktemp("s"), layout, tokens, seed)
    source = WeightedBlocks(staging, len(tokens), channel_scale(layout, seed))
    full = 2 * sum(tokens) * layout.units_per_block * layout.head_dim
    fixed = len(tokens) * (layout.units_per_block * (2 + layout.head_dim) + 8) + source.scale.numel() * 4
    if ratio * full < fixed:
        with pytest.raises(ValueError, match="index and channel weights alone need"):
            BitsCodec.plan_widths(source.factors, list(range(len(tokens))), layout, source.scale, ratio, key_share)
        return
    errors = []
    for r in (ratio, min(1.0, ratio * 1.5)):
        widths, planned = BitsCodec.plan_widths(source.factors, list(range(len(tokens))), layout, source.scale, r, key_share)
        codec = BitsCodec(layout, widths, source.scale, planned)
        assert codec.accounting(2)["total_bytes"] <= r * full + 1e-6
        err = 0.0
        for i in range(len(tokens)):
            f = source.factors(i)
            x = (f.A * f.S.unsqueeze(-2)) @ f.B.transpose(-1, -2)
            y = codec.decode_dense(i, codec.encode(i, f))
            err += float(((y - x) * source.scale.unsqueeze(-2)).pow(2).sum())
        errors.append(err)
    assert errors[1] <= errors[0] * 1.05 + 1e-6  # measured errors: quantizing the basis adds a little


def fake_context(seed, queries=3, rest=0.5, scale=1.0):
    """A `ContextAttention` source without a model: random queries on a block's keys, the block holding
    ``1 - rest`` of the mass, a random rest of the output; scores' gradient without RoPE."""
    def in_context(i, layer, keys, values):
        g = torch.Generator().manual_seed(seed + 7 * i + layer)
        H, T, d = keys.shape
        q = torch.randn(H, queries, d, generator=g) * scale
        probs = torch.softmax(q @ keys.transpose(-1, -2), dim=-1) * (1 - rest)
        output = probs @ values + rest * torch.randn(H, queries, d, generator=g)
        gradient = lambda dirs: (q @ dirs.transpose(-1, -2)).unsqueeze(2).expand(H, queries, T, dirs.shape[1])  # noqa: E731
        return ContextAttention(probs, output, gradient)
    return in_context


def with_context(in_context):
    attend = lambda i, keys: None  # noqa: E731 (one pool reads only the attention in context)
    attend.in_context = in_context
    return attend


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**16), st.lists(st.integers(1, 40), min_size=1, max_size=4), st.floats(0.03, 1.0),
       st.sampled_from([None, 0.3]))
def test_errors_in_context_never_spend_past_the_budget(tmp_path_factory, seed, tokens, ratio, key_share):
    """Errors measured through attention in context, keys and values in one pool (None) or on their own
    shares: everything counted stays within ρ, and the blocks round-trip."""
    layout = Layout(2, 1, 8)
    staging, _ = staged(tmp_path_factory.mktemp("s"), layout, tokens, seed)
    source = WeightedBlocks(staging, len(tokens), channel_scale(layout, seed))
    blocks, attend = list(range(len(tokens))), with_context(fake_context(seed))
    full = 2 * sum(tokens) * layout.units_per_block * layout.head_dim
    try:
        widths, planned = BitsCodec.plan_widths(source.factors, blocks, layout, source.scale, ratio, key_share, attend,
                                                in_context=True)
    except BudgetError:
        return
    codec = BitsCodec(layout, widths, source.scale, planned)
    assert codec.accounting(2)["total_bytes"] <= ratio * full + 1e-6
    if key_share is not None:  # each kind within its own share of what the components may spend
        spent = component_bytes(planned[:, None, None, None, None], widths, 8)
        budget = ratio * full - BitsCodec.fixed_bytes(layout, planned, ratio)
        assert spent[:, :, 0].sum() <= key_share * budget + 1e-6
    for i in blocks:
        assert codec.decode_dense(i, codec.encode(i, source.factors(i))).shape == (2, 2, 1, tokens[i], 8)


def test_one_pool_follows_where_attention_takes_the_error(tmp_path):
    """Keys that no score reads (zero queries: uniform attention, no score moves) get no bytes, and the
    values all of them; a share fixed in advance would have spent a quarter on the keys."""
    layout = Layout(1, 1, 8)
    staging, _ = staged(tmp_path, layout, [40, 40], 0)
    source = WeightedBlocks(staging, 2, channel_scale(layout, 0))
    with pytest.raises(ValueError, match="in context"):
        BitsCodec.plan_widths(source.factors, [0, 1], layout, source.scale, 0.2, None, lambda i, keys: None)
    widths, _ = BitsCodec.plan_widths(source.factors, [0, 1], layout, source.scale, 0.2, None,
                                      with_context(fake_context(0, queries=3, scale=0.0)))
    assert widths[:, :, 0].sum() == 0 and widths[:, :, 1].sum() > 0
    widths, _ = BitsCodec.plan_widths(source.factors, [0, 1], layout, source.scale, 0.2, None,
                                      with_context(fake_context(0, queries=3)))
    assert widths[:, :, 0].sum() > 0


def test_store_round_trip_on_every_tier(tmp_path):
    path, layout, source = bits_store(tmp_path)
    decoded = {}
    for tier in ("host", "disk", "cached"):
        with MiloStore.open(path, tier=tier) as store:
            assert store.meta["codec"] == "bits" and isinstance(store.codec, BitsCodec)
            assert store.layout == layout and store.dtype == "float16" and store.torch_dtype == torch.float16
            acc = store.accounting()
            assert acc["ratio"] <= 0.2 and acc["total_bytes"] == acc["factor_bytes"] + acc["index_bytes"]
            assert acc["factor_bytes"] == int(store.offsets[-1]) + 4 * store.codec.weights.numel()
            assert store.block_bytes([1])[0] == store.offsets[2] - store.offsets[1]  # stored bytes, what a read moves
            for i in range(store.num_blocks):
                block = store.block(i)
                bounds = store.block_layer_bounds(i)
                assert block.dtype == torch.float16 and block.numel() == bounds[-1]
                decoded.setdefault(i, block.clone())
                assert torch.equal(decoded[i], block)  # every tier answers alike
                assert torch.equal(block, store.codec.decode(i, store.codec.encode(i, source.factors(i))))
    with MiloStore.open(path) as store:  # the codec's arrays are checked metadata
        assert {"widths", "channel_weights"} <= set(store.meta["array_checksums"])
        assert store.verify_all() == []


def test_damaged_widths_are_corruption(tmp_path):
    import zarr
    path, _, _ = bits_store(tmp_path)
    widths = zarr.open_array(str(path / "widths"), mode="r+")
    widths[0, 0, 0, 0, 0] = 3 if widths[0, 0, 0, 0, 0] != 3 else 4
    with pytest.raises(StoreCorruptedError, match="widths fails its checksum"):
        MiloStore.open(path)


def test_low_rank_stores_keep_their_bytes(tmp_path):
    """The low-rank adapter decodes a block to its stored bytes themselves (the kernels read them in place)."""
    layout = Layout(1, 1, 8)
    ranks = np.full((2, 1, 2, 1), 3, dtype=np.int16)
    codec = open_codec({"codec": "svd"}, layout, "float16", ranks, np.array([5, 7]), lambda name: None)
    assert isinstance(codec, LowRankCodec)
    assert np.array_equal(codec.stored_offsets, layout.block_offsets(ranks, np.array([5, 7])))
    t = torch.randn(int(codec.stored_offsets[1])).half()
    assert codec.decode(0, t) is t


def test_an_update_keeps_blocks_byte_for_byte_and_encodes_new_ones_under_the_stores_weights(tmp_path):
    """Kept blocks keep their widths and bytes; a new block gets its own basis and widths at the ratio,
    factored under the store's channel weights even when the update's own weights differ."""
    path, layout, _ = bits_store(tmp_path)
    with MiloStore.open(path) as before:
        kept = {0: 1, 1: 3}
        old = {j: before.block(j).clone() for j in kept.values()}
        old_widths, old_weights = before.codec.widths.copy(), before.codec.weights.clone()
        staging, xs = staged(tmp_path, layout, [40, 31, 50], seed=7)  # blocks 0, 1 stand for the kept ones
        write_store(path, staging, 3, layout, CompressionConfig(codec="bits", ratio=0.2, query_aware=True),
                    channel_scale=channel_scale(layout, seed=9), previous=before, reused=kept,
                    anchor_kv=before.anchor_kv(), attrs={"model": {"name": "synthetic"}})
    with MiloStore.open(path) as after:
        assert after.num_blocks == 3 and torch.equal(after.codec.weights, old_weights)
        for i, j in kept.items():
            assert torch.equal(after.block(i), old[j]) and np.array_equal(after.codec.widths[i], old_widths[j])
        new = WeightedBlocks(staging, 3, old_weights)
        assert torch.equal(after.block(2), after.codec.decode(2, after.codec.encode(2, new.factors(2))))
        full_new = 2 * 50 * layout.units_per_block * layout.head_dim
        assert after.block_bytes([2])[0] <= 0.2 * full_new
        assert after.verify_all() == []


def test_the_bits_codec_is_query_aware_and_fp16():
    with pytest.raises(ValueError, match="query-aware"):
        CompressionConfig(codec="bits", ratio=0.2)
    with pytest.raises(ValueError, match="float16"):
        CompressionConfig(codec="bits", ratio=0.2, query_aware=True, dtype="int4")


def test_push_copies_the_stored_bytes(tmp_path):
    """A pushed copy of a bits store writes its stored bytes and its codec's arrays again (not the decoded
    factors), so it decodes to the same blocks."""
    from milo_store.blockcache import BlockCache
    from milo_store.push import push

    path, _, _ = bits_store(tmp_path)
    url = push(path, (tmp_path / "pushed").as_uri())
    with MiloStore.open(path) as a, MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "c")) as b:
        assert b.meta["codec"] == "bits" and np.array_equal(a.codec.widths, b.codec.widths)
        assert all(torch.equal(a.block(i), b.block(i)) for i in range(a.num_blocks))


def test_stat_shows_the_codec_and_its_mean_widths(tmp_path, capsys):
    from milo_store.cli.main import main
    from milo_store.report import describe

    path, _, _ = bits_store(tmp_path)
    with MiloStore.open(path) as store:
        info = describe(store)
        stored = store.codec.widths[:, 1, 0].astype(float)  # layer 1, keys
        assert info["codec"] == "bits"
        assert info["mean_stored_width_per_layer"]["key"][1] == round(stored.sum() / max((stored > 0).sum(), 1), 2)
    assert main(["stat", str(path)]) == 0
    out = capsys.readouterr().out
    assert "codec        bits" in out and "mean code width of the stored components" in out


def test_kernel_tables_rebuild_each_layer_as_the_reference_decodes(tmp_path):
    """The codec's tables drive milo_kernels.bits straight from the stored bytes of several blocks in one
    buffer: each layer equals the reference decode with keys rotated at their rows (the Triton kernel too,
    on CUDA or under TRITON_INTERPRET=1; tests/kernels/test_reconstruct_bits.py holds it to the reference)."""
    from milo_kernels import apply_rope
    from milo_kernels.bits import reconstruct_bits_layer

    path, layout, _ = bits_store(tmp_path)
    L, H, d = layout.num_layers, layout.num_kv_heads, layout.head_dim
    from milo_kernels.triton_kernel import interpreting
    kernel_here = torch.cuda.is_available() or interpreting()
    backends = ["reference"] + (["triton"] if kernel_here else [])
    with MiloStore.open(path) as store:
        codec, ids = store.codec, [2, 0, 3]
        stored = store.stored_blocks(ids)
        data = torch.cat([torch.tensor([7], dtype=torch.uint8), *stored])  # block 2 starts at an odd byte
        rows = [0] + np.cumsum([int(codec.tokens[i]) for i in ids]).tolist()
        n = rows[-1]
        angles = torch.arange(n)[:, None] * torch.rand(d // 2).repeat(2)
        cos, sin = angles.cos(), angles.sin()
        for layer in range(L):
            tables, at, first = [], 1, 0
            for i, block, row in zip(ids, stored, rows):
                tables.append(codec.kernel_tables(i, layer, row, base=at, first=first))
                at, first = at + block.numel(), first + len(tables[-1][0])
            components, segments = (torch.cat(t) for t in zip(*tables))
            want = torch.cat([codec.decode_dense(i, block)[layer] for i, block in zip(ids, stored)], dim=2)  # [2, H, n, d]
            want[0] = apply_rope(want[0], cos, sin)
            for backend in backends:
                device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
                out = [torch.full((H, n, d), float("nan"), device=device) for _ in range(2)]
                reconstruct_bits_layer(data.to(device), components, segments, codec.channel_scale(layer).to(device),
                                       *out, cos.to(device), sin.to(device), backend=backend)
                scale = float(want.abs().max())
                torch.testing.assert_close(torch.stack(out).cpu(), want, rtol=1e-2, atol=1e-2 * scale)


def test_a_share_of_a_bits_store_reads_its_stored_bytes(tmp_path):
    """tools/bench_share_reads counts what a bits store's offsets count (bytes), and a share of a bits block is the
    whole block (its bytes are not laid out by layer): it once counted 1.7x the block bytes, as fp16 by layer."""
    import runpy
    from pathlib import Path
    tool = runpy.run_path(str(Path(__file__).resolve().parents[3] / "tools" / "bench_share_reads.py"), run_name="tool")
    path, layout, _ = bits_store(tmp_path)
    with MiloStore.open(path, tier="disk") as store:
        for layers, heads in ((range(2), range(2)), (range(1), range(2)), (range(2), range(1))):
            ranges = [r for b in (0, 2) for r in tool["share_ranges"](store, b, layers, heads)]
            assert tool["read_ranges"](store, ranges) == int(store.block_bytes([0, 2]).sum())
