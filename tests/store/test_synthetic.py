"""milo_store/synthetic.py: a synthetic block's factors known from its draw are its SVD, and the same generator
gives the same K/V either way (what `milo bench --synthetic` builds its stores from, issue 55)."""
import torch
from hypothesis import given, settings, strategies as st

from milo_store.layout import Layout
from milo_store.synthetic import synthetic_block_factors, synthetic_block_kv


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 40), head_dim=st.sampled_from([4, 8, 16]), seed=st.integers(0, 2**16))
def test_the_drawn_factors_are_the_blocks_svd_and_its_k_v_those_of_the_old_draw(tokens, head_dim, seed):
    layout = Layout(2, 2, head_dim)
    factors, k, v = synthetic_block_factors(layout, tokens, torch.Generator().manual_seed(seed))
    old_k, old_v = synthetic_block_kv(layout, tokens, torch.Generator().manual_seed(seed))
    assert torch.equal(k, old_k) and torch.equal(v, old_v)  # same draws, same order
    n = min(tokens, head_dim)
    x = torch.stack((k, v), dim=1)  # [L, 2, H, T, d]
    assert factors.A.shape == (2, 2, 2, tokens, n) and factors.B.shape == (2, 2, 2, head_dim, n)
    eye = torch.eye(n).expand(2, 2, 2, n, n)
    torch.testing.assert_close(factors.A.transpose(-1, -2) @ factors.A, eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(factors.B.transpose(-1, -2) @ factors.B, eye, atol=1e-5, rtol=0)
    assert (factors.S[..., 1:] <= factors.S[..., :-1]).all()
    torch.testing.assert_close(factors.S, torch.linalg.svdvals(x), rtol=1e-4, atol=1e-4)
    rebuilt = (factors.A * factors.S.unsqueeze(-2)) @ factors.B.transpose(-1, -2)
    torch.testing.assert_close(rebuilt, x, rtol=0, atol=1e-4 * float(x.abs().max()))

