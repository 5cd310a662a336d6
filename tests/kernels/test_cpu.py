"""The batched CPU path against the naive reference, on ragged layers, and its routing."""
import math

import pytest
import torch

from lowrank_cases import random_layer, rope_tables, target_mask
from milo_kernels import reconstruct as rk
from milo_kernels import reconstruct_layer, reconstruct_layer_naive
from milo_kernels.cpu import reconstruct_layer_cpu, rope
from milo_kernels.naive import apply_rope

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def run_both(kv_heads, d, block_tokens, factor_dtype, out_dtype, interleaved, seed):
    factors, segments, n_rows = random_layer(kv_heads, d, block_tokens, factor_dtype, seed)
    cos, sin = rope_tables(n_rows, d, interleaved)
    outs = []
    for fn in (reconstruct_layer_naive, reconstruct_layer_cpu):
        out_k, out_v = (torch.full((kv_heads, n_rows, d), math.nan, dtype=out_dtype) for _ in range(2))
        fn(factors, segments, out_k, out_v, cos, sin, interleaved=interleaved)
        outs.append((out_k, out_v))
    return outs, target_mask(segments, kv_heads, n_rows, d)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("kv_heads, d, block_tokens", [
    (1, 8, [1]),  # one token, tiny head
    (2, 64, [5, 40, 1]),  # GQA-sized head count, ragged blocks
    (3, 64, [64, 64, 17]),  # equal-length blocks at different rows stay separate
    (4, 128, [33, 200]),
], ids=["tiny", "ragged", "equal-length", "d128"])
@pytest.mark.parametrize("factor_dtype, out_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
], ids=["fp32", "fp16", "bf16", "fp16->fp32"])
def test_matches_reference_and_leaves_other_rows_untouched(kv_heads, d, block_tokens, factor_dtype, out_dtype,
                                                           interleaved):
    """Ranks span 0..d (random_layer's pool), factors have NaN gaps, outputs start NaN."""
    (ref, got), mask = run_both(kv_heads, d, block_tokens, factor_dtype, out_dtype, interleaved, seed=len(block_tokens))
    for kind in (0, 1):
        want, have, m = ref[kind], got[kind], mask[kind]
        assert have[m].isfinite().all(), "a written row is NaN: the path read outside its segment"
        assert have[~m].isnan().all(), "a row outside every segment was written"
        torch.testing.assert_close(have[m].float(), want[m].float(), **TOL[out_dtype])


def test_rank_zero_and_full_rank_segments():
    d = 16
    a, s, b = torch.randn(5, d), torch.rand(d) + 0.5, torch.randn(d, d)
    factors = torch.cat([a.flatten(), s, b.flatten()])
    segments = torch.tensor([[0, d, 5, 0, 0, 1], [0, 0, 5, 0, 0, 0], [0, 0, 3, 5, 1, 1]])
    out_k, out_v = (torch.full((2, 9, d), math.nan) for _ in range(2))
    cos, sin = rope_tables(9, d, interleaved=False)
    reconstruct_layer_cpu(factors, segments, out_k, out_v, cos, sin)
    torch.testing.assert_close(out_v[0, :5], (a * s) @ b.T)
    assert (out_k[0, :5] == 0).all() and (out_v[1, 5:8] == 0).all()
    assert out_k[0, 5:].isnan().all() and out_k[1].isnan().all() and out_v[1, :5].isnan().all()


def test_empty_segment_table_writes_nothing():
    out_k, out_v = (torch.full((1, 4, 8), math.nan) for _ in range(2))
    cos, sin = rope_tables(4, 8, interleaved=False)
    reconstruct_layer_cpu(torch.zeros(0), torch.zeros(0, 6, dtype=torch.int64), out_k, out_v, cos, sin)
    assert out_k.isnan().all() and out_v.isnan().all()


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_equals_the_reference_rope(interleaved):
    x = torch.randn(3, 7, 32)
    cos, sin = rope_tables(7, 32, interleaved)
    torch.testing.assert_close(rope(x, cos, sin, interleaved), apply_rope(x, cos, sin, interleaved))


def test_cpu_tensors_route_to_the_cpu_path_and_reference_forces_the_oracle(monkeypatch):
    factors, segments, n_rows = random_layer(2, 16, [9, 4], torch.float32, seed=3)
    cos, sin = rope_tables(n_rows, 16, interleaved=False)
    called = []
    monkeypatch.setattr(rk, "reconstruct_layer_cpu", lambda *a, **k: called.append("cpu"))
    monkeypatch.setattr(rk, "reconstruct_layer_naive", lambda *a, **k: called.append("reference"))
    out = [torch.zeros(2, n_rows, 16) for _ in range(2)]
    reconstruct_layer(factors, segments, *out, cos, sin, backend="auto")
    reconstruct_layer(factors, segments, *out, cos, sin, backend="reference")
    assert called == ["cpu", "reference"]
