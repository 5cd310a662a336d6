"""LFM2's gated short convolution over a block (issue 61): y = C ⊙ conv(B ⊙ x), a causal depthwise convolution of
``conv_L_cache`` taps. It keeps no recurrent state: what a block hands the next is its last kernel − 1 inputs of
the convolution (B ⊙ x), its conv tail, so a block's state section is that tail alone (`LayerSpec` rule ``conv``).
The same functions as `delta_rule` and `ssd`, for a transformers ``Lfm2ShortConv``."""
from __future__ import annotations

import torch

from . import packed_rows


def layer_step(module, hidden: torch.Tensor, state: torch.Tensor, window: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output over one row's tokens ``hidden`` [T, hidden] after its convolution's last kernel − 1 inputs
    ``window``: (output [T, hidden], the state as it was (none), the window after them)."""
    out, ((state, window),) = layer_steps(module, hidden, [(state, window, hidden.shape[0])])
    return out, state, window


def layer_steps(module, hidden: torch.Tensor, rows) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`layer_step` of several rows at once: ``hidden`` [T, hidden] their tokens end to end, ``rows`` each row's
    (state, window, tokens) in that order; (output [T, hidden], each row's (state, window) after): in_proj, the
    convolution (`packed_rows.convolve`) and out_proj over all T tokens in one call each."""
    states, windows, lengths = zip(*rows)
    B, C, x = module.in_proj(hidden).chunk(3, dim=-1)
    mixed, windows = packed_rows.convolve(module.conv, B * x, windows, lengths)
    return module.out_proj(C * mixed), list(zip(states, windows))


def block_section(module, hidden: torch.Tensor, tokens: int) -> torch.Tensor:
    """The conv tail of one row's input ``hidden`` [T, hidden] (zeros before its first token), flat in fp32."""
    B, _, x = module.in_proj(hidden).chunk(3, dim=-1)
    width = module.conv_kernel_size - 1
    tail = hidden.new_zeros(width, hidden.shape[-1], dtype=torch.float32)
    kept = (B * x)[max(0, len(x) - width):].float()
    tail[width - len(kept):] = kept
    return tail.reshape(-1)


def zero_state(module, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A row with no prefix: no state, and zeros before its first token's convolution."""
    return (torch.zeros(0, 0, 0, device=device),
            torch.zeros(module.conv_kernel_size - 1, module.conv.in_channels, device=device))
