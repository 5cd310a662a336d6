import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_store.codecs.rate_distortion import (SCALE_BYTES, WIDTHS, allocate_bits, attended_column_errors, attended_key_errors,
                                        column_bytes, column_errors,
                                        dequantize_columns, fit_transform, pack_columns, quantize_columns,
                                        roundtrip_columns, unpack_columns, zstd_bytes)


def columns(seed: int, tokens: int, n: int, units: int = 1) -> torch.Tensor:
    """Coefficient-like columns: unequal scales and offsets, as a PCA's components have."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(units, 1, n, generator=g) * 10 ** torch.randint(-2, 3, (units, 1, n), generator=g)
    return torch.randn(units, tokens, n, generator=g) * scale + torch.randn(units, 1, n, generator=g)


def ladders(seed: int, tokens: int, n: int, units: int):
    c = columns(seed, tokens, n, units)
    errors = column_errors(c).reshape(-1, len(WIDTHS)).numpy()
    costs = np.broadcast_to(column_bytes(tokens, np.array(WIDTHS)), errors.shape).astype(np.float64)
    return errors, costs


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 70), st.integers(1, 9), st.integers(1, 3), st.floats(0, 1.2))
def test_allocation_never_exceeds_its_budget(seed, tokens, n, units, share):
    errors, costs = ladders(seed, tokens, n, units)
    budget = share * costs[:, -1].sum()
    choice = allocate_bits(errors, costs, budget)
    assert choice.shape == (errors.shape[0],)
    assert costs[np.arange(len(choice)), choice].sum() <= budget + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 70), st.integers(1, 9), st.integers(1, 3),
       st.lists(st.floats(0, 1.2), min_size=2, max_size=6))
def test_more_bytes_never_increase_the_error_on_the_fitted_data(seed, tokens, n, units, shares):
    errors, costs = ladders(seed, tokens, n, units)
    totals = [errors[np.arange(len(errors)), allocate_bits(errors, costs, s * costs[:, -1].sum())].sum()
              for s in sorted(shares)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(totals, totals[1:]))


def test_allocation_puts_bits_where_the_variance_is():
    # reverse water-filling: the large column gets more bits than the small one, a tiny one none
    c = torch.randn(1, 200, 3) * torch.tensor([100.0, 1.0, 1e-4])
    errors = column_errors(c).reshape(-1, len(WIDTHS)).numpy()
    costs = np.broadcast_to(column_bytes(200, np.array(WIDTHS)), errors.shape).astype(np.float64)
    bits = np.array(WIDTHS)[allocate_bits(errors, costs, 200 * 8 / 8 + 3 * SCALE_BYTES)]
    assert bits[0] > bits[1] >= bits[2] == 0


def test_an_impossible_budget_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="cheapest"):
        allocate_bits(np.ones((2, 3)), np.ones((2, 3)), 1.0)
    with pytest.raises(ValueError, match="choices, options"):
        allocate_bits(np.ones((2, 3)), np.ones((2, 4)), 10.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 40), st.integers(1, 6), st.integers(1, 3))
def test_quantized_columns_round_trip_through_the_packing(seed, tokens, n, units):
    c = columns(seed, tokens, n, units)
    bits = torch.from_numpy(np.random.default_rng(seed).choice(WIDTHS, (units, n)))
    codes, scale, low = quantize_columns(c, bits)
    assert codes.dtype == torch.uint8 and codes.shape == c.shape
    assert scale.dtype == low.dtype == torch.float16 and scale.shape == (units, n)
    assert (codes.long() < (2 ** bits).unsqueeze(-2)).all()
    data = pack_columns(codes, bits)
    assert len(data) + SCALE_BYTES * int((bits > 0).sum()) == column_bytes(tokens, bits.numpy()).sum()
    pos = 0
    for u in range(units):
        size = len(pack_columns(codes[u:u + 1], bits[u:u + 1]))
        assert torch.equal(unpack_columns(data[pos:pos + size], tokens, bits[u]), codes[u])
        pos += size
    back = dequantize_columns(codes, scale, low)
    assert back.dtype == torch.float32 and back.shape == c.shape
    assert (back[(bits == 0).unsqueeze(-2).expand_as(c)] == 0).all()  # a dropped column reads back as zeros
    # a stored column is within half a step (plus fp16 rounding of its range) of the original
    kept = (bits > 0).unsqueeze(-2).expand_as(c)
    step = scale.float().unsqueeze(-2).expand_as(c)
    err = (back - c).abs()
    assert (err[kept] <= step[kept] * 0.5 + 1e-2 * (c.abs()[kept] + step[kept]) + 1e-6).all()
    with pytest.raises(ValueError, match="describe"):
        unpack_columns(pack_columns(codes[:1], bits[:1]) + b"\0", tokens, bits[0])


def test_errors_fall_with_width_and_match_the_roundtrip():
    c = columns(3, 64, 5)
    e = column_errors(c)
    for j, w in enumerate(WIDTHS):
        assert torch.allclose(e[..., j], (roundtrip_columns(c, w) - c).double().pow(2).sum(-2))
    assert (e[..., 2:].diff(dim=-1) <= 1e-9).all()  # from 1 bit up, each width at least as good
    assert torch.allclose(e[..., 0], c.double().pow(2).sum(-2))  # dropped: read back as zeros


def test_the_transform_inverts_and_orders_its_components():
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(2, 6, 6, generator=g)
    x = torch.randn(2, 300, 6, generator=g) * torch.tensor([5.0, 3, 1, .5, .1, .01]) @ mix + 7
    w = torch.rand(2, 6, generator=g) + 0.5
    t = fit_transform([x[:, :150], x[:, 150:]], w)
    assert torch.allclose(t.reconstruct(t.project(x)), x, atol=1e-3)
    c = t.project(x)
    assert torch.allclose(c.mean(dim=1), torch.zeros(2, 6), atol=1e-3)  # the mean is removed
    var = c.pow(2).mean(dim=1)
    assert (var.diff(dim=-1) <= 1e-4).all()  # largest variance first
    assert t.stored_bytes() == 2 * 2 * 6 * 7
    with pytest.raises(ValueError, match="positive"):
        fit_transform([x], -w)
    with pytest.raises(ValueError, match="at least one"):
        fit_transform([])


def test_entropy_coding_shrinks_skewed_codes():
    codes = torch.zeros(1, 4096, 1, dtype=torch.uint8)
    codes[0, ::97] = 3
    data = pack_columns(codes, torch.tensor([[4]]))
    assert zstd_bytes(data) < len(data) / 4


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 30), st.integers(1, 5), st.integers(1, 6))
def test_attended_errors_are_the_attention_outputs_error(seed, tokens, n, queries):
    c = columns(seed, tokens, n, 2)
    torch.testing.assert_close(attended_column_errors(c, torch.eye(tokens).expand(2, tokens, tokens)), column_errors(c))
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(2, queries, tokens, generator=g) * 3, dim=-1)
    e = attended_column_errors(c, probs)
    assert e.shape == (2, n, len(WIDTHS))
    j = len(WIDTHS) - 1  # summed over columns: the error of P (Ĉ - C) at one width, as an orthonormal basis keeps it
    whole = (probs @ (roundtrip_columns(c, WIDTHS[j]) - c)).double().pow(2).sum((-2, -1))
    torch.testing.assert_close(e[..., j].sum(-1), whole)
    # attention spread over every token sees at most the mean square over tokens (Cauchy-Schwarz)
    spread = torch.full((2, 1, tokens), 1.0 / tokens)
    assert (attended_column_errors(c, spread)[..., 1:] <= column_errors(c)[..., 1:] / tokens * 1.0001 + 1e-9).all()


def _keys_attended(seed, tokens, n, queries, size):
    """Keys c Vᵀ (V orthonormal [d, n]), queries of size ``size`` (small: scores move little), values; in float64,
    so that an output's small change is not float32's rounding."""
    g = torch.Generator().manual_seed(seed)
    d, e = n + 2, 5
    c = torch.randn(tokens, n, generator=g, dtype=torch.float64) * 3
    V = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64))[0]
    q = torch.randn(queries, d, generator=g, dtype=torch.float64) * size
    values = torch.randn(tokens, e, generator=g, dtype=torch.float64)

    def output(coefficients):
        probs = torch.softmax(q @ (coefficients @ V.T).T, dim=-1)
        return probs, probs @ values

    grad = (q @ V).unsqueeze(1).expand(queries, tokens, n)  # ∂(q·k_t)/∂c_tj without RoPE
    return c, V, values, output, grad


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(2, 30), st.integers(1, 5), st.integers(1, 6))
def test_key_errors_are_the_outputs_first_order_change(seed, tokens, n, queries):
    """A dropped key column's error is the attention output's actual change while the scores move little;
    the widest code costs less than dropping. (Queries of 1e-4: the second-order rest stays under 0.3% of the
    change in 1,500 draws; at 1e-3 a draw reached 2.6%.)"""
    c, V, values, output, grad = _keys_attended(seed, tokens, n, queries, 1e-4)
    probs, out = output(c)
    e = attended_key_errors(c, grad, probs, values, out)
    assert e.shape == (n, len(WIDTHS)) and (e >= 0).all()
    for j in range(n):
        dropped = c.clone()
        dropped[:, j] = 0
        actual = (output(dropped)[1] - out).double().pow(2).sum()
        torch.testing.assert_close(e[j, 0], actual, rtol=2e-2, atol=1e-18)
    assert (e[:, -1] <= e[:, 0] * 1.0001 + 1e-24).all()
    with pytest.raises(ValueError, match="first width must be 0"):
        attended_key_errors(c, grad, probs, values, out, widths=(1, 2))


def test_key_rounding_errors_are_the_expected_output_change():
    """Noise that is independent across tokens moves the output, on average, by the rounding estimate."""
    c, V, values, output, grad = _keys_attended(3, 200, 3, 4, 1e-3)
    probs, out = output(c)
    e = attended_key_errors(c, grad, probs, values, out, widths=(0, 2))
    g = torch.Generator().manual_seed(0)
    delta = (roundtrip_columns(c, 2) - c)[:, 1]
    trials = []
    for _ in range(200):  # the same squared error per token, signs shuffled: independent noise
        noisy = c.clone()
        noisy[:, 1] += delta * (torch.randint(0, 2, (len(delta),), generator=g) * 2 - 1)
        trials.append(float((output(noisy)[1] - out).double().pow(2).sum()))
    assert abs(np.mean(trials) / float(e[1, 1]) - 1) < 0.2
