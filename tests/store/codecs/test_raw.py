"""Raw units (docs/format.md, "Raw segments") and the frontier policy that chooses them per unit."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_store import MiloStore
from milo_store.report import block_rows, describe
from milo_store.codecs.allocation import allocate_ranks
from milo_store.codecs.lowrank import factorize_block, measured_losses, pack_block
from milo_store.codecs.planning import CompressionConfig
from milo_store.format import FORMAT_VERSION
from milo_store.layout import RAW_RANK, Layout, compressed_bytes
from milo_store.codecs.quant import pack_raw_segment, roundtrip
from milo_store.synthetic import build_synthetic_store

DTYPES = ["float16", "int8", "int4", "int2"]


def layout_for(dtype, L=1, H=1, d=16):
    return Layout(L, H, d, quant=None if dtype.startswith("float") else dtype)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 70), st.sampled_from([8, 16, 64]), st.sampled_from(DTYPES[1:]), st.integers(0, 1),
       st.integers(0, 2**16))
def test_raw_segment_size_matches_layout(T, d, dtype, kind, seed):
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(seed))
    assert pack_raw_segment(x, dtype, kind).numel() == layout_for(dtype, d=d).raw_size(T, kind)


def test_fp16_raw_block_round_trips_exactly(tmp_path):
    """A block whose units are all raw holds each unit's K or V itself: fp16 bytes equal X.half()."""
    layout = Layout(2, 2, 16)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 37, 16, generator=g), torch.randn(2, 2, 37, 16, generator=g)
    f = factorize_block(keys, values)
    ranks = np.full((2, 2, 2), RAW_RANK)
    ranks[1, 0, 1] = 5  # one factored unit among raw ones
    flat = pack_block(f, ranks, "float16")
    sizes = layout.segment_sizes(ranks[None], np.array([37]))[0]
    assert flat.numel() == sizes.sum()
    x = torch.stack((keys, values), dim=1)
    at = 0
    for idx in np.ndindex(2, 2, 2):
        size = int(sizes[idx])
        if ranks[idx] == RAW_RANK:
            expect = (f.A[idx] * f.S[idx]) @ f.B[idx].T  # what the writer stores: X from its full-rank factors
            assert torch.equal(flat[at:at + size], expect.half().reshape(-1))
            assert torch.allclose(flat[at:at + size].float().view(37, 16), x[idx], atol=2e-3)
        at += size


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_raw_error_is_measured_on_what_is_written(dtype):
    """measured_losses' raw error is the error of the quantizer pack_raw_segment uses (roundtrip)."""
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 1, 45, 16, generator=g), torch.randn(1, 1, 45, 16, generator=g)
    f = factorize_block(keys, values)
    loss, raw_error = measured_losses(f, dtype)
    for kind, x in enumerate((keys[0, 0], values[0, 0])):
        direct = (roundtrip(x, dtype, kind) - x).pow(2).sum()
        assert raw_error[0, kind, 0] == pytest.approx(float(direct), rel=1e-3)
    assert (loss > 0).all() and (loss < 1).all()
    assert raw_error[0, 0, 0] > 0


def frontier(spectra, loss, raw_error, tokens, layout, ratio, **kw):
    return allocate_ranks(spectra, tokens, layout, ratio, policy="frontier", loss=loss, raw_error=raw_error,
                          bytes_per_value=1 if layout.quantized else 2, **kw)


def test_flat_spectrum_goes_raw_and_low_rank_stays_factored():
    """One group (one layer, kind, head) of two blocks: a flat spectrum (noise) and a rank-2 one."""
    layout = Layout(1, 1, 16, quant="int8")
    g = torch.Generator().manual_seed(2)
    flat = torch.randn(1, 1, 256, 16, generator=g)
    low = torch.randn(1, 1, 256, 2, generator=g) @ torch.randn(1, 1, 2, 16, generator=g)
    spectra, loss, raw_error = [], [], []
    for x in (flat, low):
        f = factorize_block(x, x)
        l, e = measured_losses(f, "int8")
        spectra.append(f.S.numpy()), loss.append(l.numpy()), raw_error.append(e.numpy())
    ranks = frontier(np.stack(spectra), np.stack(loss), np.stack(raw_error), np.array([256, 256]), layout, 0.5)
    assert ranks[0, 0, 0, 0] == RAW_RANK and ranks[0, 0, 1, 0] == RAW_RANK
    assert ranks[1, 0, 0, 0] >= 2 and ranks[1, 0, 1, 0] >= 2
    acc = compressed_bytes(layout, ranks, np.array([256, 256]), 1)
    assert acc["total_bytes"] <= 0.5 * acc["full_fp16_bytes"]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 2), st.sampled_from(DTYPES), st.floats(0.02, 0.9),
       st.sampled_from(["head", "layer", "global"]), st.integers(0, 1), st.floats(0.0, 1.5), st.integers(0, 2**16))
def test_frontier_budget_and_bounds_hold(N, H, dtype, ratio, scope, r_min, max_loss, seed):
    """Losses up to 1.5 bend ladders and kill rungs (query-aware weights can do that); budget still holds."""
    rng = np.random.default_rng(seed)
    d = 16
    layout = layout_for(dtype, L=2, H=H, d=d)
    tokens = rng.integers(20, 300, N)
    spectra = np.sort(rng.random((N, 2, 2, H, d)) ** rng.integers(1, 8), axis=-1)[..., ::-1] * 10
    loss = rng.random(spectra.shape) * max_loss
    raw_error = (spectra ** 2).sum(-1) * rng.random(spectra.shape[:4]) * 0.3
    try:
        ranks = frontier(spectra, loss, raw_error, tokens, layout, ratio, scope=scope, r_min=r_min)
    except ValueError:  # BudgetError: rank r_min everywhere does not fit this ratio
        return
    factored = ranks != RAW_RANK
    assert (ranks[factored] >= r_min).all()
    assert (ranks <= np.minimum(tokens, d).reshape(-1, 1, 1, 1)).all()
    acc = compressed_bytes(layout, ranks, tokens, 1 if layout.quantized else 2)
    assert acc["total_bytes"] <= ratio * acc["full_fp16_bytes"] + 1e-6


def test_frontier_takes_a_units_steps_in_order_when_losses_bend_its_ladder():
    """An INT4 value unit whose first direction loses half to quantization: its second step is worth more
    per byte, but only after the first, which carries the per-token scales. Too little budget for
    those scales: rank 0, as energy gives."""
    layout = Layout(1, 1, 16, quant="int4")
    spectra = np.zeros((1, 1, 2, 1, 16))
    spectra[0, 0, 1, 0] = np.sqrt(np.linspace(1, 0.5, 16))
    loss = np.zeros_like(spectra)
    loss[0, 0, 1, 0, 0] = 0.5
    never_raw = (spectra ** 2).sum(-1) * 10
    for ratio in np.linspace(0.02, 0.2, 37):
        ranks = frontier(spectra, loss, never_raw, np.array([64]), layout, ratio, r_min=0)
        acc = compressed_bytes(layout, ranks, np.array([64]), 1)
        assert acc["total_bytes"] <= ratio * acc["full_fp16_bytes"]


def test_a_rung_that_removes_nothing_ends_the_ladder():
    """Quantizing direction 2 loses more than its σ² (loss 1.5): the ladder stops at rank 2, and the raw
    step is priced from a rung the unit can reach."""
    layout = Layout(1, 1, 16)
    s2 = np.array([1000, 900, 800, 700, 600, 5, 4, 3, 2, 1, 1, 1, 1, 1, 1, 1], float)
    spectra = np.sqrt(np.broadcast_to(s2, (1, 1, 2, 1, 16))).copy()
    loss = np.zeros_like(spectra)
    loss[..., 2] = 1.5
    for ratio in np.linspace(0.3, 1.0, 71):
        ranks = frontier(spectra, loss, np.zeros((1, 1, 2, 1)), np.array([64]), layout, ratio)
        acc = compressed_bytes(layout, ranks, np.array([64]))
        assert acc["total_bytes"] <= ratio * acc["full_fp16_bytes"] + 1e-6
        assert ((ranks == RAW_RANK) | (ranks <= 2)).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.floats(0.1, 0.9), st.integers(0, 2**16))
def test_frontier_without_a_useful_raw_form_is_the_energy_policy(N, ratio, seed):
    """Raw forms that remove no more error than rank 1 and lossless factors: frontier = energy."""
    rng = np.random.default_rng(seed)
    layout = Layout(2, 2, 16)
    tokens = rng.integers(20, 300, N)
    spectra = np.sort(rng.random((N, 2, 2, 2, 16)), axis=-1)[..., ::-1] * 10
    raw_error = (spectra ** 2).sum(-1)  # the raw form is as bad as storing nothing
    ranks = frontier(spectra, np.zeros_like(spectra), raw_error, tokens, layout, ratio, r_min=0)
    assert np.array_equal(ranks, allocate_ranks(spectra, tokens, layout, ratio, policy="energy", r_min=0))


def test_frontier_store_mounts_as_version_2_and_reads_back(tmp_path):
    """A synthetic store whose values are near full rank at INT8: some units go raw, the store says so."""
    layout = Layout(2, 2, 16)
    config = CompressionConfig(ratio=0.5, dtype="int8", policy="frontier")
    path = build_synthetic_store(tmp_path / "s", layout, [300, 200, 257], config, seed=3)
    with MiloStore.open(path, tier="disk") as store:
        assert store.meta["format_version"] == FORMAT_VERSION
        raw = store.ranks == RAW_RANK
        assert raw.any() and not raw.all()
        acc = store.accounting()
        assert acc["ratio"] <= 0.5 and acc["disk_bytes"] >= acc["factor_bytes"]
        assert not store.verify_all()
        info, rows = describe(store), block_rows(store)
    share = np.array([info["raw_share_per_layer"][kind] for kind in ("key", "value")]).T  # [L, 2]
    assert np.allclose(share, raw.mean(axis=(0, 3)), atol=1e-4)  # rounded to 4 places
    assert sum(r["key_rank"]["raw"] + r["value_rank"]["raw"] for r in rows) == raw.sum()
    assert all(sum(h) == 3 * 2 - raw[:, l, k].sum()  # histograms count the factored units only
               for k, kind in enumerate(("key", "value")) for l, h in enumerate(info["rank_histogram_per_layer"][kind]))
    plain = build_synthetic_store(tmp_path / "p", layout, [300, 200, 257], CompressionConfig(ratio=0.5, dtype="int8"))
    with MiloStore.open(plain, tier="disk") as store:
        assert store.meta["format_version"] == FORMAT_VERSION and (store.ranks >= 0).all()


def test_frontier_applies_to_block_svd_only():
    with pytest.raises(ValueError, match="frontier"):
        CompressionConfig(codec="global-proj", policy="frontier")
    with pytest.raises(ValueError, match="frontier"):
        allocate_ranks(np.ones((1, 1, 2, 1, 4)), np.array([8]), Layout(1, 1, 4), 0.5, policy="frontier")


@pytest.mark.parametrize("dtype, kind, tolerance", [("int8", 0, 0.05), ("int8", 1, 0.05), ("int4", 0, 0.05),
                                                     ("int4", 1, 0.15)])
def test_measured_losses_predict_the_written_weighted_error(dtype, kind, tolerance):
    """Query-aware (B stored as diag(1/s) B): at rank r the allocator's prediction, the tail energy plus
    each kept direction's σ² times its measured loss, matches the weighted error of what the writer
    packs and a reader rebuilds. INT4 values are looser: their per-token groups are measured at full
    rank, where a token's range spans all d columns."""
    from milo_kernels.lowbit import dequantize_lowbit_segment
    from milo_kernels.naive import dequantize_int8_segment
    from milo_store.codecs.baselines import unweigh, weigh
    from milo_store.codecs.quant import pack_segment

    g = torch.Generator().manual_seed(4)
    T, d = 200, 32
    x = (torch.randn(1, 1, T, d, generator=g) * torch.exp(-0.1 * torch.arange(d))) @ torch.linalg.qr(
        torch.randn(d, d, generator=g))[0]
    scale = torch.rand(1, 2, 1, d, generator=g) * 0.95 + 0.05
    f = unweigh(factorize_block(*weigh(torch.stack((x, x), 1), scale).unbind(1)), scale)
    loss, _ = measured_losses(f, dtype, scale)
    s2, w = f.S[0, kind, 0].double() ** 2, scale[0, kind, 0]
    for r in (d // 2, d):
        predicted = float(s2[r:].sum() + (s2[:r] * loss[0, kind, 0, :r]).sum())
        packed = pack_segment(f.A[0, kind, 0][:, :r], f.S[0, kind, 0][:r], f.B[0, kind, 0][:, :r], dtype, kind)
        a, s, b = (dequantize_int8_segment(packed, r, T, d) if dtype == "int8"
                   else dequantize_lowbit_segment(packed, r, T, d, 4, kind))
        written = float((((a * s) @ b.T - x[0, 0]) * w).double().pow(2).sum())
        assert written == pytest.approx(predicted, rel=tolerance)
