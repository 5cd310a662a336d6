import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_store.codecs.transform import TransformCodec
from milo_store.codecs.transform_reference import decode_reference
from milo_store.codecs.rate_distortion import WIDTHS, column_errors, quantize_columns


def blocks(seed: int, units: int, d: int, lengths: list[int]) -> list[torch.Tensor]:
    """Correlated rows with a large shared mean, as pre-RoPE keys have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(units, d, d, generator=g)
    spread = torch.logspace(1, -2, d)
    mean = torch.randn(units, 1, d, generator=g) * 20
    return [(torch.randn(units, t, d, generator=g) * spread) @ mix + mean for t in lengths]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 3), st.sampled_from([4, 8, 16]),
       st.lists(st.integers(1, 60), min_size=1, max_size=3), st.floats(0.05, 1.0))
def test_blocks_round_trip_within_the_budget(seed, units, d, lengths, ratio):
    samples = blocks(seed, units, d, lengths)
    weight = torch.rand(units, d, generator=torch.Generator().manual_seed(seed)) + 0.5
    codec = TransformCodec.fit(samples, ratio, weight)
    assert codec.widths.shape == (units, d) and set(codec.widths.unique().tolist()) <= set(WIDTHS)
    assert sum(codec.block_bytes(t) for t in lengths) <= ratio * 2 * units * d * sum(lengths) + 1e-6
    for x in samples:
        data = codec.encode(x)
        assert len(data) == codec.block_bytes(x.shape[1])
        codes, scale, low = codec.parse(data, x.shape[1])
        c = codec.transform.project(x)
        expected = quantize_columns(c, codec.widths)
        assert torch.equal(codes, expected[0]) and torch.equal(scale, expected[1]) and torch.equal(low, expected[2])
        back = codec.decode(data, x.shape[1])
        assert back.dtype == torch.float32 and back.shape == x.shape
        torch.testing.assert_close(back, decode_reference(codes, scale, low, *codec.stored()))


def test_more_bytes_decode_closer():
    samples = blocks(0, 2, 16, [40, 50])
    errors = []
    for ratio in (0.05, 0.1, 0.2, 0.4, 1.0):
        codec = TransformCodec.fit(samples, ratio)
        fitted = sum(column_errors(codec.transform.project(s)) for s in samples).reshape(-1, len(WIDTHS))
        chosen = np.searchsorted(WIDTHS, codec.widths.reshape(-1).numpy())
        errors.append(float(fitted[np.arange(len(chosen)), chosen].sum()))
    assert all(b <= a for a, b in zip(errors, errors[1:])) and errors[-1] < errors[0] / 100
    x, full = samples[0], TransformCodec.fit(samples, 1.0)
    assert (full.decode(full.encode(x), 40) - x).norm() / x.norm() < 1e-2  # 8 bits everywhere: close to exact (the mean and basis are fp16)


def test_a_dropped_everything_codec_decodes_the_mean():
    samples = blocks(1, 1, 8, [30])
    codec = TransformCodec.fit(samples, 1.0)
    codec.widths.zero_()
    data = codec.encode(samples[0])
    assert data == b""
    torch.testing.assert_close(codec.decode(data, 30), codec.transform.mean.half().float().unsqueeze(1).expand(1, 30, 8))


def test_bad_blocks_and_bytes_are_refused():
    samples = blocks(2, 2, 8, [20])
    codec = TransformCodec.fit(samples, 0.3)
    with pytest.raises(ValueError, match="units, tokens, d"):
        codec.encode(samples[0][:1])
    bad = samples[0].clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(bad)
    with pytest.raises(ValueError, match="holds"):
        codec.decode(codec.encode(samples[0])[:-1], 20)
    with pytest.raises(ValueError, match="ratio"):
        TransformCodec.fit(samples, 0)
