"""A hybrid model's linear layers in the engine's packed forward (issues 61, 72).

The engine feeds every row's tokens as one sequence: attention keeps rows apart through their page tables, but a
linear layer would carry its recurrence from one row into the next. So, once per model (`install`), each linear
layer's module gets a forward that inside an engine's forward (its ``milo_pack`` keyword) runs all rows at once, each
row's tokens from that row's own state and convolution window (`capture.linear_rule`'s ``layer_steps``: the
projections and the convolution over every packed token in one call each, the decoding rows' recurrence one step of
their stacked states, a prefill chunk's alone; `delta_rule` for a Gated DeltaNet layer, `ssd` for a Mamba2 one,
`short_conv` for LFM2's convolution), and outside one is the module's own. A row's state at a layer starts, in the
forward that feeds its first tokens, where its admission's rebuild composes it (`PrefixRebuild.linear_states`: the
anchor's state carried through its blocks' pairs in placement order, the last block's conv tail); a row with no prefix
starts from zero. What a forward leaves is kept only once the forward has succeeded (`RowState.commit`): a step
retried after the device ran out of memory runs again from the states it began with.
"""
from __future__ import annotations

import torch

from ..models.capture import attention_modules, linear_rule
from ..models.families import layer_specs


class RowState:
    """One row's linear layers: per layer, its state (fp32; [H, dk, dv] for GDN, [H, P, N] for Mamba2, empty for a short
    convolution) and its convolution's last kernel − 1 inputs."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def commit(self) -> None:
        """Keep what the forward that just succeeded left."""
        self.layers.update(self.pending)
        self.pending = {}


def install(model) -> None:
    """Give each linear layer's module the rows' forward (once per model; the module's own forward otherwise)."""
    for layer, (module, spec) in enumerate(zip(attention_modules(model), layer_specs(model.config))):
        if spec.state_values and not getattr(module, "_milo_rows", False):
            module.forward = _row_forward(module, layer, linear_rule(spec), module.forward)
            module._milo_rows = True


def _row_forward(module, layer: int, rule, own):
    def forward(hidden_states, *args, milo_pack=None, **kwargs):
        if milo_pack is None:
            return own(hidden_states, *args, **kwargs)
        return rows_forward(module, layer, rule, hidden_states, milo_pack)
    return forward


def rows_forward(module, layer: int, rule, hidden: torch.Tensor, pack) -> torch.Tensor:
    """``layer``'s output for the packed ``hidden`` [1, T, hidden]: each row's tokens (``pack.linear``: its
    `RowState` and its tokens' span, the spans end to end) from its own state, every row in one ``rule.layer_steps``
    (``rule``: `capture.linear_rule`'s module), the joining rows' states first taken from their rebuilds."""
    for fill in pack.fills:
        if fill.linear:
            for row, start in zip(fill.linear, fill.rebuild.linear_states(layer)):
                if row is not None and start is not None:
                    row.layers[layer] = start
    starts = [row.layers.get(layer) or rule.zero_state(module, hidden.device) for row, _, _ in pack.linear]
    out, ends = rule.layer_steps(module, hidden[0], [(state, window, stop - start) for (state, window), (_, start, stop)
                                                     in zip(starts, pack.linear)])
    for (row, _, _), end in zip(pack.linear, ends):
        row.pending[layer] = end
    return out[None]
