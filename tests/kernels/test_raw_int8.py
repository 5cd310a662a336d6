"""Raw INT8 units inside INT4/INT2 stores (rank RAW_INT8_RANK = -2, docs/format.md "Raw segments").

(a) sizes, the reference against a plain dequantization written here, the CPU path against the
reference on layers mixing ranks -2, -1, 0, r and d, the refusals; (b) the fused Triton kernel against
the reference on such layers. (b) needs CUDA or TRITON_INTERPRET=1 set before triton is first used;
`test_triton_raw_int8_under_the_interpreter` reruns this module in a subprocess with the interpreter on.
"""
import os

import pytest
import torch

from lowrank_cases import (check_outputs, nan_buffers, quantized_layer, rope_by_complex, rope_tables,
                           run_under_interpreter, target_mask)
from milo_kernels import RAW_INT8_RANK, RAW_RANK, lowbit_segment_bytes, reconstruct_layer
from milo_store.quant import pack_raw_segment

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"
BITS = {"int4": 4, "int2": 2}


@pytest.mark.parametrize("tokens", [1, 7, 32, 45])
@pytest.mark.parametrize("bits", [4, 2])
def test_raw_int8_size_is_an_int8_raw_segment(tokens, bits):
    """4d + T'd bytes (T' = T rounded up to even), what the writer's INT8 raw packer produces, elementwise
    too, for keys and values alike."""
    d = 16
    for kind in (0, 1):
        packed = pack_raw_segment(torch.randn(tokens, d), "int8", kind)
        size = lowbit_segment_bytes(RAW_INT8_RANK, tokens, d, bits, kind)
        assert size == packed.numel() == (4 + tokens + tokens % 2) * d
    ranks, kinds = torch.tensor([RAW_INT8_RANK, RAW_RANK, 0, 3]), torch.tensor([0, 1, 0, 1])
    sizes = lowbit_segment_bytes(ranks, torch.full((4,), tokens), d, bits, kinds).tolist()
    assert sizes == [lowbit_segment_bytes(r, tokens, d, bits, k) for r, k in zip(ranks.tolist(), kinds.tolist())]


def plain_int8(packed, tokens, d):
    """X of an INT8 raw segment, read byte by byte as docs/format.md states it: fp16 scale [d], fp16
    minimum [d], then uint8 codes [T', d] row-major; x = code * scale + minimum."""
    b = packed.numpy().tobytes()
    scale = torch.frombuffer(bytearray(b[:2 * d]), dtype=torch.float16).double()
    low = torch.frombuffer(bytearray(b[2 * d:4 * d]), dtype=torch.float16).double()
    codes = torch.tensor(list(b[4 * d:4 * d + tokens * d]), dtype=torch.float64).view(tokens, d)
    return codes * scale + low


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("quant", ["int4", "int2"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_raw_int8_reads_as_plain_dequantization(monkeypatch, backend, quant, interleaved):
    """A -2 value is code * scale + min per channel, a -2 key the same rotated, at odd T < d placed
    after an INT4/INT2 raw segment; and X comes back within INT8's error, finer than the store's bits."""
    monkeypatch.setenv("MILO_KERNEL", "" if backend == "cpu" else "reference")
    tokens, d, first = 37, 64, 3
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(5)) * 2
    n = first + tokens + 1
    cos, sin = rope_tables(n, d, interleaved)
    for kind in (0, 1):
        lowbit, int8 = pack_raw_segment(x, quant, kind), pack_raw_segment(x, "int8", kind)
        factors = torch.cat((lowbit, int8))
        segments = torch.tensor([[0, RAW_RANK, tokens, first, 0, kind],
                                 [lowbit.numel(), RAW_INT8_RANK, tokens, first, 1, kind]])
        out = nan_buffers(2, n, d, torch.float32)
        reconstruct_layer(factors, segments, *out, cos, sin, interleaved=interleaved, quant=quant)
        plain = plain_int8(int8, tokens, d)
        want = rope_by_complex(plain, first, interleaved) if kind == 0 else plain
        got = out[kind][1, first:first + tokens].double()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # the CPU paths expand to fp16 first
        assert out[kind][:, :first].isnan().all() and out[1 - kind].isnan().all()
        if kind == 1:  # INT8 keeps X closer than the store's own low-bit raw form
            assert (got - x).abs().max() < 0.05 < (out[1][0, first:first + tokens] - x).abs().max()


def mixed_int8_layer(quant, kv_heads, d, block_tokens, seed):
    """(factors, segments, N) of one INT4/INT2 layer whose keys and values each hold ranks -2, -1, 0,
    a middle rank and d."""
    pool = [RAW_INT8_RANK, RAW_RANK, 0, 1, d, RAW_INT8_RANK, 17]  # taken by spec index: each kind meets all
    factors, segments, n = quantized_layer(kv_heads, d, block_tokens, quant, seed, pool)
    for kind in (0, 1):
        ranks = set(segments[segments[:, 5] == kind, 1].tolist())
        assert {RAW_INT8_RANK, RAW_RANK, 0, d}.issubset(ranks) and ranks & set(range(1, d)), (kind, ranks)
    return factors, segments, n


def reference(factors, segments, kv_heads, n, d, interleaved, quant, monkeypatch):
    monkeypatch.setenv("MILO_KERNEL", "reference")
    want = nan_buffers(kv_heads, n, d, torch.float32)
    reconstruct_layer(factors, segments, *want, *rope_tables(n, d, interleaved), interleaved=interleaved, quant=quant)
    return want


@pytest.mark.parametrize("quant", ["int4", "int2"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_cpu_path_matches_reference_with_raw_int8(monkeypatch, quant, interleaved):
    kv_heads, d = 2, 32
    factors, segments, n = mixed_int8_layer(quant, kv_heads, d, [1, 31, 33, 65], seed=21)
    want = reference(factors, segments, kv_heads, n, d, interleaved, quant, monkeypatch)
    monkeypatch.setenv("MILO_KERNEL", "")
    got = nan_buffers(kv_heads, n, d, torch.float32)
    reconstruct_layer(factors, segments, *got, *rope_tables(n, d, interleaved), interleaved=interleaved, quant=quant)
    check_outputs(got, want, target_mask(segments, kv_heads, n, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_raw_int8_refused_outside_lowbit_stores(monkeypatch, backend, quant):
    """In floating and INT8 tables rank -1 already is the raw form, so -2 is an error naming both."""
    monkeypatch.setenv("MILO_KERNEL", "" if backend == "cpu" else "reference")
    tokens, d = 5, 8
    x = torch.randn(tokens, d)
    factors = x.flatten() if quant is None else pack_raw_segment(x, "int8", 1)
    out = nan_buffers(1, tokens, d, torch.float32)
    cos, sin = rope_tables(tokens, d, False)
    name = "floating" if quant is None else "int8"
    with pytest.raises(ValueError, match=rf"rank -2 \(a raw INT8 unit\) exists only in int4/int2 stores; in {name} "
                                         r"factors a raw unit is rank -1"):
        reconstruct_layer(factors, torch.tensor([[0, RAW_INT8_RANK, tokens, 0, 0, 1]]), *out, cos, sin, quant=quant)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_raw_int8_rows_are_validated_in_lowbit_tables(monkeypatch, backend):
    """-2 reads an INT8 raw segment's bytes, which must fit in the factors; -3 is still no rank."""
    monkeypatch.setenv("MILO_KERNEL", "" if backend == "cpu" else "reference")
    tokens, d = 5, 8
    factors = pack_raw_segment(torch.randn(tokens, d), "int8", 0)
    out = nan_buffers(1, tokens, d, torch.float32)
    cos, sin = rope_tables(tokens, d, False)
    reconstruct_layer(factors, torch.tensor([[0, RAW_INT8_RANK, tokens, 0, 0, 0]]), *out, cos, sin, quant="int2")
    with pytest.raises(ValueError, match="reads past the end of factors"):
        reconstruct_layer(factors[:-2].clone(), torch.tensor([[0, RAW_INT8_RANK, tokens, 0, 0, 0]]), *out, cos, sin,
                          quant="int2")
    with pytest.raises(ValueError, match=r"or -1 \(raw\) or -2 \(raw INT8\)"):
        reconstruct_layer(factors, torch.tensor([[0, -3, tokens, 0, 0, 0]]), *out, cos, sin, quant="int2")


def test_plans_count_raw_int8_sizes():
    """plan_layers bounds factors by the INT8 raw size in low-bit tables and refuses -2 elsewhere."""
    pytest.importorskip("triton")
    from milo_kernels.reconstruct import plan_layers

    d = 16
    segments = torch.tensor([[[0, RAW_INT8_RANK, 5, 0, 0, 0], [200, RAW_RANK, 7, 0, 0, 1]]])
    plan = plan_layers(segments, d, factor_dtype=torch.uint8, device="cpu", quant="int4")[0]
    assert plan.need_numel == max((4 + 6) * d, 200 + lowbit_segment_bytes(RAW_RANK, 7, d, 4, 1))
    for quant in ("int8", None):
        with pytest.raises(ValueError, match="rank -2"):
            plan_layers(segments, d, factor_dtype=torch.uint8 if quant else torch.float16, device="cpu", quant=quant)


# -- (b) the fused Triton kernel against the reference ---------------------------------------------

# 2 kv heads, d 64, token counts 1, 31, 33 and 65 (not multiples of a 32-token group nor of BLOCK_T);
# rotate-half runs 16-token, 16-pair tiles (two programs across the channels), interleaved the defaults
TILES = {False: {"block_t": 16, "block_r": 16, "block_h": 16}, True: {}}


@needs_triton
@pytest.mark.parametrize("quant", ["int4", "int2"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-small", "interleaved-default"])
def test_triton_raw_int8_mixed_layer_matches_reference(monkeypatch, quant, interleaved):
    from milo_kernels.reconstruct import launch, plan_layer

    kv_heads, d = 2, 64
    factors, segments, n = mixed_int8_layer(quant, kv_heads, d, [1, 31, 33, 65], seed=22)
    want = reference(factors, segments, kv_heads, n, d, interleaved, quant, monkeypatch)
    got = nan_buffers(kv_heads, n, d, torch.float16, DEVICE)
    cos, sin = (t.to(DEVICE) for t in rope_tables(n, d, interleaved))
    plan = plan_layer(factors.to(DEVICE), segments, *got, cos, sin, quant=quant, **TILES[interleaved])
    launch(plan, factors.to(DEVICE), *got, cos, sin, interleaved=interleaved)
    check_outputs(got, want, target_mask(segments, kv_heads, n, d), atol=2e-2, rtol=1e-2)  # fp16 tiles, outputs


@pytest.mark.skipif(INTERPRET or CUDA, reason="already interpreting in-process, or on a GPU")
def test_triton_raw_int8_under_the_interpreter():
    pytest.importorskip("triton")
    assert " skipped" not in run_under_interpreter(__file__, "triton_raw_int8_mixed")
