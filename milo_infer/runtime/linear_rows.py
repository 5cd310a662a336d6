"""A hybrid model's linear layers in the engine's packed forward (issue 61).

The engine feeds every row's tokens as one sequence: attention keeps rows apart through their page tables, but a
linear layer would carry its recurrence from one row into the next. So, once per model (`install`), each linear
layer's module gets a forward that inside an engine's forward (its ``milo_pack`` keyword) runs each row's tokens
alone from that row's own state and convolution window (`capture.linear_rule`: `delta_rule.layer_step` for a Gated
DeltaNet layer, `ssd.layer_step` for a Mamba2 one, `short_conv.layer_step` for LFM2's convolution), and outside one is
the module's own. A row's state at a layer starts, in the forward that rebuilds its admission (its own copy: the row may be fed only
in a later forward, when the staged layer it was read from holds another's), where that rebuild composes it (`PrefixRebuild.linear_states`: the anchor's state carried through the pairs of its blocks before its first
unreadable one, in placement order, and the last of them's conv tail); a row with no prefix starts from zero. Its
unreadable blocks' tokens, which it feeds first, run from there, and where read blocks follow them a `prefix.Join`
moves the state by their pairs and sets their last tail as the window (`row_step` splits the row's span there): the
blocks are composed in context order. What a forward leaves is kept only once the
forward has succeeded (`RowState.commit`): a step retried after the device ran out of memory runs again from the
states it began with.
"""
from __future__ import annotations

import torch

from ..models.capture import attention_modules, linear_rule
from ..models.families import layer_specs


class RowState:
    """One row's linear layers: per layer, its state (fp32; [H, dk, dv] for GDN, [H, P, N] for Mamba2, empty for a short
    convolution) and its convolution's last kernel − 1 inputs, entering its next fed token (``layers``); per layer, the
    points in its fed tokens where a run of blocks read after unreadable ones takes over (``joins``: `prefix.Join`s,
    each applied before its fed token ``at``); and how many of its tokens the forwards that succeeded fed (``fed``)."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.joins: dict[int, tuple] = {}
        self.fed = 0
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending_fed = 0

    def start(self, layer: int, start) -> None:
        """Start ``layer`` where the row's rebuild leaves it (`prefix.LinearStart`)."""
        self.layers[layer] = start.state, start.window
        self.joins[layer] = start.joins

    def commit(self) -> None:
        """Keep what the forward that just succeeded left."""
        if self.pending:
            self.fed = self.pending_fed
        self.layers.update(self.pending)
        self.pending = {}


def install(model) -> None:
    """Give each linear layer's module the per-row forward (once per model; the module's own forward otherwise)."""
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
    `RowState` and its tokens' span) from its own state (``rule``: `capture.linear_rule`'s module), the joining rows'
    first taken from their rebuilds."""
    for fill in pack.fills:
        if fill.linear:
            for row, start in zip(fill.linear, fill.rebuild.linear_states(layer)):
                if row is not None and start is not None:
                    row.start(layer, start)
    return torch.cat([row_step(module, layer, rule, row, hidden[0, start:stop])
                      for row, start, stop in pack.linear])[None]


def row_step(module, layer: int, rule, row: RowState, hidden: torch.Tensor) -> torch.Tensor:
    """``layer``'s output for one row's next fed tokens ``hidden`` [n, hidden] from its state, its span split where
    one of its joins falls (before its fed token ``join.at``): there the join moves the state and replaces the conv
    window. What the tokens leave is the row's pending state (`RowState.commit`)."""
    state, window = row.layers.get(layer) or rule.zero_state(module, hidden.device)
    outputs, done = [], 0
    for join in row.joins.get(layer, ()):
        cut = join.at - row.fed
        if 0 <= cut < len(hidden):
            if cut > done:
                out, state, window = rule.layer_step(module, hidden[done:cut], state, window)
                outputs.append(out)
                done = cut
            state, window = join.apply(state, window)
    out, state, window = rule.layer_step(module, hidden[done:], state, window)
    outputs.append(out)
    row.pending[layer] = state, window
    row.pending_fed = row.fed + len(hidden)
    return torch.cat(outputs)
