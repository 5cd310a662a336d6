"""A Mamba2 layer's state over blocks (`milo_infer.models.ssd`): the chunk form equals the token-by-token scan, a
block's (m, C) carries any state across it, and the whole layer over a row's tokens is a tiny Bamba's own mixer,
whole or in parts, and its state and conv state the ones transformers caches."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_infer.models import ssd
from tests.infer.families import linear_layer_io, random_model

HEADS, HEAD_DIM, STATE = 3, 4, 5


def block(tokens: int, seed: int, rate: float):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HEADS, HEAD_DIM, generator=gen), torch.randn(tokens, HEADS, STATE, generator=gen),
            torch.randn(tokens, HEADS, STATE, generator=gen), torch.rand(tokens, HEADS, generator=gen) * rate + 1e-3)


def close(a, b, scale=1.0):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.sampled_from([1, 2, 7, 63, 64, 65, 130]), min_size=1, max_size=3),
       rate=st.sampled_from([1e-3, 0.1, 2.0, 8.0]), seed=st.integers(0, 2**16))
def test_the_chunk_form_and_the_blocks_pairs_equal_the_scan(lengths, rate, seed):
    A = -torch.rand(HEADS, generator=torch.Generator().manual_seed(seed)) - 0.1
    blocks = [block(n, seed + i, rate) for i, n in enumerate(lengths)]
    start = torch.randn(HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(seed))
    joined = [torch.cat(part) for part in zip(*blocks)]
    state, out = ssd.recurrent_run(start, *joined, A)
    scale = max(state.abs().max().item(), out.abs().max().item()) + 1
    chunked_state, chunked_out = ssd.run(start, *joined, A)
    close(chunked_state, state, scale)
    close(chunked_out, out, scale)
    carried = start
    for x, B, _, dt in blocks:  # each block's (m, C), in order
        m, c = ssd.transition(x, B, dt, A)
        carried = m[:, None, None] * carried + c
    close(carried, state, scale)


def tiny_bamba():
    import transformers

    return random_model(transformers.BambaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[3], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=6,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16))


def test_a_layer_step_gives_the_mixers_output_and_a_blocks_section_its_cached_state():
    from transformers import DynamicCache

    model = tiny_bamba()
    ids = torch.randint(3, 300, (1, 70), generator=torch.Generator().manual_seed(3))
    seen, out = linear_layer_io(model, "mamba", ids, use_cache=True, cache=DynamicCache(config=model.config))
    cache = out.cache
    assert len(seen) == 3
    for l, (module, hidden, out) in seen.items():
        state, window = ssd.zero_state(module)
        whole, final, _ = ssd.layer_step(module, hidden, state, window)
        close(whole, out)
        close(final, cache.layers[l].recurrent_states[0][0].float())
        first, state, window = ssd.layer_step(module, hidden[:50], state, window)
        second, _, _ = ssd.layer_step(module, hidden[50:], state, window)
        close(torch.cat((first, second)), out)
        section = ssd.block_section(module, hidden, 20)  # the last 20 tokens' pair, carrying the state before them
        H, P, N = module.num_heads, module.head_dim, module.ssm_state_size
        _, before, _ = ssd.layer_step(module, hidden[:50], torch.zeros(H, P, N), torch.zeros_like(window))
        m, c = section[:H], section[H:H + H * P * N].view(H, P, N)
        close(m[:, None, None] * before + c, cache.layers[l].recurrent_states[0][0].float())
        close(section[H + H * P * N:].view(module.conv_kernel_size - 1, -1),
              cache.layers[l].conv_states[0][0, :, 1:].mT)
