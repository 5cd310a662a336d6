"""INT8 factors (uint8 segment bytes, docs/format.md) through `milo_kernels.reconstruct_layer`.

(a) the reference path on uint8 against an independent numpy dequantization + the fp32 reference;
(b) the fused Triton kernel against the uint8 reference on odd shapes. (b) needs CUDA or
TRITON_INTERPRET=1 set before triton is first used; `test_triton_int8_under_the_interpreter` reruns
this module in a subprocess with the interpreter on, so a plain `pytest tests` covers it on CPU.
"""
import os
from pathlib import Path

import pytest
import torch

from lowrank_cases import (check_outputs, nan_buffers, quantized_layer, rope_tables, run_under_interpreter,
                           target_mask)
from milo_kernels import reconstruct_layer, reconstruct_layer_naive
import numpy as np

from milo_store.codecs.quant import pack_segment

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"

# (kv_heads, d, tokens of each block): odd and even token counts (odd ones have an A padding row),
# a one-token block, blocks longer than a 16-row tile, GQA-style several kv heads
SHAPES = {
    "gqa3-odd-even": (3, 32, [1, 17, 30, 35]),
    "d64": (2, 64, [21, 40]),
}


def int8_layer(kv_heads, d, block_tokens, seed):
    """Packed INT8 segments of one layer, ranks d, 0, d-1, 1 and random (`quantized_layer`)."""
    extra = torch.randint(0, d + 1, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    return quantized_layer(kv_heads, d, block_tokens, "int8", seed, [d, 0, d - 1, 1] + extra)


@pytest.mark.parametrize("rank, tokens, d", [(0, 5, 16), (1, 1, 16), (7, 30, 32), (32, 33, 32)])
def test_int8_segment_takes_its_documented_bytes(rank, tokens, d):
    """r (T' + d + 10) bytes: fp16 Σ and four per-column scale rows, codes of A padded to even T, codes of B."""
    raw = pack_segment(torch.randn(tokens, rank), torch.rand(rank), torch.randn(d, rank))
    assert raw.numel() == rank * (tokens + tokens % 2 + d + 10)


def reference(factors, segments, kv_heads, n_rows, d, interleaved, dtype=torch.float32):
    cos, sin = rope_tables(n_rows, d, interleaved)
    want = nan_buffers(kv_heads, n_rows, d, dtype)
    reconstruct_layer_naive(factors, segments, *want, cos, sin, interleaved=interleaved)
    return want


# -- (a) the uint8 reference against an independent dequantization + the fp32 reference ---------

def dequantize_layer(raw, segments, d):
    """numpy, written from docs/format.md alone: fp32 segments (A, Σ, B) and the table re-pointed at them."""
    data, out, table, pos = raw.numpy(), [], segments.clone(), 0
    for i, (src, r, t) in enumerate(segments[:, :3].tolist()):
        header = np.frombuffer(data[src:src + 10 * r].tobytes(), dtype=np.float16).astype(np.float32).reshape(5, r)
        codes = data[src + 10 * r:src + r * (t + t % 2 + d + 10)].astype(np.float32)
        a = codes[:t * r].reshape(t, r) * header[1] + header[2]
        b = codes[(t + t % 2) * r:].reshape(d, r) * header[3] + header[4]
        out += [a.ravel(), header[0], b.ravel()]
        table[i, 0] = pos
        pos += r * (t + d + 1)
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0, np.float32)), table


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES)
def test_uint8_reference_matches_dequantize_layer(shape, interleaved):
    kv_heads, d, block_tokens = SHAPES[shape]
    raw, segments, n_rows = int8_layer(kv_heads, d, block_tokens, seed=1)
    got = reference(raw, segments, kv_heads, n_rows, d, interleaved)
    flat, table = dequantize_layer(raw, segments, d)
    want = reference(flat, table, kv_heads, n_rows, d, interleaved)
    check_outputs(got, want, target_mask(segments, kv_heads, n_rows, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES)
def test_public_entry_takes_uint8_on_cpu(shape, interleaved):
    """The CPU path (Σ folded into B, RoPE per block) against the reference: fp32 rounding apart."""
    kv_heads, d, block_tokens = SHAPES[shape]
    raw, segments, n_rows = int8_layer(kv_heads, d, block_tokens, seed=2)
    cos, sin = rope_tables(n_rows, d, interleaved=interleaved)
    got = nan_buffers(kv_heads, n_rows, d, torch.float32)
    reconstruct_layer(raw, segments, *got, cos, sin, interleaved=interleaved, backend="auto")
    want = reference(raw, segments, kv_heads, n_rows, d, interleaved, torch.float32)
    check_outputs(got, want, target_mask(segments, kv_heads, n_rows, d), atol=1e-4, rtol=1e-4)


def test_validation_uses_int8_segment_size():
    d, tokens, rank = 32, 5, 4
    cos, sin = rope_tables(tokens, d, interleaved=False)
    out = nan_buffers(1, tokens, d, torch.float32)
    seg = torch.tensor([[0, rank, tokens, 0, 0, 0]])
    raw = pack_segment(torch.randn(tokens, rank), torch.ones(rank), torch.randn(d, rank))
    reconstruct_layer(raw, seg, *out, cos, sin, backend="reference")  # exactly r (T' + d + 10) bytes: fine
    with pytest.raises(ValueError, match="past the end"):  # the fp layout's r (T + d + 1) would pass
        reconstruct_layer(raw[:rank * (tokens + d + 1)].clone(), seg, *out, cos, sin, backend="reference")
    with pytest.raises(ValueError, match="past the end"):
        reconstruct_layer(raw[:-2].clone(), seg, *out, cos, sin, backend="reference")
    with pytest.raises(ValueError, match="even"):
        reconstruct_layer(torch.cat((raw.new_zeros(1), raw, raw.new_zeros(1))), seg + torch.tensor([1, 0, 0, 0, 0, 0]),
                          *out, cos, sin, backend="reference")


# -- (b) the fused Triton kernel against the uint8 reference -------------------------------------

@needs_triton
@pytest.mark.parametrize("tiles", [{"block_t": 16, "block_r": 16}, {}], ids=["small", "default"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_int8_matches_reference(shape, interleaved, tiles):
    from milo_kernels.plan import plan_layer
    from milo_kernels.reconstruct import launch

    kv_heads, d, block_tokens = SHAPES[shape]
    raw, segments, n_rows = int8_layer(kv_heads, d, block_tokens, seed=3)
    want = reference(raw, segments, kv_heads, n_rows, d, interleaved)
    cos, sin = (t.to(DEVICE) for t in rope_tables(n_rows, d, interleaved))
    got = nan_buffers(kv_heads, n_rows, d, torch.float16, DEVICE)
    plan = plan_layer(raw.to(DEVICE), segments, *got, cos, sin, **tiles)
    assert plan.quantized
    launch(plan, raw.to(DEVICE), *got, cos, sin, interleaved=interleaved)
    check_outputs(got, want, target_mask(segments, kv_heads, n_rows, d), atol=2e-2, rtol=1e-2)


@needs_triton
def test_triton_public_entry_and_plan_kind():
    from milo_kernels.plan import plan_layer
    from milo_kernels.reconstruct import launch

    kv_heads, d, block_tokens = SHAPES["gqa3-odd-even"]
    raw, segments, n_rows = int8_layer(kv_heads, d, block_tokens, seed=4)
    want = reference(raw, segments, kv_heads, n_rows, d, False)
    cos, sin = (t.to(DEVICE) for t in rope_tables(n_rows, d, False))
    got = nan_buffers(kv_heads, n_rows, d, torch.float32, DEVICE)
    reconstruct_layer(raw.to(DEVICE), segments, *got, cos, sin, backend="triton")
    check_outputs(got, want, target_mask(segments, kv_heads, n_rows, d), atol=2e-2, rtol=1e-2)
    plan = plan_layer(raw.to(DEVICE), segments, *got, cos, sin)
    as_fp16 = torch.zeros(raw.numel(), dtype=torch.float16, device=DEVICE)  # long enough, wrong kind
    with pytest.raises(ValueError, match="do not match the plan"):
        launch(plan, as_fp16, *got, cos, sin)


@pytest.mark.skipif(INTERPRET or CUDA, reason="already interpreting in-process, or on a GPU")
def test_triton_int8_under_the_interpreter():
    pytest.importorskip("triton")
    assert " skipped" not in run_under_interpreter(__file__, "triton_int8_matches or triton_public")
