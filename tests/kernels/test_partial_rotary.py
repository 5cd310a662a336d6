"""Rotate-half partial rotary (GLM-4.5, MiniMax-M2, Phi-2, StableLM, Nemotron: pairs (j, j + rotary_dim/2) over the
first rotary_dim channels, the rest unturned) in every rebuild path: the reference against RoPE written as complex
multiplication, the CPU paths and both Triton kernels against the reference, on odd shapes and widths.

The Triton tests run on CUDA tensors when a GPU is present; without one, `test_partial_kernels_under_the_interpreter`
runs them again in a subprocess under TRITON_INTERPRET=1.
"""
import math
import os

import pytest
import torch

from lowrank_cases import bits_layer, random_layer, rope_angles, run_under_interpreter, target_mask
from milo_kernels import apply_rope, reconstruct_layer, reconstruct_layer_naive
from milo_kernels.bits import reconstruct_bits_layer
from milo_kernels.cpu import rope
from milo_kernels.naive import reconstruct_bits_layer_naive

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
DEVICE = "cuda" if CUDA else "cpu"
needs_kernel = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")

# (kv_heads, d, rotary_dim, tokens of each block): a quarter (StableLM), a half (GLM-4.5, Phi-2, MiniMax-M2), one
# pair, all but one pair, and widths whose turned pairs end inside a program's BLOCK_H pairs
SHAPES = {
    "d64-quarter": (2, 64, 16, [1, 17, 33]),
    "d128-half": (1, 128, 64, [37, 3]),
    "d64-one-pair": (1, 64, 2, [20]),
    "d64-all-but-one-pair": (2, 64, 62, [31]),
    "d256-odd-pairs": (1, 256, 90, [9]),
}


def partial_tables(n: int, d: int, rotary_dim: int):
    """The tables a family's attention applies (`milo_infer.models.rope`): rotate-half's over rotary_dim, the
    identity (cos 1, sin 0) on the channels after it."""
    angles = rope_angles(n, rotary_dim, interleaved=False)
    cos = torch.cat((angles.cos(), torch.ones(n, d - rotary_dim, dtype=torch.float64)), dim=1)
    sin = torch.cat((angles.sin(), torch.zeros(n, d - rotary_dim, dtype=torch.float64)), dim=1)
    return cos.float(), sin.float()


def partial_by_complex(x: torch.Tensor, first_position: int, rotary_dim: int) -> torch.Tensor:
    """x [T, d] float64 with its first rotary_dim channels turned as complex numbers (re j, im j + rotary_dim/2),
    the others kept: written without `naive.rotate`."""
    h = rotary_dim // 2
    theta = rope_angles(first_position + len(x), rotary_dim, interleaved=False)[first_position:, :h]
    z = torch.complex(x[:, :h], x[:, h:rotary_dim]) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat((z.real, z.imag, x[:, rotary_dim:]), dim=1)


@pytest.mark.parametrize("d, rotary_dim", [(64, 16), (64, 32), (16, 8), (64, 64), (32, 2)])
def test_reference_rope_is_the_complex_rotation_of_the_first_channels(d, rotary_dim):
    x = torch.randn(11, d, dtype=torch.float64)
    cos, sin = partial_tables(20, d, rotary_dim)
    got = apply_rope(x.float(), cos[5:16], sin[5:16], rotary_dim=rotary_dim)
    torch.testing.assert_close(got.double(), partial_by_complex(x, 5, rotary_dim), atol=1e-5, rtol=1e-5)


def test_a_rotary_width_one_pair_off_is_not_the_models_rotation():
    """The red case: pairs (j, j + 7) for a rotary_dim of 16 (one pair too few) turn other channels."""
    x = torch.randn(9, 64, dtype=torch.float64)
    cos, sin = partial_tables(9, 64, 16)
    wrong = apply_rope(x.float(), cos, sin, rotary_dim=14).double()
    assert (wrong - partial_by_complex(x, 0, 16)).abs().max() > 0.1


@pytest.mark.parametrize("rotary_dim", [16, 2, 62])
def test_cpu_rope_equals_the_reference(rotary_dim):
    x = torch.randn(3, 13, 64)
    cos, sin = partial_tables(13, 64, rotary_dim)
    want = apply_rope(x, cos, sin, rotary_dim=rotary_dim)
    torch.testing.assert_close(rope(x, cos, sin, False, rotary_dim=rotary_dim), want)
    out = torch.empty_like(x)
    rope(x, cos, sin, False, out, rotary_dim=rotary_dim)
    torch.testing.assert_close(out, want)


def nans(kv_heads, n, d, dtype, device="cpu"):
    return [torch.full((kv_heads, n, d), math.nan, dtype=dtype, device=device) for _ in range(2)]


def layer_case(shape, dtype, seed):
    """A packed layer of ``shape`` (raw segments among its ranks), its tables, and the reference's rebuild."""
    kv_heads, d, rotary_dim, block_tokens = SHAPES[shape]
    factors, segments, n = random_layer(kv_heads, d, block_tokens, dtype, seed=seed, raw=True)
    cos, sin = partial_tables(n, d, rotary_dim)
    want = nans(kv_heads, n, d, dtype)
    reconstruct_layer_naive(factors, segments, *want, cos, sin, rotary_dim=rotary_dim)
    return factors, segments, cos, sin, want, target_mask(segments, kv_heads, n, d), rotary_dim


def bits_case(shape, seed):
    """A bit-code layer of ``shape``, its tables, and the reference's fp16 rebuild."""
    kv_heads, d, rotary_dim, block_tokens = SHAPES[shape]
    data, components, segments, scale, n = bits_layer(kv_heads, d, block_tokens, seed=seed)
    cos, sin = partial_tables(n, d, rotary_dim)
    want = nans(kv_heads, n, d, torch.float16)
    reconstruct_bits_layer_naive(data, components, segments, scale, *want, cos, sin, rotary_dim=rotary_dim)
    return (data, components, segments, scale), cos, sin, want, target_mask(segments, kv_heads, n, d), rotary_dim


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_rebuild_equals_the_reference(shape):
    factors, segments, cos, sin, want, mask, rotary_dim = layer_case(shape, torch.float32, seed=7)
    got = [torch.full_like(x, math.nan) for x in want]
    reconstruct_layer(factors, segments, *got, cos, sin, rotary_dim=rotary_dim, backend="auto")
    check(got, want, mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_bits_rebuild_equals_the_reference(shape):
    (data, components, segments, scale), cos, sin, want, mask, rotary_dim = bits_case(shape, seed=3)
    got = [torch.full_like(x, math.nan) for x in want]
    reconstruct_bits_layer(data, components, segments, scale, *got, cos, sin, rotary_dim=rotary_dim, backend="auto")
    check(got, want, mask, atol=2e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_rebuild_equals_the_reference(shape):
    from milo_kernels.plan import plan_layer
    from milo_kernels.reconstruct import launch

    factors, segments, cos, sin, want, mask, rotary_dim = layer_case(shape, torch.float16, seed=5)
    got = [torch.full_like(x, math.nan, device=DEVICE) for x in want]
    factors, cos, sin = factors.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)
    plan = plan_layer(factors, segments, *got, cos, sin, block_t=16, block_r=16)
    launch(plan, factors, *got, cos, sin, rotary_dim=rotary_dim)
    check(got, want, mask, atol=2e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bits_kernel_rebuild_equals_the_reference(shape):
    from milo_kernels.bits import launch_bits, plan_bits_layer

    (data, components, segments, scale), cos, sin, want, mask, rotary_dim = bits_case(shape, seed=4)
    got = [torch.full_like(x, math.nan, device=DEVICE) for x in want]
    data, scale, cos, sin = data.to(DEVICE), scale.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)
    plan = plan_bits_layer(data, components, segments, scale, *got, cos, sin)
    launch_bits(plan, data, scale, *got, cos, sin, rotary_dim=rotary_dim)
    check(got, want, mask, atol=5e-2, rtol=1e-2)


@pytest.mark.skipif(CUDA or INTERPRET, reason="the kernel tests run in this process")
def test_partial_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(__file__, keyword="kernel and not interpreter")


@pytest.mark.parametrize("rotary_dim, interleaved, message", [
    (15, False, "even number of channels"), (66, False, "even number of channels"), (0, False, "even number"),
    (32, True, "for rotate-half pairs")])
def test_a_layout_the_kernels_cannot_pair_is_refused(rotary_dim, interleaved, message):
    factors, segments, n = random_layer(1, 64, [5], torch.float32, seed=1)
    cos, sin = partial_tables(n, 64, 32)
    out = [torch.zeros(1, n, 64) for _ in range(2)]
    with pytest.raises(ValueError, match=message):
        reconstruct_layer(factors, segments, *out, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)


def check(got, want, mask, atol, rtol):
    for kind in (0, 1):
        g, w, m = got[kind].float().cpu(), want[kind].float(), mask[kind]
        assert w[m].isfinite().all() and g[m].isfinite().all(), "a target element was not written"
        assert g[~m].isnan().all(), "an element outside every segment was written"
        torch.testing.assert_close(g[m], w[m], atol=atol, rtol=rtol)
