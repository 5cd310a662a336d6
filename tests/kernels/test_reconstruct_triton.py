"""The Triton kernel against the PyTorch reference, on odd shapes.

Runs the real kernel on CUDA tensors when a GPU is present. Without one it needs TRITON_INTERPRET=1 set
before triton is first used; test_reconstruct.py runs this module in a subprocess with that set, so a
plain `pytest tests` covers it on a CPU machine without switching the interpreter on for other tests.
"""
import math
import os

import pytest
import torch

from lowrank_cases import random_layer, rope_tables, target_mask

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"

from milo_kernels import reconstruct as rk, reconstruct_layer, reconstruct_layer_naive, triton_kernel  # noqa: E402
from milo_kernels.plan import plan_layer, plan_layers  # noqa: E402
from milo_kernels.reconstruct import launch  # noqa: E402

# (kv_heads, d, tokens of each block): one block and many, GQA head counts, tokens that are not tile multiples
SHAPES = {
    "one-block": (1, 64, [37]),
    "gqa4-many-blocks": (4, 64, [1, 17, 64, 30]),
    "d128": (2, 128, [50, 23]),
    "d256": (1, 256, [20]),
}
# (factor dtype, output dtype, atol, rtol); bf16 has no interpreter support
DTYPES = {
    "fp16": (torch.float16, torch.float16, 2e-2, 1e-2),
    "fp32": (torch.float32, torch.float32, 1e-4, 1e-4),
    "fp16-to-fp32": (torch.float16, torch.float32, 1e-2, 1e-2),
    "bf16": (torch.bfloat16, torch.bfloat16, 6e-2, 2e-2),
}
TILES = {"default": {}, "small": {"block_t": 16, "block_r": 16}}


def run_both(shape, dtypes, interleaved, seed, tiles, out_view=False):
    kv_heads, d, block_tokens = SHAPES[shape]
    f_dtype, o_dtype, _, _ = DTYPES[dtypes]
    factors, segments, n_rows = random_layer(kv_heads, d, block_tokens, f_dtype, seed)
    cos, sin = rope_tables(n_rows, d, interleaved)
    ref_k = torch.full((kv_heads, n_rows, d), math.nan, dtype=o_dtype)
    ref_v = ref_k.clone()
    reconstruct_layer_naive(factors, segments, ref_k, ref_v, cos, sin, interleaved=interleaved)

    factors, cos, sin = factors.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)
    if out_view:  # a strided window of a larger buffer: only the viewed rows may change
        big_k = torch.full((kv_heads, n_rows + 7, d), math.nan, dtype=o_dtype, device=DEVICE)
        big_v = big_k.clone()
        out_k, out_v = big_k[:, 3:3 + n_rows], big_v[:, 3:3 + n_rows]
    else:
        out_k = torch.full((kv_heads, n_rows, d), math.nan, dtype=o_dtype, device=DEVICE)
        out_v = out_k.clone()
    plan = plan_layer(factors, segments, out_k, out_v, cos, sin, **TILES[tiles])
    launch(plan, factors, out_k, out_v, cos, sin, interleaved=interleaved)
    if out_view:
        for big in (big_k, big_v):
            assert big[:, :3].isnan().all() and big[:, 3 + n_rows:].isnan().all()
    return (out_k.cpu(), out_v.cpu()), (ref_k, ref_v), target_mask(segments, kv_heads, n_rows, d)


def check(got, want, mask, dtypes):
    _, _, atol, rtol = DTYPES[dtypes]
    for kind in (0, 1):
        g, w, m = got[kind].float(), want[kind].float(), mask[kind]
        assert w[m].isfinite().all(), "the reference itself produced non-finite targets"
        assert g[m].isfinite().all(), "a target element was not written (still NaN)"
        assert g[~m].isnan().all(), "an element outside every segment was written"
        torch.testing.assert_close(g[m], w[m], atol=atol, rtol=rtol)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, interleaved, tiles):
    got, want, mask = run_both(shape, "fp16", interleaved, seed=1, tiles=tiles)
    check(got, want, mask, "fp16")


@pytest.mark.parametrize("dtypes", ["fp32", "fp16-to-fp32", "bf16"])
@pytest.mark.parametrize("shape", ["gqa4-many-blocks", "d128"])
def test_kernel_dtypes(shape, dtypes):
    if dtypes == "bf16" and not CUDA:
        pytest.skip("the Triton interpreter has no bf16")
    got, want, mask = run_both(shape, dtypes, interleaved=False, seed=2, tiles="small")
    check(got, want, mask, dtypes)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_kernel_writes_into_a_strided_view(interleaved):
    got, want, mask = run_both("gqa4-many-blocks", "fp16", interleaved, seed=3, tiles="small", out_view=True)
    check(got, want, mask, "fp16")


def test_public_entry_dispatches_to_triton(monkeypatch):
    """`reconstruct_layer` with backend="triton" launches the Triton kernel once, on the planned grid, and
    neither other backend runs."""
    launches = []
    real_kernel = triton_kernel.kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append(grid)
                return real_kernel()[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(triton_kernel, "kernel", Spy)
    for other in ("reconstruct_layer_cpu", "reconstruct_layer_naive"):
        monkeypatch.setattr(rk, other, lambda *a, other=other, **k: pytest.fail(f"{other} ran, not the Triton kernel"))
    kv_heads, d, block_tokens = SHAPES["d128"]
    factors, segments, n_rows = random_layer(kv_heads, d, block_tokens, torch.float16, seed=4)
    cos, sin = rope_tables(n_rows, d, interleaved=False)
    want = [torch.full((kv_heads, n_rows, d), math.nan, dtype=torch.float16) for _ in range(2)]
    reconstruct_layer_naive(factors, segments, *want, cos, sin)
    got = [torch.full((kv_heads, n_rows, d), math.nan, dtype=torch.float16, device=DEVICE) for _ in range(2)]
    args = (factors.to(DEVICE), segments, *got, cos.to(DEVICE), sin.to(DEVICE))
    reconstruct_layer(*args, backend="triton")
    plan = plan_layer(*args)
    assert launches == [(len(plan.tiles), -(-(d // 2) // plan.block_h))]
    check([g.cpu() for g in got], want, target_mask(segments, kv_heads, n_rows, d), "fp16")


def test_empty_segment_table_writes_nothing():
    d = 64
    out_k = torch.full((2, 8, d), math.nan, dtype=torch.float16, device=DEVICE)
    out_v = out_k.clone()
    cos, sin = (t.to(DEVICE) for t in rope_tables(8, d, interleaved=False))
    factors = torch.zeros(4, dtype=torch.float16, device=DEVICE)
    plan = plan_layer(factors, torch.zeros(0, 6, dtype=torch.int64), out_k, out_v, cos, sin)
    launch(plan, factors, out_k, out_v, cos, sin)
    assert out_k.isnan().all() and out_v.isnan().all()


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_layers_planned_at_once_match_the_reference(interleaved):
    """One plan_layers call for a whole retrieval (what the query path does), each layer launched alone."""
    kv_heads, d, block_tokens = SHAPES["gqa4-many-blocks"]
    layers = [random_layer(kv_heads, d, block_tokens, torch.float16, seed) for seed in (5, 6, 7)]
    n_rows = layers[0][2]
    cos, sin = rope_tables(n_rows, d, interleaved)
    plans = plan_layers(torch.stack([segments for _, segments, _ in layers]), d, factor_dtype=torch.float16,
                        device=DEVICE, **TILES["small"])
    assert len(plans) == 3
    for (factors, segments, _), plan in zip(layers, plans):
        want = [torch.full((kv_heads, n_rows, d), math.nan, dtype=torch.float16) for _ in range(2)]
        reconstruct_layer_naive(factors, segments, *want, cos, sin, interleaved=interleaved)
        got = [torch.full((kv_heads, n_rows, d), math.nan, dtype=torch.float16, device=DEVICE) for _ in range(2)]
        reconstruct_layer(factors.to(DEVICE), segments, *got, cos.to(DEVICE), sin.to(DEVICE), interleaved=interleaved,
                          plan=plan)
        check([g.cpu() for g in got], want, target_mask(segments, kv_heads, n_rows, d), "fp16")
    short = torch.empty(kv_heads, plans[0].need_rows - 1, d, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="do not match the plan"):
        launch(plans[0], layers[0][0].to(DEVICE), short, short.clone(), cos.to(DEVICE), sin.to(DEVICE))


def test_compiled_kernel_keeps_its_constexprs():
    """The compiler reads constexprs from the function's annotations, which rebinding the kernel to its own
    globals must carry over: without them every tl.arange fails to compile on a GPU, while the interpreter,
    and an ahead-of-time compile that names its constants, run as before (seen on an H200, 2026-12-04)."""
    annotations = triton_kernel.kernel_for(False).fn.__annotations__
    assert {"BITS", "SPAN", "INTERLEAVED", "IEEE_DOT", "BLOCK_T", "BLOCK_R", "BLOCK_H"} <= set(annotations)
