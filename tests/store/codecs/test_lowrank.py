import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from milo_store.codecs.lowrank import factorize_block, pack_block
from milo_store.codecs.lowrank_reference import reconstruct, unpack_block
from milo_store.layout import Layout

shapes = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 70), st.sampled_from([8, 16, 32]))


def random_kv(L, H, T, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, T, d, generator=g) * 3, torch.randn(L, H, T, d, generator=g)


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 2**16))
def test_full_rank_roundtrip_within_fp16_rounding(shape, seed):
    L, H, T, d = shape
    keys, values = random_kv(L, H, T, d, seed)
    f = factorize_block(keys, values)
    n = min(T, d)
    ranks = np.full((L, 2, H), n)
    layout = Layout(L, H, d)
    flat = pack_block(f, ranks, "float16")
    for (l, kind, h), A, S, B in unpack_block(flat, layout, ranks, T):
        ref = (keys, values)[kind][l, h]
        err = (reconstruct(A, S, B) - ref).abs().max()
        # fp16 factors: a few ulps of the largest entries, relative to the matrix scale
        assert err <= 4e-3 * ref.abs().max() * max(1, n ** 0.5)


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 2**16))
def test_error_never_increases_with_rank_and_equals_discarded_energy(shape, seed):
    L, H, T, d = shape
    keys, values = random_kv(L, H, T, d, seed)
    f = factorize_block(keys, values)
    x = keys[0, 0].double()
    A, S, B = f.A[0, 0, 0].double(), f.S[0, 0, 0].double(), f.B[0, 0, 0].double()
    previous = float("inf")
    for r in range(S.shape[0] + 1):
        err2 = float(((reconstruct(A[:, :r], S[:r], B[:, :r]).double() - x) ** 2).sum())
        discarded = float((S[r:] ** 2).sum())
        assert err2 <= previous + 1e-6 * float((x ** 2).sum())
        # Eckart–Young: the squared Frobenius error is the energy of the dropped singular values
        assert abs(err2 - discarded) <= 1e-4 * float((x ** 2).sum()) + 1e-6
        previous = err2


def test_identity_codec_is_exact_in_fp32():
    keys, values = random_kv(2, 2, 37, 16, 0)
    f = factorize_block(keys, values, codec="identity")
    ranks = np.full((2, 2, 2), 16)
    flat = pack_block(f, ranks, "float32")
    for (l, kind, h), A, S, B in unpack_block(flat, Layout(2, 2, 16), ranks, 37):
        assert torch.equal(reconstruct(A, S, B), (keys, values)[kind][l, h])


def test_pack_checks_ranks_and_overflow():
    keys, values = random_kv(1, 1, 10, 8, 0)
    f = factorize_block(keys, values)
    try:
        pack_block(f, np.full((1, 2, 1), 9), "float16")
        raise AssertionError("rank beyond the factors must be refused")
    except ValueError as e:
        assert "exceeds" in str(e)
    big = factorize_block(keys * 1e5, values)
    try:
        pack_block(big, np.full((1, 2, 1), 2), "float16")
        raise AssertionError("fp16 overflow must be refused")
    except ValueError as e:
        assert "overflows float16" in str(e)
    assert pack_block(big, np.full((1, 2, 1), 2), "bfloat16").dtype == torch.bfloat16


def test_factorize_rejects_bad_input():
    k = torch.randn(1, 1, 4, 8)
    for bad in (torch.randn(1, 1, 5, 8), torch.randn(1, 4, 8)):
        try:
            factorize_block(k, bad)
            raise AssertionError("mismatched shapes must be refused")
        except ValueError as e:
            assert "layers, kv_heads, tokens, head_dim" in str(e)
    nan = k.clone()
    nan[0, 0, 0, 0] = float("nan")
    try:
        factorize_block(nan, k)
        raise AssertionError("NaN must be refused")
    except ValueError as e:
        assert "NaN" in str(e)
