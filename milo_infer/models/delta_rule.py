"""A Gated DeltaNet layer's recurrent state over a block: what a hybrid model's linear layers carry from one block to
the next (Qwen3.5, Qwen3-Next; issue 61).

Per value head and token, in transformers' orientation (a state S [key_dim, value_dim]; α_t = exp(g_t), g_t <= 0;
k_t L2-normed and repeated to the value heads; β_t in (0, 1)):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ

which is affine in the state a block starts from: S_out = M S_in + C. Blocks compose in placement order ((M1, C1) then
(M2, C2) is (M2 M1, M2 C1 + C2)), so a block encoded once can follow any others, the same approximation milo makes
for attention. `recurrent` runs it token by token (the reference, as transformers' decode step does); `advance` runs
a block from a state with matmuls and one unit-triangular solve a chunk (the chunk form of the gated delta rule),
never forming M; `transition` is a block's dense (M, C) and `compose`/`apply` use it. `recurrent_run` and `run` give
each token's output too (what the layer attends), and `layer_step` runs a whole layer over one row's tokens from its
state and conv window, as the engine does (`milo_infer.runtime.linear_rows`). Every argument and result is
fp32: the chain of M loses precision in half types (flash-linear-attention's context-parallel notes say the same).

Shapes: k [T, H, dk], v [T, H, dv], beta and g [T, H], a state [H, dk, dv], M [H, dk, dk].
"""
from __future__ import annotations

import torch
from transformers.activations import ACT2FN

CHUNK = 64  # tokens a solve: the T×T triangle stays small and its decays within a chunk


def recurrent(state: torch.Tensor, k, v, beta, g) -> torch.Tensor:
    """The state after the block, one token at a time."""
    return recurrent_run(state, None, k, v, beta, g)[0]


def recurrent_run(state: torch.Tensor, q, k, v, beta, g) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The state after the block and, given queries ``q``, each token's output S_tᵀ q_t, one token at a time (the
    reference `run` is held to)."""
    outputs = []
    for t in range(k.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
        if q is not None:
            outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return state, None if q is None else torch.stack(outputs) if outputs else v.new_zeros(0, *v.shape[1:])


def advance(state: torch.Tensor, k, v, beta, g, chunk: int = CHUNK) -> torch.Tensor:
    """The state after the block, `chunk` tokens a step: equal to `recurrent` within fp32 rounding."""
    return run(state, None, k, v, beta, g, chunk)[0]


def run(state: torch.Tensor, q, k, v, beta, g, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The state after the block and, given queries ``q`` [T, H, dk], each token's output S_tᵀ q_t [T, H, dv] (S_t the
    state after its own update), `chunk` tokens a step."""
    outputs = []
    for start in range(0, k.shape[0], chunk):
        part = slice(start, start + chunk)
        state, out = _advance_chunk(state, None if q is None else q[part], k[part], v[part], beta[part], g[part])
        outputs.append(out)
    if q is None:
        return state, None
    return state, torch.cat(outputs, dim=1).transpose(0, 1) if outputs else v.new_zeros(0, *v.shape[1:])


def _advance_chunk(state, q, k, v, beta, g):
    """With G the cumulative log decay and S_0 the state in: each token's update u_t = β_t (v_t − e^{G_t} S_0ᵀk_t −
    Σ_{s<t} e^{G_t − G_s} (k_tᵀk_s) u_s), a unit-lower-triangular system; S_T = e^{G_T} S_0 + Σ_t e^{G_T − G_t} k_t u_tᵀ,
    and a query's output o_t = e^{G_t} S_0ᵀq_t + Σ_{s<=t} e^{G_t − G_s} (q_tᵀk_s) u_s. Every exponent is <= 0 (a decay
    near 0 underflows to 0, as the recurrence's does), never > 0."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H, T, dk], [H, T, dv]
    beta, log_decay = beta.transpose(0, 1)[..., None], g.transpose(0, 1).cumsum(-1)  # [H, T, 1], [H, T]
    tokens = k.shape[1]
    earlier = torch.ones(tokens, tokens, dtype=torch.bool, device=k.device).tril(-1)
    gaps = log_decay[:, :, None] - log_decay[:, None, :]
    between = gaps.masked_fill(~earlier, float("-inf")).exp()
    system = torch.eye(tokens, device=k.device) + beta * (k @ k.mT) * between
    updates = torch.linalg.solve_triangular(system, beta * (v - log_decay.exp()[..., None] * (k @ state)),
                                            upper=False, unitriangular=True)
    last = log_decay[:, -1:]
    out = None
    if q is not None:
        q = q.transpose(0, 1)
        upto = gaps.masked_fill(~(earlier | torch.eye(tokens, dtype=torch.bool, device=k.device)), float("-inf")).exp()
        out = log_decay.exp()[..., None] * (q @ state) + ((q @ k.mT) * upto) @ updates  # [H, T, dv]
    return last.exp()[..., None] * state + k.mT @ ((last - log_decay).exp()[..., None] * updates), out


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
    conv_inputs, _, b, a = _projections(module, hidden)
    window = conv_inputs.new_zeros(conv_inputs.shape[0], module.conv_kernel_size - 1, conv_inputs.shape[-1])
    _, k, v = _convolved(module, torch.cat((window, conv_inputs), dim=1))
    return k, v, _beta(module, b), _log_decay(module, a), conv_inputs


def layer_step(module, hidden: torch.Tensor, state: torch.Tensor, window: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output over one row's tokens ``hidden`` [T, hidden], from its state [H, dk, dv] (fp32) and its
    convolution's last kernel − 1 inputs ``window`` [kernel − 1, conv_dim]: (output [T, hidden], the state after them,
    the window after them). What transformers' forward computes for the row alone with its cache at that state."""
    conv_inputs, z, b, a = _projections(module, hidden[None])
    inputs = torch.cat((window.to(conv_inputs.dtype)[None], conv_inputs), dim=1)
    q, k, v = _convolved(module, inputs)
    state, out = run(state, q[0] * module.head_k_dim ** -0.5, k[0], v[0], _beta(module, b)[0], _log_decay(module, a)[0])
    norm, project = (getattr(module, "o_norm", None) or module.norm), (getattr(module, "o_proj", None) or module.out_proj)
    core = norm(out.reshape(-1, module.head_v_dim).to(hidden.dtype), z.reshape(-1, module.head_v_dim))
    return project(core.reshape(hidden.shape[0], -1)), state, inputs[0, inputs.shape[1] - window.shape[0]:]


def _projections(module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The convolution's inputs [B, T, conv_dim] (q, k, v), the output gate z [B, T, H, dv], b and a."""
    if hasattr(module, "g_proj"):  # OLMo Hybrid: a projection each, its gate g_proj's
        conv_inputs = torch.cat([module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)], dim=-1)
        z = module.g_proj(hidden).unflatten(-1, (-1, module.head_v_dim))
        return conv_inputs, z, module.b_proj(hidden), module.a_proj(hidden)
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z (and b, a) interleaved by key head
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
        return torch.cat([x.flatten(2) for x in (q, k, v)], dim=-1), z, b, a
    z = module.in_proj_z(hidden).unflatten(-1, (-1, module.head_v_dim))
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def _convolved(module, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 q and k (L2-normed, repeated to the value heads) and v of the tokens after the first kernel − 1 of
    ``inputs`` [B, kernel − 1 + T, conv_dim] (the window the convolution reads before them)."""
    mixed = torch.nn.functional.conv1d(inputs.mT, module.conv1d.weight, module.conv1d.bias,
                                       groups=inputs.shape[-1])
    mixed = ACT2FN[module.activation](mixed).mT.float()
    q, k, v = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    repeat = module.num_v_heads // module.num_k_heads
    q, k = ((x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(repeat, dim=2)
            for x in (x.unflatten(-1, (module.num_k_heads, module.head_k_dim)) for x in (q, k)))
    return q, k, v.unflatten(-1, (module.num_v_heads, module.head_v_dim))


def _beta(module, b: torch.Tensor) -> torch.Tensor:
    """β in (0, 1), or (0, 2) where the layer allows negative eigenvalues (OLMo Hybrid's allow_neg_eigval)."""
    return b.float().sigmoid() * (2.0 if getattr(module, "allow_neg_eigval", False) else 1.0)


def _log_decay(module, a: torch.Tensor) -> torch.Tensor:
    return -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)


def block_section(module, hidden: torch.Tensor, tokens: int) -> torch.Tensor:
    """The state section a store keeps for a GDN layer (docs/format.md, "Layers") over the last ``tokens`` of one row's
    input ``hidden`` [T, hidden] (the row from its start, as the block was encoded): (M, C) of those tokens and the
    conv tail, the last kernel − 1 convolution inputs (zeros before the row's first), flat in fp32."""
    k, v, beta, g, conv_inputs = (x[0, -tokens:] if i < 4 else x[0]
                                  for i, x in enumerate(layer_inputs(module, hidden[None])))
    m, c = transition(k, v, beta, g)
    width = module.conv_kernel_size - 1
    tail = conv_inputs.new_zeros(width, conv_inputs.shape[-1])
    kept = conv_inputs[max(0, len(conv_inputs) - width):]
    tail[width - len(kept):] = kept
    return torch.cat((m.reshape(-1), c.reshape(-1), tail.float().reshape(-1)))


def zero_state(module, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A row with no prefix: the state zero, and zeros before its first token's convolution."""
    return (torch.zeros(module.num_v_heads, module.head_k_dim, module.head_v_dim, device=device),
            torch.zeros(module.conv_kernel_size - 1, 2 * module.key_dim + module.value_dim, device=device))
