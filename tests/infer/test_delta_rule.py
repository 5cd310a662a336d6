"""A GDN layer's state over blocks (`milo_infer.models.delta_rule`): the chunk form and the composed pairs equal the
token-by-token recurrence, and the inputs read from a Qwen3.5 or Qwen3-Next layer give the state and conv state
transformers' own forward leaves in its cache."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_infer.models import delta_rule
from tests.infer.families import random_model

HEADS, KEY_DIM, VALUE_DIM = 2, 8, 6


def block(tokens: int, seed: int, decay: float):
    """Random inputs as a layer makes them: L2-normed keys, β in (0, 1), log decays about `decay` (<= 0)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, HEADS, KEY_DIM, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(tokens, HEADS, VALUE_DIM, generator=gen)
    beta = torch.rand(tokens, HEADS, generator=gen)
    g = decay * (0.5 + torch.rand(tokens, HEADS, generator=gen))
    return k, v, beta, g


def concatenated(blocks):
    return [torch.cat(parts) for parts in zip(*blocks)]


def close(a, b, scale=1.0):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)


# lengths of 1, within a chunk, and past one (no multiple of it); decays from none to all but a token's worth
lengths = st.lists(st.sampled_from([1, 2, 7, 63, 64, 65, 130]), min_size=1, max_size=3)
decays = st.sampled_from([0.0, -1e-3, -0.1, -2.0, -40.0])


@settings(max_examples=25, deadline=None)
@given(lengths=lengths, decay=decays, seed=st.integers(0, 2**16))
def test_chunked_and_composed_pairs_equal_the_recurrence(lengths, decay, seed):
    blocks = [block(n, seed + i, decay) for i, n in enumerate(lengths)]
    start = torch.randn(HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(seed))
    expected = delta_rule.recurrent(start, *concatenated(blocks))
    scale = expected.abs().max().item() + 1
    close(delta_rule.advance(start, *concatenated(blocks)), expected, scale)
    state = start
    for b in blocks:  # block by block, each from the state the last left
        state = delta_rule.advance(state, *b)
    close(state, expected, scale)
    pair = delta_rule.transition(*blocks[0])
    for b in blocks[1:]:
        pair = delta_rule.compose(pair, delta_rule.transition(*b))
    close(delta_rule.apply(pair, start), expected, scale)


def test_the_order_of_blocks_changes_the_state():
    """The composition is in placement order, not a sum: it fails if `compose` swapped its arguments."""
    first, second = block(5, 1, -0.1), block(5, 2, -0.1)
    start = torch.zeros(HEADS, KEY_DIM, VALUE_DIM)
    forward = delta_rule.apply(delta_rule.compose(delta_rule.transition(*first), delta_rule.transition(*second)), start)
    close(forward, delta_rule.recurrent(start, *concatenated([first, second])))
    assert (forward - delta_rule.recurrent(start, *concatenated([second, first]))).abs().max() > 1e-3


def tiny_hybrid(family: str):
    import transformers

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    else:
        config = transformers.Qwen3_5TextConfig(**shape)
    return random_model(config)  # its decays and gated norms off their initial values too


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_read_inputs_give_the_models_own_state(family):
    """The state a layer's read inputs run to is the one transformers' chunked forward cached, and the state of a
    prefix composed with the rest's pair (encoded after that prefix) is it too; the conv state is the last inputs."""
    model = tiny_hybrid(family)
    inputs = {}
    for l, layer in enumerate(model.model.layers):
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.register_forward_pre_hook(
                lambda module, args, kwargs, l=l: inputs.__setitem__(l, (module, kwargs["hidden_states"])),
                with_kwargs=True)
    ids = torch.randint(3, 300, (1, 29), generator=torch.Generator().manual_seed(1))
    cache = model(ids, use_cache=True).past_key_values
    assert len(inputs) == 3
    for l, (module, hidden) in inputs.items():
        k, v, beta, g, conv_inputs = delta_rule.layer_inputs(module, hidden)
        k, v, beta, g = k[0], v[0], beta[0], g[0]
        cached = cache.layers[l].recurrent_states[0][0]
        close(delta_rule.recurrent(torch.zeros_like(cached), k, v, beta, g), cached)
        prefix, rest = slice(0, 11), slice(11, None)
        pair = delta_rule.compose(delta_rule.transition(k[prefix], v[prefix], beta[prefix], g[prefix]),
                                  delta_rule.transition(k[rest], v[rest], beta[rest], g[rest]))
        close(delta_rule.apply(pair, torch.zeros_like(cached)), cached)
        kernel = module.conv_kernel_size
        close(cache.layers[l].conv_states[0][0], conv_inputs[0, -kernel:].mT)
