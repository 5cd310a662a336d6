"""A Gated DeltaNet layer's recurrent state over a block: what a hybrid model's linear layers carry from one block to
the next (Qwen3.5, Qwen3-Next; issue 61).

Per value head and token, in transformers' orientation (a state S [key_dim, value_dim]; α_t = exp(g_t), g_t <= 0;
k_t L2-normed and repeated to the value heads; β_t in (0, 1)):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ

which is affine in the state a block starts from: S_out = M S_in + C. Blocks compose in placement order ((M1, C1) then
(M2, C2) is (M2 M1, M2 C1 + C2)), so a block encoded once can follow any others, the same approximation milo makes
for attention. `recurrent` runs it token by token (the reference, as transformers' decode step does; `step` is one
token of any number of rows); `advance` runs a block from a state with matmuls and one unit-triangular solve a chunk
(the chunk form of the gated delta rule), never forming M; `transition` is a block's dense (M, C) and
`compose`/`apply` use it. `recurrent_run` and `run` give each token's output too (what the layer attends);
`layer_step` runs a whole layer over one row's tokens from its state and conv window, and `layer_steps` over several
rows' at once, as the engine does (`milo_infer.runtime.linear_rows`). Every argument and result is fp32: the chain of
M loses precision in half types (flash-linear-attention's context-parallel notes say the same).

Shapes: k [T, H, dk], v [T, H, dv], beta and g [T, H], a state [H, dk, dv], M [H, dk, dk].
"""
from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from . import packed_rows

CHUNK = 64  # tokens a solve: the T×T triangle stays small and its decays within a chunk


def recurrent(state: torch.Tensor, k, v, beta, g) -> torch.Tensor:
    """The state after the block, one token at a time."""
    return recurrent_run(state, None, k, v, beta, g)[0]


def recurrent_run(state: torch.Tensor, q, k, v, beta, g) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The state after the block and, given queries ``q``, each token's output S_tᵀ q_t, one token at a time (the
    reference `run` is held to): `step` a token."""
    outputs = []
    for t in range(k.shape[0]):
        state, out = step(state, k[t] if q is None else q[t], k[t], v[t], beta[t], g[t])
        outputs.append(out)
    return state, None if q is None else torch.stack(outputs) if outputs else v.new_zeros(0, *v.shape[1:])


def step(state: torch.Tensor, q, k, v, beta, g) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: (S_t, S_tᵀ q_t) from S_{t−1} ``state`` [..., H, dk, dv] and the token's q, k [..., H, dk], v [..., H,
    dv], beta, g [..., H] (leading dimensions: rows, as `layer_steps` stacks its decoding rows). With α = e^g and
    δ = β (v − α S_{t−1}ᵀk), S_t = α S_{t−1} + k δᵀ and S_tᵀq = α S_{t−1}ᵀq + δ (kᵀq): the state read once for both
    products, the new one a tensor of its own (``state`` is left as it was)."""
    decay = g.exp()[..., None]
    read = torch.stack((k, q), dim=-2) @ state  # [..., H, 2, dv]: kᵀS and qᵀS
    delta = beta[..., None] * (v - decay * read[..., 0, :])
    out = decay * read[..., 1, :] + delta * (k * q).sum(-1, keepdim=True)
    after = state * decay[..., None]
    after.flatten(0, -3).baddbmm_(k.flatten(0, -2)[..., None], delta.flatten(0, -2)[..., None, :])
    return after, out


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
    inputs = torch.cat((window, conv_inputs), dim=1)
    _, k, v = _convolved(module, torch.nn.functional.conv1d(inputs.mT, module.conv1d.weight, module.conv1d.bias,
                                                            groups=inputs.shape[-1]).mT)
    return k, v, _beta(module, b), _log_decay(module, a), conv_inputs


def layer_step(module, hidden: torch.Tensor, state: torch.Tensor, window: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output over one row's tokens ``hidden`` [T, hidden], from its state [H, dk, dv] (fp32) and its
    convolution's last kernel − 1 inputs ``window`` [kernel − 1, conv_dim]: (output [T, hidden], the state after them,
    the window after them). What transformers' forward computes for the row alone with its cache at that state."""
    out, ((state, window),) = layer_steps(module, hidden, [(state, window, hidden.shape[0])])
    return out, state, window


def layer_steps(module, hidden: torch.Tensor, rows) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`layer_step` of several rows at once: ``hidden`` [T, hidden] their tokens end to end, ``rows`` each row's
    (state, window, tokens) in that order; (output [T, hidden], each row's (state, window) after). The projections,
    the convolution (`packed_rows.convolve`), the norm and the output projection run over all T tokens in one call
    each; the recurrence in `packed_rows.scan` (the decoding rows in one `step`, a prefill chunk through `run`)."""
    states, windows, lengths = zip(*rows)
    conv_inputs, z, b, a = (x[0] for x in _projections(module, hidden[None]))
    mixed, windows = packed_rows.convolve(module.conv1d, conv_inputs, windows, lengths)
    q, k, v = _convolved(module, mixed)
    out, states = packed_rows.scan(step, run, states, lengths,
                                   (q * module.head_k_dim ** -0.5, k, v, _beta(module, b), _log_decay(module, a)))
    norm, project = (getattr(module, "o_norm", None) or module.norm), (getattr(module, "o_proj", None) or module.out_proj)
    core = norm(out.reshape(-1, module.head_v_dim).to(hidden.dtype), z.reshape(-1, module.head_v_dim))
    return project(core.reshape(hidden.shape[0], -1)), list(zip(states, windows))


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


def _convolved(module, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 q and k (L2-normed, repeated to the value heads) and v [..., T, H, d] of the convolution's outputs
    ``mixed`` [..., T, conv_dim] (before its activation)."""
    mixed = ACT2FN[module.activation](mixed).float()
    q, k, v = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    repeat = module.num_v_heads // module.num_k_heads
    q, k = ((x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(repeat, dim=-2)
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
