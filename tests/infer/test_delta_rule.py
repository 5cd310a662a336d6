"""A GDN layer's state over blocks (`milo_infer.models.delta_rule`): the chunk form and the composed pairs equal the
token-by-token recurrence, and the inputs read from a Qwen3.5 or Qwen3-Next layer give the state and conv state
transformers' own forward leaves in its cache."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_infer.models import delta_rule
from tests.infer.families import linear_layer_io, random_model

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


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_a_blocks_section_carries_the_anchors_state_on_as_the_model_does(family):
    """`encode_blocks` keeps, per linear layer, the block's own (M, C) and conv tail: the anchor's state (its section
    from zero) carried through the block's pair is the state transformers caches after [anchor][block], and the
    block's tail its conv state's last kernel − 1 inputs."""
    from milo_infer.building.builder import encode_anchor
    from milo_infer.building.encoding import encode_blocks
    from milo_infer.models.families import model_layout

    model = tiny_hybrid(family)
    layout = model_layout(model.config)
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    anchor, block = ids[:9], ids[9:]
    _, anchor_states = encode_anchor(model, anchor, layout)
    (keys, _, states), = encode_blocks(model, [(ids, len(block))])
    assert sorted(states) == sorted(anchor_states) == [0, 1, 2] and keys.shape[2] == len(block)
    cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    for l, section in states.items():
        parts, before = layout.state_section(l, section), layout.state_section(l, anchor_states[l])
        state = delta_rule.apply((parts["M"], parts["C"]), before["C"])  # the anchor from zero: its C
        close(state, cache.layers[l].recurrent_states[0][0])
        close(parts["conv"], cache.layers[l].conv_states[0][0, :, 1:].mT)


def test_a_tiny_hybrid_builds_a_store_of_its_states(tmp_path):
    """The real build path over a tiny Qwen3.5: its linear layers' sections in every block and the anchor's, exact in a
    float32 store (what `encode_blocks` computed for the same rows), its attention layers' K/V beside them."""
    from milo_infer.building.builder import build_store
    from milo_infer.building.config import BuildConfig
    from milo_infer.building.encoding import encode_blocks
    from milo_infer.models.identity import model_identity
    from milo_infer.models.loading import LoadedModel
    from milo_infer.tasks.corpus import Demonstration, task_from_corpus
    from milo_store import CompressionConfig, MiloStore
    from tests.infer.families import byte_tokenizer

    model = tiny_hybrid("qwen3_5_text")
    loaded = LoadedModel(model=model, tokenizer=byte_tokenizer(), identity=model_identity(model))
    demos = [Demonstration(f"message {i} about my card", ("refund", "lost")[i % 2], f"d{i}") for i in range(4)]
    task = task_from_corpus(demos)
    build_store(tmp_path / "s", loaded, demos, task, BuildConfig(
        block_size=2, context_blocks=0, order="corpus", compression=CompressionConfig(codec="identity",
                                                                                      dtype="float32")),
        progress=False)
    with MiloStore.open(tmp_path / "s") as store:
        assert [spec.kind for spec in store.layout.layers] == ["linear"] * 3 + ["attention"]
        assert store.verify_all() == [] and store.accounting()["state_bytes"] > 0
        anchor = store.meta["build"]["anchor_token_ids"]
        for i, block in enumerate(store.stored_blocks([0, 1])):
            ids = store.token_ids(i).tolist()
            (_, _, expected), = encode_blocks(model, [(anchor + ids, len(ids))])
            states = store.layout.block_states(store.ranks[i], int(store.block_tokens[i]), block)
            for l, section in states.items():
                torch.testing.assert_close(torch.cat([section[k].reshape(-1) for k in ("M", "C", "conv")]),
                                           expected[l], rtol=0, atol=0)
        assert sorted(store.anchor_states()) == [0, 1, 2]


@settings(max_examples=20, deadline=None)
@given(tokens=st.sampled_from([1, 5, 63, 64, 65, 130]), decay=decays, seed=st.integers(0, 2**16))
def test_the_chunk_forms_outputs_equal_the_recurrences(tokens, decay, seed):
    k, v, beta, g = block(tokens, seed, decay)
    q = torch.randn(tokens, HEADS, KEY_DIM, generator=torch.Generator().manual_seed(seed + 1))
    start = torch.randn(HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(seed))
    state, out = delta_rule.recurrent_run(start, q, k, v, beta, g)
    scale = max(state.abs().max().item(), out.abs().max().item()) + 1
    chunked_state, chunked_out = delta_rule.run(start, q, k, v, beta, g)
    close(chunked_state, state, scale)
    close(chunked_out, out, scale)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_a_layer_step_gives_the_layers_output_from_any_state_it_reached(family):
    """`layer_step` over a row's tokens is the layer's own output there, whole or in two parts (the second from the
    state and conv window the first left): what the engine runs a row's prefill chunks and decode steps with."""
    ids = torch.randint(3, 300, (1, 70), generator=torch.Generator().manual_seed(3))
    seen, _ = linear_layer_io(tiny_hybrid(family), "linear_attn", ids, use_cache=False)
    for module, hidden, out in seen.values():
        state, window = delta_rule.zero_state(module)
        whole, _, _ = delta_rule.layer_step(module, hidden, state, window)
        close(whole, out)
        first, state, window = delta_rule.layer_step(module, hidden[:66], state, window)
        second, _, _ = delta_rule.layer_step(module, hidden[66:], state, window)
        close(torch.cat((first, second)), out)
