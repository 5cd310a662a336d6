"""A Mamba2 layer's state over a block (state space duality, SSD): what Bamba's Mamba layers carry from one block to
the next (issue 61), beside `delta_rule` for Gated DeltaNet.

Per head h and token t (x_t [P] of the head's channels, B_t and C_t [N] of its group, dt_t > 0, A_h < 0):

    S_t = exp(dt_t A_h) S_{t−1} + dt_t x_t B_tᵀ        y_t = S_t C_t + D_h x_t

so a block moves the state it starts from affinely with a *scalar* per head: S_out = m S_in + C, m = exp(Σ_t dt_t A),
C the block's state from zero. `recurrent_run` is the token-by-token reference (`step`: one token of any number of
rows); `run` the chunk form (a causal decay mask within chunks of 64, every exponent ≤ 0); `transition` a block's
(m, C); `layer_inputs`, `layer_step` (`layer_steps`: several rows at once) and `block_section` read a transformers
Bamba mixer (`BambaMixer`: in_proj to gate, x|B|C and dt; a causal convolution over x|B|C; the scan; a gated RMSNorm
by groups; out_proj) as `delta_rule`'s do a GDN layer.

Shapes: x [T, H, P], B and C [T, H, N] (repeated from the groups), dt [T, H] (after softplus and the limit), a state
[H, P, N].
"""
from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from . import packed_rows

CHUNK = 64


def recurrent_run(state: torch.Tensor, x, B, C, dt, A) -> tuple[torch.Tensor, torch.Tensor]:
    """The state after the block and each token's scan output S_t C_t (no D skip), one token at a time (`step`)."""
    outputs = []
    for t in range(x.shape[0]):
        state, out = step(state, x[t], B[t], C[t], dt[t], A)
        outputs.append(out)
    return state, torch.stack(outputs) if outputs else x.new_zeros(0, *x.shape[1:])


def step(state: torch.Tensor, x, B, C, dt, A) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: (S_t, S_t C_t) from S_{t−1} ``state`` [..., H, P, N] and the token's x [..., H, P], B and C [..., H,
    N], dt [..., H] (leading dimensions: rows, as `layer_steps` stacks its decoding rows). S_t C_t = e^{dt A} S_{t−1}
    C_t + dt x (B·C): the state read once, the new one a tensor of its own (``state`` is left as it was)."""
    decay, xs = (dt * A).exp()[..., None], dt[..., None] * x
    out = decay * (state @ C[..., None])[..., 0] + xs * (B * C).sum(-1, keepdim=True)
    after = state * decay[..., None]
    after.flatten(0, -3).baddbmm_(xs.flatten(0, -2)[..., None], B.flatten(0, -2)[..., None, :])
    return after, out


def run(state: torch.Tensor, x, B, C, dt, A, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`recurrent_run` in chunks: within one, y_t = e^{G_t} S_0 C_t + Σ_{s<=t} e^{G_t − G_s} (C_t·B_s) dt_s x_s and
    S_T = e^{G_T} S_0 + Σ_s e^{G_T − G_s} dt_s x_s B_sᵀ, G the cumulative dt·A (``C`` None: the state alone)."""
    outputs = []
    for start in range(0, x.shape[0], chunk):
        part = slice(start, start + chunk)
        state, out = _chunk(state, x[part], B[part], None if C is None else C[part], dt[part], A)
        outputs.append(out)
    if C is None:
        return state, None
    return state, torch.cat(outputs) if outputs else x.new_zeros(0, *x.shape[1:])


def _chunk(state, x, B, C, dt, A):
    log_decay = (dt * A).transpose(0, 1).cumsum(-1)  # [H, T]
    xs = (dt[:, :, None] * x).transpose(0, 1)  # [H, T, P]
    Bh = B.transpose(0, 1)  # [H, T, N]
    out = None
    if C is not None:  # outputs: the decays between every two tokens of the chunk
        tokens, Ch = x.shape[0], C.transpose(0, 1)
        upto = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).tril()
        decay = (log_decay[:, :, None] - log_decay[:, None, :]).masked_fill(~upto, float("-inf")).exp()  # [H, t, s]
        out = (((Ch @ Bh.mT) * decay) @ xs + log_decay.exp()[..., None] * (Ch @ state.mT)).transpose(0, 1)
    last = log_decay[:, -1:]
    return last.exp()[..., None] * state + (xs * (last - log_decay).exp()[..., None]).mT @ Bh, out


def transition(x, B, dt, A) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (m [H], C [H, P, N]): the decay it hands a state on with, and its state from zero."""
    state = x.new_zeros(x.shape[1], x.shape[2], B.shape[2])
    return (dt * A).sum(0).exp(), run(state, x, B, None, dt, A)[0]


def layer_inputs(module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A Bamba mixer's fp32 x [B, T, H, P], B and C [B, T, H, N], dt [B, T, H], its gate [B, T, I] and its
    convolution's inputs [B, kernel − 1 + T, conv_dim] (zeros before the first token), from its input ``hidden``
    [B, T, hidden], the sequence from its start."""
    gate, conv_inputs, dt = _projections(module, hidden)
    window = conv_inputs.new_zeros(conv_inputs.shape[0], module.conv_kernel_size - 1, conv_inputs.shape[-1])
    inputs = torch.cat((window, conv_inputs), dim=1)
    mixed = torch.nn.functional.conv1d(inputs.mT, module.conv1d.weight, module.conv1d.bias, groups=inputs.shape[-1])
    return *_scan_inputs(module, mixed.mT, dt), gate, inputs


def _projections(module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """in_proj's gate [..., I], the convolution's inputs [..., conv_dim] (x|B|C) and dt before its softplus."""
    return module.in_proj(hidden).split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)


def _scan_inputs(module, mixed: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 x [..., T, H, P], B and C [..., T, H, N] (repeated from the groups) and dt [..., T, H] (softplus, the
    limit) from the convolution's outputs ``mixed`` [..., T, conv_dim] (before its activation) and in_proj's dt."""
    mixed = ACT2FN[module.activation](mixed).float()
    x, B, C = mixed.split([module.intermediate_size, module.n_groups * module.ssm_state_size,
                           module.n_groups * module.ssm_state_size], dim=-1)
    repeat = module.num_heads // module.n_groups
    B, C = (y.unflatten(-1, (module.n_groups, module.ssm_state_size)).repeat_interleave(repeat, dim=-2)
            for y in (B, C))
    low, high = module.time_step_limit
    dt = torch.nn.functional.softplus(dt.float() + module.dt_bias.float()).clamp(low, high)
    return x.unflatten(-1, (module.num_heads, module.head_dim)), B, C, dt


def decay_rate(module) -> torch.Tensor:
    return -module.A_log.float().exp()


def layer_step(module, hidden: torch.Tensor, state: torch.Tensor, window: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixer's output over one row's tokens ``hidden`` [T, hidden] from its state [H, P, N] (fp32) and
    convolution window [kernel − 1, conv_dim]: (output [T, hidden], the state after them, the window after them)."""
    out, ((state, window),) = layer_steps(module, hidden, [(state, window, hidden.shape[0])])
    return out, state, window


def layer_steps(module, hidden: torch.Tensor, rows) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`layer_step` of several rows at once: ``hidden`` [T, hidden] their tokens end to end, ``rows`` each row's
    (state, window, tokens) in that order; (output [T, hidden], each row's (state, window) after). in_proj, the
    convolution (`packed_rows.convolve`), the norm and out_proj over all T tokens in one call each; the scan in
    `packed_rows.scan` (the decoding rows in one `step`, a prefill chunk through `run`)."""
    states, windows, lengths = zip(*rows)
    gate, conv_inputs, dt = _projections(module, hidden)
    mixed, windows = packed_rows.convolve(module.conv1d, conv_inputs, windows, lengths)
    x, B, C, dt = _scan_inputs(module, mixed, dt)
    rate = decay_rate(module)
    y, states = packed_rows.scan(lambda s, *t: step(s, *t, rate), lambda s, *t: run(s, *t, rate), states, lengths,
                                 (x, B, C, dt))
    y = (y + module.D.float()[:, None] * x).flatten(-2)
    return module.out_proj(module.norm(y.to(hidden.dtype), gate).to(hidden.dtype)), list(zip(states, windows))


def block_section(module, hidden: torch.Tensor, tokens: int) -> torch.Tensor:
    """The state section a store keeps for a Mamba2 layer over the last ``tokens`` of one row's input ``hidden``
    [T, hidden]: m [H], C [H, P, N] and the conv tail, the last kernel − 1 convolution inputs, flat in fp32."""
    x, B, _, dt, _, inputs = layer_inputs(module, hidden[None])
    m, c = transition(x[0, -tokens:], B[0, -tokens:], dt[0, -tokens:], decay_rate(module))
    return torch.cat((m, c.reshape(-1), inputs[0, -(module.conv_kernel_size - 1):].float().reshape(-1)))


def zero_state(module, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A row with no prefix: the state zero, and zeros before its first token's convolution."""
    return (torch.zeros(module.num_heads, module.head_dim, module.ssm_state_size, device=device),
            torch.zeros(module.conv_kernel_size - 1, module.conv_dim, device=device))
