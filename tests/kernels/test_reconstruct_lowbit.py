"""INT4/INT2 layers (KIVI-style groups) through `milo_kernels.reconstruct_layer`: expanded to floating
factors, then the same rebuild as any store; compared with the reference on the dequantized factors."""
import numpy as np
import pytest
import torch

from lowrank_cases import rope_tables
from milo_kernels import dequantize_lowbit_segment, reconstruct_layer, reconstruct_layer_naive
from milo_store import Layout
from milo_store.quant import pack_segment

BITS = {"int4": 4, "int2": 2}


@pytest.mark.parametrize("quant", ["int4", "int2"])
def test_reconstruct_lowbit_layer_equals_reference_on_dequantized_factors(quant):
    """A store-shaped layer: per-kind sizes at byte offsets, rank 0 and d included, odd token counts."""
    d, heads, block_tokens = 16, 2, [1, 33, 40]
    layout = Layout(1, heads, d, quant)
    g = torch.Generator().manual_seed(3)
    ranks = np.array([[[0, d], [1, 7]], [[d, 3], [5, 0]], [[2, 9], [d, 1]]])  # [blocks, kind, head]
    parts = []
    for t, block in zip(block_tokens, ranks):
        for kind in (0, 1):
            for head in range(heads):
                r = min(int(block[kind, head]), t)
                block[kind, head] = r
                A, S, B = torch.randn(t, r, generator=g), torch.rand(r, generator=g) + 0.5, torch.randn(d, r, generator=g)
                parts.append(pack_segment(A, S, B, quant, kind))
    factors = torch.cat(parts)
    dst = np.concatenate(([0], np.cumsum(block_tokens)[:-1]))
    starts = layout.block_offsets(ranks[:, None], np.array(block_tokens))[:-1]
    segments = torch.from_numpy(layout.layer_segments(ranks, np.array(block_tokens), dst, starts))
    n = sum(block_tokens)
    cos, sin = rope_tables(n, d, False)
    out_k, out_v = (torch.full((heads, n, d), float("nan")) for _ in range(2))
    reconstruct_layer(factors, segments, out_k, out_v, cos, sin, quant=quant)
    ref_k, ref_v = (torch.full((heads, n, d), float("nan")) for _ in range(2))
    floats, table = [], segments.clone()
    at = 0
    for i, (src, r, t, _, _, kind) in enumerate(segments.tolist()):
        table[i, 0] = at
        if r:
            a, s, b = dequantize_lowbit_segment(factors[src:], r, t, d, BITS[quant], kind)
            floats += [a.reshape(-1), s, b.reshape(-1)]
            at += r * (t + d + 1)
    reconstruct_layer_naive(torch.cat(floats), table, ref_k, ref_v, cos, sin)
    assert torch.allclose(out_k, ref_k, atol=2e-2, rtol=1e-2, equal_nan=True)  # fp16 staging of factors
    assert torch.allclose(out_v, ref_v, atol=2e-2, rtol=1e-2, equal_nan=True)
    assert out_k.isfinite().all() and out_v.isfinite().all()  # every row of every head was written


def test_reconstruct_lowbit_rejects_out_of_range_segments():
    d = 8
    raw = pack_segment(torch.randn(10, 2), torch.ones(2), torch.randn(d, 2), "int4", 0)
    segments = torch.tensor([[2, 2, 10, 0, 0, 0]])  # starts 2 bytes in: runs past the end
    cos, sin = rope_tables(10, d, False)
    out = torch.zeros(1, 10, d)
    with pytest.raises(ValueError, match="int4 bytes"):
        reconstruct_layer(raw, segments, out, out.clone(), cos, sin, quant="int4")
    with pytest.raises(ValueError, match="unknown low-bit"):
        reconstruct_layer(raw, segments, out, out.clone(), cos, sin, quant="int3")


def test_the_kernel_plan_refuses_low_bit_factors():
    from milo_kernels.reconstruct import plan_layer
    raw = pack_segment(torch.randn(10, 2), torch.ones(2), torch.randn(8, 2), "int4", 0)
    cos, sin = rope_tables(10, 8, False)
    out = torch.zeros(1, 10, 8)
    with pytest.raises(ValueError, match="expands int4 layers"):
        plan_layer(raw, torch.tensor([[0, 2, 10, 0, 0, 0]]), out, out.clone(), cos, sin, quant="int4")
