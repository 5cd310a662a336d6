"""The bits kernel (milo_kernels.bits) against its plain-PyTorch definition, on odd shapes: tokens 1, 31,
33, 65 and more, widths mixing 0..8, odd component counts, both RoPE layouts, head dims 64 and 128.

Runs the real kernel on CUDA tensors when a GPU is present; without one, test_reconstruct_bits_interpreted
runs this module again in a subprocess under TRITON_INTERPRET=1 (the other tests run in-process).
"""
import math
import os

import numpy as np
import pytest
import torch

from lowrank_cases import bits_layer, rope_tables, run_under_interpreter, target_mask
from milo_kernels.bits import launch_bits, plan_bits_layer, reconstruct_bits_layer
from milo_kernels.naive import reconstruct_bits_layer_naive, unpack_codes

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
DEVICE = "cuda" if CUDA else "cpu"
needs_kernel = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")

SHAPES = {  # (kv_heads, d, tokens of each block)
    "d64": (2, 64, [1, 31, 33, 70]),
    "d128": (1, 128, [65, 3]),
}


def run_both(shape, interleaved, out_dtype, seed, **tiles):
    kv_heads, d, block_tokens = SHAPES[shape]
    data, components, segments, channel_scale, n_rows = bits_layer(kv_heads, d, block_tokens, seed)
    cos, sin = rope_tables(n_rows, d, interleaved)
    want = [torch.full((kv_heads, n_rows, d), math.nan, dtype=out_dtype) for _ in range(2)]
    reconstruct_bits_layer_naive(data, components, segments, channel_scale, *want, cos, sin, interleaved=interleaved)
    got = [torch.full((kv_heads, n_rows, d), math.nan, dtype=out_dtype, device=DEVICE) for _ in range(2)]
    on = [t.to(DEVICE) for t in (data, channel_scale)]
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    plan = plan_bits_layer(on[0], components, segments, on[1], *got, cos, sin, **tiles)
    launch_bits(plan, on[0], on[1], *got, cos, sin, interleaved=interleaved)
    mask = target_mask(segments, kv_heads, n_rows, d)
    for kind in (0, 1):
        g, w, m = got[kind].cpu().float(), want[kind].float(), mask[kind]
        assert w[m].isfinite().all() and g[m].isfinite().all(), "a target element was not written"
        assert g[~m].isnan().all(), "an element outside every segment was written"
        torch.testing.assert_close(g[m], w[m], atol=5e-2, rtol=1e-2)
    return segments


@needs_kernel
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bits_kernel_matches_reference(shape, interleaved):
    segments = run_both(shape, interleaved, torch.float16, seed=1)
    assert (segments[:, 1] % 2 == 1).any() and (segments[:, 1] == 0).any()  # odd and empty counts were covered


@needs_kernel
def test_bits_kernel_small_tiles_fp32_out():
    run_both("d64", False, torch.float32, seed=2, block_t=16, block_h=16)


@needs_kernel
def test_public_entry_takes_the_kernel(monkeypatch):
    """reconstruct_bits_layer with backend="triton" launches the kernel, never the reference."""
    import milo_kernels.bits as bits
    monkeypatch.setattr(bits, "reconstruct_bits_layer_naive", lambda *a, **k: pytest.fail("the reference ran"))
    kv_heads, d, tokens = SHAPES["d64"]
    data, components, segments, scale, n = bits_layer(kv_heads, d, tokens, seed=3)
    cos, sin = (t.to(DEVICE) for t in rope_tables(n, d, False))
    out = [torch.full((kv_heads, n, d), math.nan, dtype=torch.float16, device=DEVICE) for _ in range(2)]
    reconstruct_bits_layer(data.to(DEVICE), components, segments, scale.to(DEVICE), *out, cos, sin, backend="triton")
    assert out[0][target_mask(segments, kv_heads, n, d)[0].to(DEVICE)].isfinite().all()


def test_unpack_codes_inverts_lsb_first_packing():
    rng = np.random.default_rng(0)
    for width in range(1, 9):
        codes = rng.integers(0, 2 ** width, 37)
        bits = ((codes[:, None] >> np.arange(width)) & 1).reshape(-1)
        packed = np.packbits(bits, bitorder="little")
        data = torch.from_numpy(np.concatenate(([7], packed, [255])).astype(np.uint8))
        got = unpack_codes(data, torch.tensor([1]), torch.tensor([width]), 37)
        assert got.tolist() == [codes.tolist()]


def test_bad_tables_are_refused():
    kv_heads, d, tokens = SHAPES["d64"]
    data, components, segments, scale, n = bits_layer(kv_heads, d, tokens, seed=4)
    cos, sin = rope_tables(n, d, False)
    out = [torch.zeros(kv_heads, n, d) for _ in range(2)]
    bad = components.clone()
    bad[0, 3] = 9
    with pytest.raises(ValueError, match="width must be in 1..8"):
        reconstruct_bits_layer(data, bad, segments, scale, *out, cos, sin, backend="reference")
    bad = components.clone()
    bad[-1, 2] = data.numel() - 1
    with pytest.raises(ValueError, match="codes fall outside data"):
        reconstruct_bits_layer(data, bad, segments, scale, *out, cos, sin, backend="reference")
    with pytest.raises(ValueError, match="overlapping rows"):
        reconstruct_bits_layer(data, components, torch.cat([segments, segments[:1]]), scale, *out, cos, sin,
                               backend="reference")


@pytest.mark.skipif(CUDA or INTERPRET, reason="the kernel tests already run in this process")
def test_bits_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(__file__, keyword="kernel and not interpreter")


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_path_matches_reference(shape, interleaved):
    """The batched CPU path (the default on a CPU) writes what the reference does, and nothing else."""
    kv_heads, d, block_tokens = SHAPES[shape]
    data, components, segments, scale, n = bits_layer(kv_heads, d, block_tokens, seed=5)
    cos, sin = rope_tables(n, d, interleaved)
    got, want = ([torch.full((kv_heads, n, d), math.nan) for _ in range(2)] for _ in range(2))
    reconstruct_bits_layer(data, components, segments, scale, *got, cos, sin, interleaved=interleaved, backend="auto")
    reconstruct_bits_layer_naive(data, components, segments, scale, *want, cos, sin, interleaved=interleaved)
    mask = target_mask(segments, kv_heads, n, d)
    for kind in (0, 1):
        assert got[kind][~mask[kind]].isnan().all() and got[kind][mask[kind]].isfinite().all()
        torch.testing.assert_close(got[kind][mask[kind]], want[kind][mask[kind]], rtol=1e-5, atol=1e-4)
