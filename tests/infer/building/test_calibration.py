"""Calibration attention in context (`milo_infer.building.calibration.context_attention`) on a tiny
random Llama: the softmax's mass, the output and the scores' gradient, checked against the definitions."""
from types import SimpleNamespace

import pytest
import torch

from milo_infer.building.calibration import context_attention

L, HEADS, KV_HEADS, D, T, A = 2, 4, 2, 16, 9, 3


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=HEADS * D, intermediate_size=128, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.mark.parametrize("blocks", [1, 4])
def test_context_attention_is_the_softmax_over_anchor_and_blocks(model, blocks):
    g = torch.Generator().manual_seed(1)
    anchor_kv = torch.randn(L, 2, KV_HEADS, A, D, generator=g)
    in_context = context_attention(SimpleNamespace(model=model), [1, 2, 3], anchor_kv, [[5, 6, 7], [8, 9]], blocks)
    keys, values = torch.randn(KV_HEADS, T, D, generator=g), torch.randn(KV_HEADS, T, D, generator=g)
    for layer in range(L):
        ctx = in_context(0, layer, keys, values)
        M = 2 * HEADS // KV_HEADS  # the last token of each query, per query head of the group
        assert ctx.probs.shape == (KV_HEADS, M, T) and ctx.output.shape == (KV_HEADS, M, D)
        # the anchor's mass is the rest: output = anchor share × its values' mean + blocks × the block's part
        block_mass = blocks * ctx.probs.sum(-1, keepdim=True)
        assert (block_mass < 1).all() and (block_mass > 0).all()
        anchor_part = ctx.output - blocks * ctx.probs @ values
        anchor_mean = anchor_part / (1 - block_mass)  # a convex combination of the anchor's values
        lo, hi = anchor_kv[layer, 1].amin(-2, keepdim=True), anchor_kv[layer, 1].amax(-2, keepdim=True)
        assert (anchor_mean >= lo - 1e-4).all() and (anchor_mean <= hi + 1e-4).all()
        # the gradient: a key moved along a direction moves that token's score (and only its) by grad × step
        directions = torch.randn(KV_HEADS, 3, D, generator=g)
        grad = ctx.score_gradient(directions)
        t, j, eps = 4, 1, 1e-3
        moved = keys.clone()
        moved[:, t] += eps * directions[:, j]
        log_change = (in_context(0, layer, moved, values).probs.log() - ctx.probs.log()).double()
        score_change = log_change[..., t] - log_change[..., 0]  # the normaliser's change cancels
        torch.testing.assert_close(score_change, eps * grad[..., t, j].double(), rtol=2e-2, atol=1e-6)
