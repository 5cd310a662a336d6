"""example-asvd's channel weights (`milo_infer.models.channel_scales`) on tiny random models.

Keys: the RMS of the queries that read each channel, pooled over the GQA group and tied across RoPE
pairs; values: o_proj's column norms pooled over the group. Checked against references built from
the model's own pieces (hidden states, input norm, q_proj, o_proj), on the Llama and Qwen2 paths.
"""
import pytest
import torch

from milo_infer.models import (capture_queries, channel_scales, decoder_layers, output_channel_scales,
                               query_channel_scales, rope_tables)
from milo_kernels.naive import apply_rope

L, HEADS, KV_HEADS, D = 2, 4, 2, 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kind, cls = (LlamaConfig, LlamaForCausalLM) if request.param == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = kind(vocab_size=96, hidden_size=HEADS * D, intermediate_size=128, num_hidden_layers=L,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128)
    m = cls(config).eval().requires_grad_(False)
    if request.param == "qwen2":  # q biases shift the query statistics: make them nonzero
        for layer in decoder_layers(m):
            layer.self_attn.q_proj.bias.normal_()
    return m


def ids(n=40, seed=1):
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_key_scales_are_pair_tied_group_pooled_query_rms(model):
    tokens = ids()
    s = query_channel_scales(model, tokens)
    assert s.shape == (L, KV_HEADS, D) and (s > 0).all()
    torch.testing.assert_close(s[..., :D // 2], s[..., D // 2:], rtol=0, atol=0)  # RoPE pairs share one weight
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for index, layer in enumerate(decoder_layers(model)):
        q = layer.self_attn.q_proj(layer.input_layernorm(hidden[index]))[0]
        q = q.double().unflatten(-1, (KV_HEADS, HEADS // KV_HEADS, D))  # query heads 2h, 2h+1 read KV head h
        pair = torch.cat((q[..., :D // 2], q[..., D // 2:]), dim=0)  # both channels of a pair as samples
        expected = pair.square().mean(dim=(0, 2)).sqrt()
        torch.testing.assert_close(s[index], torch.cat((expected, expected), dim=-1).float(), rtol=1e-4, atol=1e-6)


def test_captured_queries_are_the_projections_the_attention_reads(model):
    tokens = ids()
    q = capture_queries(model, tokens)
    assert q.shape == (L, len(tokens), HEADS, D) and q.dtype == torch.float32
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for index, layer in enumerate(decoder_layers(model)):
        expected = layer.self_attn.q_proj(layer.input_layernorm(hidden[index]))[0].unflatten(-1, (HEADS, D))
        torch.testing.assert_close(q[index], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="at least one token"):
        capture_queries(model, [])


def test_tied_key_weights_make_the_error_the_same_after_rope(model):
    """diag(s) commutes with RoPE: the s-weighted error of pre-RoPE keys is that of the rotated keys."""
    s = query_channel_scales(model, ids())[0, 0]
    cos, sin = rope_tables(model, 64)
    error = torch.randn(64, D, generator=torch.Generator().manual_seed(2))  # one key error per position
    before = (error * s).norm(dim=-1)
    after = (apply_rope(error, cos, sin) * s).norm(dim=-1)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    untied = s.clone()
    untied[0] *= 3
    assert not torch.allclose((apply_rope(error, cos, sin) * untied).norm(dim=-1), (error * untied).norm(dim=-1))


def test_value_scales_are_o_proj_column_norms_pooled_over_the_group(model):
    s = output_channel_scales(model)
    assert s.shape == (L, KV_HEADS, D) and (s > 0).all()
    for index, layer in enumerate(decoder_layers(model)):
        w = layer.self_attn.o_proj.weight.double()
        for h in range(KV_HEADS):
            for j in (0, 5, D - 1):
                cols = [w[:, g * D + j].norm() ** 2 for g in range(h * HEADS // KV_HEADS, (h + 1) * HEADS // KV_HEADS)]
                assert float(s[index, h, j]) == pytest.approx(float(sum(cols) / len(cols)) ** 0.5, rel=1e-5)


def test_channel_scales_stack_keys_and_values(model):
    tokens = ids(12)
    both = channel_scales(model, tokens)
    assert both.shape == (L, 2, KV_HEADS, D)
    assert torch.equal(both[:, 0], query_channel_scales(model, tokens)) and torch.equal(both[:, 1], output_channel_scales(model))


def test_query_hooks_are_removed_after_the_call_even_on_error(model):
    projections = [layer.self_attn.q_proj for layer in decoder_layers(model)]
    before = [dict(p._forward_hooks) for p in projections]
    query_channel_scales(model, ids(8))
    assert [dict(p._forward_hooks) for p in projections] == before
    with pytest.raises(IndexError):
        query_channel_scales(model, [10_000])  # outside the vocabulary: the forward pass fails
    assert [dict(p._forward_hooks) for p in projections] == before
    with pytest.raises(ValueError, match="at least one calibration token"):
        query_channel_scales(model, [])
