"""A Gated DeltaNet layer's recurrent state over a block: what a hybrid model's linear layers carry from one block to
the next (Qwen3.5, Qwen3-Next; issue 61).

Per value head and token, in transformers' orientation (a state S [key_dim, value_dim]; α_t = exp(g_t), g_t <= 0;
k_t L2-normed and repeated to the value heads; β_t in (0, 1)):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ

which is affine in the state a block starts from: S_out = M S_in + C. Blocks compose in placement order ((M1, C1) then
(M2, C2) is (M2 M1, M2 C1 + C2)), so a block encoded once can follow any others, the same approximation milo makes
for attention. `recurrent` runs it token by token (the reference, as transformers' decode step does); `advance` runs
a block from a state with matmuls and one unit-triangular solve a chunk (the chunk form of the gated delta rule),
never forming M; `transition` is a block's dense (M, C) and `compose`/`apply` use it. Every argument and result is
fp32: the chain of M loses precision in half types (flash-linear-attention's context-parallel notes say the same).

Shapes: k [T, H, dk], v [T, H, dv], beta and g [T, H], a state [H, dk, dv], M [H, dk, dk].
"""
from __future__ import annotations

import torch
from transformers.activations import ACT2FN

CHUNK = 64  # tokens a solve: the T×T triangle stays small and its decays within a chunk


def recurrent(state: torch.Tensor, k, v, beta, g) -> torch.Tensor:
    """The state after the block, one token at a time."""
    for t in range(k.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
    return state


def advance(state: torch.Tensor, k, v, beta, g, chunk: int = CHUNK) -> torch.Tensor:
    """The state after the block, `chunk` tokens a step: equal to `recurrent` within fp32 rounding."""
    for start in range(0, k.shape[0], chunk):
        part = slice(start, start + chunk)
        state = _advance_chunk(state, k[part], v[part], beta[part], g[part])
    return state


def _advance_chunk(state, k, v, beta, g):
    """With G the cumulative log decay and S_0 the state in: each token's update u_t = β_t (v_t − e^{G_t} S_0ᵀk_t −
    Σ_{s<t} e^{G_t − G_s} (k_tᵀk_s) u_s), a unit-lower-triangular system; S_T = e^{G_T} S_0 + Σ_t e^{G_T − G_t} k_t u_tᵀ.
    Every exponent is <= 0 (a decay near 0 underflows to 0, as the recurrence's does), never > 0."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H, T, dk], [H, T, dv]
    beta, log_decay = beta.transpose(0, 1)[..., None], g.transpose(0, 1).cumsum(-1)  # [H, T, 1], [H, T]
    tokens = k.shape[1]
    earlier = torch.ones(tokens, tokens, dtype=torch.bool, device=k.device).tril(-1)
    between = (log_decay[:, :, None] - log_decay[:, None, :]).masked_fill(~earlier, float("-inf")).exp()
    system = torch.eye(tokens, device=k.device) + beta * (k @ k.mT) * between
    updates = torch.linalg.solve_triangular(system, beta * (v - log_decay.exp()[..., None] * (k @ state)),
                                            upper=False, unitriangular=True)
    last = log_decay[:, -1:]
    return last.exp()[..., None] * state + k.mT @ ((last - log_decay).exp()[..., None] * updates)


def transition(k, v, beta, g) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (M [H, dk, dk], C [H, dk, dv]): M the state it hands on from an identity with no values of its
    own, C its state from zero."""
    heads, key_dim = k.shape[1], k.shape[2]
    identity = torch.eye(key_dim, device=k.device).expand(heads, key_dim, key_dim)
    return (advance(identity, k, torch.zeros_like(k), beta, g),
            advance(k.new_zeros(heads, key_dim, v.shape[2]), k, v, beta, g))


def compose(first, second):
    """The pair of `first` then `second`."""
    (m1, c1), (m2, c2) = first, second
    return m2 @ m1, m2 @ c1 + c2


def apply(pair, state: torch.Tensor) -> torch.Tensor:
    m, c = pair
    return m @ state + c


def layer_inputs(module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a GDN layer (transformers' Qwen3.5 or Qwen3-Next module) feeds its recurrence, read from its input
    `hidden` [B, T, hidden] (the sequence from its start: the short convolution reads kernel−1 tokens back): fp32
    k, v, beta, g as above ([B, T, ...]: the conv and its activation applied, k L2-normed and repeated to the value
    heads), and the convolution's inputs [B, T, conv_dim], whose last kernel−1 rows are what the next token's
    convolution reads of this block (its conv tail)."""
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z (and b, a) interleaved by key head
        q, k, v, _, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
        conv_inputs = torch.cat([x.flatten(2) for x in (q, k, v)], dim=-1)
    else:
        conv_inputs, b, a = module.in_proj_qkv(hidden), module.in_proj_b(hidden), module.in_proj_a(hidden)
    tokens, kernel = hidden.shape[1], module.conv_kernel_size
    mixed = torch.nn.functional.conv1d(conv_inputs.mT, module.conv1d.weight, module.conv1d.bias,
                                       padding=kernel - 1, groups=conv_inputs.shape[-1])[..., :tokens]
    mixed = ACT2FN[module.activation](mixed).mT.float()
    _, k, v = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    k = k.unflatten(-1, (module.num_k_heads, module.head_k_dim))
    k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(
        module.num_v_heads // module.num_k_heads, dim=2)
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)
    return k, v.unflatten(-1, (module.num_v_heads, module.head_v_dim)), b.float().sigmoid(), g, conv_inputs
