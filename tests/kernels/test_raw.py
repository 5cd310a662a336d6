"""Raw segments (rank RAW_RANK: a unit's K or V itself, docs/format.md "Raw segments") in every backend.

(a) sizes against the store's, the CPU path and the reference: floating X comes back exactly (keys
rotated), INT8/INT4/INT2 within their quantization error, layers mixing raw and low-rank segments
agree between the two paths, bad rows are refused; (b) the fused Triton kernel against the reference
on mixed layers. (b) needs CUDA or TRITON_INTERPRET=1 set before triton is first used;
`test_triton_raw_under_the_interpreter` reruns this module in a subprocess with the interpreter on.
"""
import math
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowrank_cases import (check_outputs, nan_buffers, quantized_layer, random_layer, rope_by_complex,
                           rope_tables, run_under_interpreter, target_mask)
from milo_format import QUANT_BITS, segment_size
from milo_kernels import RAW_RANK, decode_layer, reconstruct_layer, reconstruct_layer_naive
from milo_kernels.cpu import rope
from milo_store import Layout
from milo_store.codecs.quant import pack_raw_segment, roundtrip

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"
TOP = {"int8": 255, "int4": 15, "int2": 3}
FLOATING = {"fp16": torch.float16, "fp32": torch.float32}


def group_bounds(x, quant, kind):
    """Each element's quantization group minimum and span: INT8 per channel; INT4/INT2 keys per channel
    and 32 tokens, values per token (docs/format.md)."""
    if quant == "int8":
        lo, hi = x.min(0, keepdim=True).values, x.max(0, keepdim=True).values
    elif kind == 0:
        group = torch.arange(len(x)) // 32
        lo = torch.stack([x[group == g].min(0).values for g in range(int(group[-1]) + 1)])[group]
        hi = torch.stack([x[group == g].max(0).values for g in range(int(group[-1]) + 1)])[group]
    else:
        lo, hi = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
    return lo.expand_as(x), (hi - lo).expand_as(x)


def identity_rope(n, d):
    """cos = 1, sin = 0: keys come back unrotated, so a key's output is its dequantized X."""
    return torch.ones(n, d), torch.zeros(n, d)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 70), st.sampled_from([2, 16, 64]), st.sampled_from(["int8", "int4", "int2"]),
       st.integers(0, 1), st.integers(0, 2**16))
def test_raw_quantized_size_and_error(tokens, d, quant, kind, seed):
    """Sizes agree with the writer's and the store layout's; the CPU path's X is within half a step of
    its group's grid, plus the fp16 rounding of scale, minimum (and the INT4/INT2 fp16 expansion)."""
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(seed)) * 3
    packed = pack_raw_segment(x, quant, kind)
    bits = QUANT_BITS[quant]
    size = segment_size(RAW_RANK, tokens, d, bits, kind)
    assert packed.numel() == size == int(Layout(1, 1, d, quant).raw_size(tokens, kind)) and size % 2 == 0
    ranks = torch.tensor([RAW_RANK, 0, 3, RAW_RANK])
    elementwise = segment_size(ranks, torch.full((4,), tokens), d, bits, torch.tensor([kind, kind, kind, 1 - kind]))
    assert elementwise.tolist() == [size, 0, segment_size(3, tokens, d, bits, kind),
                                    segment_size(RAW_RANK, tokens, d, bits, 1 - kind)]
    out = nan_buffers(1, tokens, d, torch.float32)
    reconstruct_layer(packed, torch.tensor([[0, RAW_RANK, tokens, 0, 0, kind]]), *out, *identity_rope(tokens, d),
                      quant=quant)
    lo, span = group_bounds(x, quant, kind)
    bound = span / (2 * TOP[quant]) + (span + lo.abs()) * 2 ** -10 + 1e-6
    assert bool(((out[kind][0] - x).abs() <= bound).all())
    # what the frontier allocator measures as this raw form's error is what a reader gets back
    assert torch.allclose(out[kind][0], roundtrip(x, quant, kind), rtol=2 ** -10, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "reference"])  # on CPU tensors "auto" is the CPU path
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_raw_fp16_comes_back_exactly(backend, interleaved):
    """A raw fp16 value is X bit for bit (signed zeros too); a raw key is RoPE(X) within fp32 rounding."""
    got_v, got_k, x, want_k = raw_round_trip(interleaved, "cpu", backend)
    assert torch.equal(got_v.view(torch.int16), x.view(torch.int16))
    torch.testing.assert_close(got_k.double(), want_k, atol=1e-5, rtol=1e-5)


def raw_round_trip(interleaved, device, backend, tokens=33, d=32, first=3):
    """(value output fp16, key output fp32, X fp16, an independent RoPE of X) of one raw segment of X
    rebuilt as a value and as a key at rows [first, first + tokens), outputs NaN elsewhere."""
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(7)).half()
    x[0, :3] = -0.0
    factors = torch.cat((torch.full((5,), math.nan, dtype=torch.float16), x.flatten())).to(device)
    n, rows = first + tokens + 2, slice(first, first + tokens)
    cos, sin = (t.to(device) for t in rope_tables(n, d, interleaved))
    got = {}
    for kind, dtype in ((1, torch.float16), (0, torch.float32)):
        out = nan_buffers(1, n, d, dtype, device)
        reconstruct_layer(factors, torch.tensor([[5, RAW_RANK, tokens, first, 0, kind]]), *out, cos, sin,
                          interleaved=interleaved, backend=backend)
        outside = torch.cat((out[kind][0, :first], out[kind][0, rows.stop:], out[1 - kind].flatten(0, 1)))
        assert outside.isnan().all()
        got[kind] = out[kind][0, rows].cpu()
    return got[1], got[0], x, rope_by_complex(x.double(), first, interleaved)


def mixed_layer(factor, kv_heads, d, block_tokens, seed):
    """(factors, segments, N, quant) of one layer with raw and low-rank keys and values: floating from
    `random_layer` (a NaN gap before every segment), quantized from `quantized_layer` (random bytes)."""
    if factor in FLOATING:
        factors, segments, n = random_layer(kv_heads, d, block_tokens, FLOATING[factor], seed, raw=True)
        quant = None
    else:
        pool = [RAW_RANK, 0, 1, d, RAW_RANK, 17] + torch.randint(0, d + 1, (5,), generator=torch.Generator()
                                                                 .manual_seed(seed)).tolist()
        factors, segments, n = quantized_layer(kv_heads, d, block_tokens, factor, seed, pool)
        quant = factor
    kinds = {(kind, rank == RAW_RANK) for kind, rank in zip(segments[:, 5].tolist(), segments[:, 1].tolist())}
    assert kinds == {(0, False), (0, True), (1, False), (1, True)}, "raw and low-rank keys and values expected"
    return factors, segments, n, quant


def reference(factors, segments, kv_heads, n, d, interleaved, quant):
    """The PyTorch oracle's output (INT4/INT2 expanded to fp16 factors first), fp32."""
    want = nan_buffers(kv_heads, n, d, torch.float32)
    reconstruct_layer(factors, segments, *want, *rope_tables(n, d, interleaved), interleaved=interleaved, quant=quant,
                      backend="reference")
    return want


@pytest.mark.parametrize("factor", ["fp32", "fp16", "int8", "int4", "int2"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_cpu_path_matches_reference_on_mixed_layers(factor, interleaved):
    kv_heads, d, block_tokens = 3, 32, [1, 31, 33, 65]
    factors, segments, n, quant = mixed_layer(factor, kv_heads, d, block_tokens, seed=11)
    want = reference(factors, segments, kv_heads, n, d, interleaved, quant)
    got = nan_buffers(kv_heads, n, d, torch.float32)
    reconstruct_layer(factors, segments, *got, *rope_tables(n, d, interleaved), interleaved=interleaved, quant=quant,
                      backend="auto")
    check_outputs(got, want, target_mask(segments, kv_heads, n, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("factor", ["fp32", "fp16", "int8", "int4", "int2"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_a_decoded_layer_rotated_afterwards_is_the_cpu_path_to_the_bit(factor, interleaved):
    """`decode_layer` (keys unrotated) then `rope` at each block's rows: what a rebuild that decodes a block once for
    several rows writes must be the CPU path's output exactly, not within a tolerance."""
    kv_heads, d, block_tokens = 3, 32, [1, 31, 33, 65]
    factors, segments, n, quant = mixed_layer(factor, kv_heads, d, block_tokens, seed=11)
    cos, sin = rope_tables(n, d, interleaved)
    want = nan_buffers(kv_heads, n, d, torch.float32)
    reconstruct_layer(factors, segments, *want, cos, sin, interleaved=interleaved, quant=quant, backend="auto")
    got = nan_buffers(kv_heads, n, d, torch.float32)
    decode_layer(factors, segments, *got, quant=quant)
    assert not torch.equal(got[0], want[0])  # keys unrotated, so far
    for dst, tokens in {(dst, tokens) for _, _, tokens, dst, _, kind in segments.tolist() if kind == 0}:
        rows = slice(dst, dst + tokens)
        rope(got[0][:, rows].clone(), cos[rows], sin[rows], interleaved, out=got[0][:, rows])
    mask = target_mask(segments, kv_heads, n, d)
    assert all(torch.equal(g[m], w[m]) for g, w, m in zip(got, want, mask))
    with pytest.raises(TypeError, match="fp32"):
        decode_layer(factors, segments, *nan_buffers(kv_heads, n, d, torch.float16), quant=quant)


def test_bf16_raw_segment_on_cpu():
    x = torch.randn(5, 8).bfloat16()
    out = nan_buffers(1, 5, 8, torch.bfloat16)
    reconstruct_layer(x.flatten(), torch.tensor([[0, RAW_RANK, 5, 0, 0, 1]]), *out, *rope_tables(5, 8, False))
    assert torch.equal(out[1][0], x)


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_raw_rows_are_validated(backend, quant):
    """Rank -2 is neither raw nor a rank; a raw segment's bytes must fit in the factors."""
    tokens, d = 5, 8
    x = torch.randn(tokens, d)
    factors = x.flatten() if quant is None else pack_raw_segment(x, quant, 0)
    out = nan_buffers(1, tokens, d, torch.float32)
    cos, sin = rope_tables(tokens, d, False)
    reconstruct_layer(factors, torch.tensor([[0, RAW_RANK, tokens, 0, 0, 0]]), *out, cos, sin, quant=quant,
                      backend=backend)
    with pytest.raises(ValueError, match=r"rank must be in \[0, d=8\] or -1 \(raw\)"):
        reconstruct_layer(factors, torch.tensor([[0, -2, tokens, 0, 0, 0]]), *out, cos, sin, quant=quant,
                          backend=backend)
    with pytest.raises(ValueError, match="reads past the end of factors"):
        reconstruct_layer(factors[:-2].clone(), torch.tensor([[0, RAW_RANK, tokens, 0, 0, 0]]), *out, cos, sin,
                          quant=quant, backend=backend)


def test_plans_count_raw_sizes():
    """plan_layers (no buffers yet) bounds factors by the raw sizes and refuses rank -2 too."""
    pytest.importorskip("triton")
    from milo_kernels.plan import plan_layers

    d = 16
    segments = torch.tensor([[[0, RAW_RANK, 5, 0, 0, 0], [50, 2, 3, 0, 0, 1]],
                             [[10, 1, 4, 0, 0, 1], [20, RAW_RANK, 7, 0, 1, 0]]])
    floating = plan_layers(segments, d, factor_dtype=torch.float16, device="cpu")
    assert [p.need_numel for p in floating] == [max(5 * d, 50 + 2 * (3 + d + 1)), 20 + 7 * d]
    int4 = plan_layers(segments * torch.tensor([2, 1, 1, 1, 1, 1]), d, factor_dtype=torch.uint8, device="cpu",
                       quant="int4")
    assert int4[1].need_numel == 40 + segment_size(RAW_RANK, 7, d, 4, 0)
    with pytest.raises(ValueError, match="or -1"):
        plan_layers(segments - torch.tensor([0, 1, 0, 0, 0, 0]), d, factor_dtype=torch.float16, device="cpu")


# -- (b) the fused Triton kernel against the reference ---------------------------------------------

# 2 kv heads, d 64, token counts 1, 31, 33 and 65 (not multiples of a 32-token group nor of BLOCK_T);
# rotate-half runs 16-token, 16-pair tiles (two programs across the channels), interleaved the defaults
MIXED = (2, 64, [1, 31, 33, 65])
TILES = {False: {"block_t": 16, "block_r": 16, "block_h": 16}, True: {}}


@needs_triton
@pytest.mark.parametrize("factor", ["fp32", "fp16", "int8", "int4", "int2"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-small", "interleaved-default"])
def test_triton_raw_mixed_layer_matches_reference(factor, interleaved):
    from milo_kernels.plan import plan_layer
    from milo_kernels.reconstruct import launch

    kv_heads, d, block_tokens = MIXED
    factors, segments, n, quant = mixed_layer(factor, kv_heads, d, block_tokens, seed=12)
    want = reference(factors, segments, kv_heads, n, d, interleaved, quant)
    out_dtype = torch.float32 if factor == "fp32" else torch.float16
    got = nan_buffers(kv_heads, n, d, out_dtype, DEVICE)
    cos, sin = (t.to(DEVICE) for t in rope_tables(n, d, interleaved))
    plan = plan_layer(factors.to(DEVICE), segments, *got, cos, sin, quant=quant, **TILES[interleaved])
    launch(plan, factors.to(DEVICE), *got, cos, sin, interleaved=interleaved)
    atol, rtol = (1e-4, 1e-4) if factor == "fp32" else (2e-2, 1e-2)  # fp16 tiles and outputs
    check_outputs(got, want, target_mask(segments, kv_heads, n, d), atol, rtol)


@needs_triton
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_triton_raw_fp16_comes_back_exactly(interleaved):
    got_v, got_k, x, want_k = raw_round_trip(interleaved, DEVICE, "triton")
    assert torch.equal(got_v.view(torch.int16), x.view(torch.int16))
    torch.testing.assert_close(got_k.double(), want_k, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRET or CUDA, reason="already interpreting in-process, or on a GPU")
def test_triton_raw_under_the_interpreter():
    pytest.importorskip("triton")
    assert " skipped" not in run_under_interpreter(__file__, "triton_raw_mixed or triton_raw_fp16")
