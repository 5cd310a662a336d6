"""INT4/INT2 factors (KIVI-style scale spans): packing, sizes, error bounds, stores and reconstruction."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_format import SCALE_SPAN, segment_size
from milo_kernels import dequantize_lowbit_segment
from milo_store import CompressionConfig, Layout, MiloStore
from milo_store.codecs.allocation import BudgetError, allocate_ranks
from milo_store.codecs.planning import check_budget, quant_layout
from milo_store.layout import compressed_bytes
from milo_store.codecs.quant import pack_segment
from milo_store.synthetic import build_synthetic_store

BITS = {"int4": 4, "int2": 2}


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 100), st.sampled_from([8, 16, 64]), st.integers(0, 64), st.sampled_from(["int4", "int2"]),
       st.integers(0, 1), st.integers(0, 2**16))
def test_lowbit_segment_size_and_error_bound(T, d, r, quant, kind, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(T, max(r, 1), generator=g)[:, :min(r, T)]
    r = A.shape[1]
    S = torch.rand(r, generator=g) + 0.1
    B = torch.randn(d, r, generator=g)
    raw = pack_segment(A, S, B, quant, kind)
    bits = BITS[quant]
    layout = Layout(1, 1, d, quant)
    size = int(r * layout.unit_size(T, kind) + (r > 0) * layout.fixed_size(T, kind))
    assert raw.numel() == size == segment_size(r, T, d, bits, kind)
    assert raw.numel() % 2 == 0  # the next segment's fp16 header stays aligned
    if r == 0:
        return
    a, s, b = dequantize_lowbit_segment(raw, r, T, d, bits, kind)
    assert torch.equal(s, S.half().float())
    # every element is within half a step of its span's grid, plus fp16 rounding of scale and minimum
    if kind == 0:  # per column, spans of SCALE_SPAN tokens
        idx = torch.arange(T) // SCALE_SPAN
        lo = torch.stack([A[idx == i].min(0).values for i in range(int(idx.max()) + 1)])[idx]
        hi = torch.stack([A[idx == i].max(0).values for i in range(int(idx.max()) + 1)])[idx]
    else:  # per token
        lo, hi = A.min(1, keepdim=True).values, A.max(1, keepdim=True).values
    span = hi - lo
    bound = span / (2 * (2 ** bits - 1)) + (span + lo.abs()) * 2 ** -10 + 1e-6
    assert bool(((a - A).abs() <= bound).all())
    b_span = (B.max(0).values - B.min(0).values)
    assert bool(((b - B).abs() <= b_span / 510 + (b_span + B.abs().max(0).values) * 2 ** -10 + 1e-6).all())


@pytest.mark.parametrize("quant", ["int4", "int2"])
def test_lowbit_store_meets_ratio_and_verifies(tmp_path, quant):
    layout = Layout(2, 2, 32)
    tokens = [90, 121, 70]
    int8 = MiloStore.open(build_synthetic_store(tmp_path / "q8", layout, tokens, CompressionConfig(ratio=0.25, dtype="int8")))
    low = MiloStore.open(build_synthetic_store(tmp_path / quant, layout, tokens, CompressionConfig(ratio=0.25, dtype=quant)))
    assert low.layout.quant == quant and low.dtype == quant and low.verify_all() == []
    acc = low.accounting()
    assert acc["ratio"] <= 0.25 and abs(acc["ratio"] - 0.25) < 0.03
    assert low.ranks.mean() > 1.2 * int8.ranks.mean()  # fewer bits per code buy rank
    assert low.anchor_kv().dtype == torch.float16


def test_lowbit_r_min_that_does_not_fit_is_refused_before_writing(tmp_path):
    with pytest.raises(BudgetError, match="per-token value scales"):  # they alone exceed a tiny budget
        build_synthetic_store(tmp_path / "s", Layout(1, 1, 32), [64, 64], CompressionConfig(ratio=0.02, dtype="int2"))
    assert not (tmp_path / "s").exists()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["int8", "int4", "int2", "float16"]), st.sampled_from(["head", "layer", "global"]),
       st.sampled_from([0.3, 0.5, 0.7]), st.floats(0.01, 0.5), st.integers(0, 2),
       st.lists(st.integers(40, 900), min_size=1, max_size=4))
def test_check_budget_agrees_with_the_allocation_of_every_pool(dtype, scope, key_share, ratio, r_min, tokens):
    """check_budget (before encoding) refuses exactly what pass two would refuse, and what both accept
    never exceeds the ratio: per-pool budgets, the K/V share and per-token scales included."""
    layout = Layout(2, 2, 64)
    config = CompressionConfig(ratio=ratio, dtype=dtype, scope=scope, key_share=key_share, r_min=r_min)
    spectra = np.random.default_rng(len(tokens)).random((len(tokens), 2, 2, 2, 64))[..., ::-1].cumsum(-1)[..., ::-1]
    qlayout = quant_layout(layout, dtype)
    itemsize = 1 if qlayout.quantized else 2
    try:
        check_budget(layout, tokens, config)
    except BudgetError:
        with pytest.raises(BudgetError):
            allocate_ranks(spectra, np.array(tokens), qlayout, ratio, scope=scope, key_share=key_share, r_min=r_min,
                           bytes_per_value=itemsize)
        return
    ranks = allocate_ranks(spectra, np.array(tokens), qlayout, ratio, scope=scope, key_share=key_share,
                           r_min=r_min, bytes_per_value=itemsize)
    assert compressed_bytes(qlayout, ranks, np.array(tokens), itemsize)["ratio"] <= ratio + 1e-9
