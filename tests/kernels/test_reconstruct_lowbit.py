"""INT4/INT2 layers (KIVI-style groups) through `milo_kernels.reconstruct_layer`.

(a) the CPU path (expanded to floating factors) against the reference on the dequantized factors;
(b) the fused Triton kernel (codes read in place) against the reference on odd shapes. (b) needs CUDA
or TRITON_INTERPRET=1 set before triton is first used; `test_triton_lowbit_under_the_interpreter`
reruns this module in a subprocess with the interpreter on, so a plain `pytest tests` covers it on CPU.
"""
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lowrank_cases import nan_buffers, quantized_layer, rope_tables, run_under_interpreter, target_mask
from milo_kernels import dequantize_lowbit_segment, reconstruct_layer, reconstruct_layer_naive
from milo_store import Layout
from milo_store.codecs.quant import pack_segment

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"

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
    segments = torch.from_numpy(layout.layer_segments(0, ranks, np.array(block_tokens), dst, starts))
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
    with pytest.raises(ValueError, match="past the end"):  # validated before the expansion
        reconstruct_layer(raw, segments, out, out.clone(), cos, sin, quant="int4")
    with pytest.raises(ValueError, match="unknown low-bit"):
        reconstruct_layer(raw, segments, out, out.clone(), cos, sin, quant="int3")


# -- (b) the fused Triton kernel against the reference ---------------------------------------------

# (kv_heads, d, tokens of each block): token counts that are not multiples of 32 (a key group) nor of
# BLOCK_T, one-token blocks, blocks spanning several tiles, several heads
SHAPES = {
    "d32-odd": (3, 32, [1, 31, 33, 70]),
    "d64-long": (2, 64, [95, 130]),
}


def lowbit_layer(kv_heads, d, block_tokens, quant, seed):
    """Packed INT4/INT2 segments of one layer, ranks 0, 1, 17, d and random (`quantized_layer`)."""
    extra = torch.randint(0, d + 1, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    return quantized_layer(kv_heads, d, block_tokens, quant, seed, [0, 1, 17, d] + extra)


@needs_triton
@pytest.mark.parametrize("tiles", [{"block_t": 16, "block_r": 16, "block_h": 16}, {}], ids=["small", "default"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("quant", ["int4", "int2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_lowbit_matches_reference(shape, quant, interleaved, tiles):
    from milo_kernels.plan import plan_layer
    from milo_kernels.reconstruct import launch

    kv_heads, d, block_tokens = SHAPES[shape]
    raw, segments, n_rows = lowbit_layer(kv_heads, d, block_tokens, quant, seed=5)
    cos, sin = rope_tables(n_rows, d, interleaved)
    want = nan_buffers(kv_heads, n_rows, d, torch.float32)
    # expansion to fp16 factors + the PyTorch oracle
    reconstruct_layer(raw, segments, *want, cos, sin, interleaved=interleaved, quant=quant, backend="reference")
    got = nan_buffers(kv_heads, n_rows, d, torch.float16, DEVICE)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    plan = plan_layer(raw.to(DEVICE), segments, *got, cos, sin, quant=quant, **tiles)
    assert plan.bits == {"int4": 4, "int2": 2}[quant]
    launch(plan, raw.to(DEVICE), *got, cos, sin, interleaved=interleaved)
    mask = target_mask(segments, kv_heads, n_rows, d)
    for kind in (0, 1):
        g, w, m = got[kind].float().cpu(), want[kind], mask[kind]
        assert w[m].isfinite().all(), "the reference itself produced non-finite targets"
        assert g[m].isfinite().all(), "a target element was not written (still NaN)"
        assert g[~m].isnan().all(), "an element outside every segment was written"
        torch.testing.assert_close(g[m], w[m], atol=2e-2, rtol=1e-2)  # fp16 staging of the tiles


@needs_triton
def test_triton_public_entry_takes_lowbit():
    kv_heads, d, block_tokens = SHAPES["d32-odd"]
    raw, segments, n_rows = lowbit_layer(kv_heads, d, block_tokens, "int4", seed=6)
    cos, sin = rope_tables(n_rows, d, False)
    got = nan_buffers(kv_heads, n_rows, d, torch.float32, DEVICE)
    reconstruct_layer(raw.to(DEVICE), segments, *got, cos.to(DEVICE), sin.to(DEVICE), quant="int4", backend="triton")
    want = nan_buffers(kv_heads, n_rows, d, torch.float32)
    reconstruct_layer(raw, segments, *want, cos, sin, quant="int4", backend="reference")
    mask = target_mask(segments, kv_heads, n_rows, d)
    for kind in (0, 1):
        torch.testing.assert_close(got[kind].cpu()[mask[kind]], want[kind][mask[kind]], atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="past the end"):  # validated against the INT4 sizes
        reconstruct_layer(raw[:-6].to(DEVICE), segments, *got, cos.to(DEVICE), sin.to(DEVICE), quant="int4",
                          backend="triton")


@pytest.mark.skipif(INTERPRET or CUDA, reason="already interpreting in-process, or on a GPU")
def test_triton_lowbit_under_the_interpreter():
    pytest.importorskip("triton")
    assert " skipped" not in run_under_interpreter(__file__, "triton_lowbit_matches or triton_public")
