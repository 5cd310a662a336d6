"""A hybrid model's linear layers in the engine's packed forward (issues 61, 72).

The engine feeds every row's tokens as one sequence: attention keeps rows apart through their page tables, but a
linear layer would carry its recurrence from one row into the next. So, once per model (`install`), each linear
layer's module gets a forward that inside an engine's forward (its ``milo_pack`` keyword) runs all rows at once, each
row's tokens from that row's own state and convolution window (`capture.linear_rule`'s ``layer_steps``: the
projections and the convolution over every packed token in one call each, the decoding rows' recurrence one step of
their stacked states, a prefill chunk's alone; `delta_rule` for a Gated DeltaNet layer, `ssd` for a Mamba2 one,
`short_conv` for LFM2's convolution), and outside one is the module's own. A row's state at a layer starts, in the
forward that rebuilds its admission (its own copy: the row may be fed only in a later forward, when the staged layer
it was read from holds another's), where that rebuild composes it (`PrefixRebuild.linear_states`: the anchor's state
carried through the pairs of its blocks before its first unreadable one, in placement order, and the last of them's
conv tail); a row with no prefix starts from zero. Its unreadable blocks' tokens, which it feeds first, run from
there, and where read blocks follow them a `prefix.Join` moves the state by their pairs and sets their last tail as
the window: the row's span is cut there, and its pieces after the cut run in a later ``layer_steps`` of the same
forward (`rows_forward`), so the blocks are composed in context order. What a forward leaves is kept only once the
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
    (``rule``: `capture.linear_rule`'s module), the joining rows' states first taken from their rebuilds. A row whose
    span a join cuts runs its pieces in waves, a ``layer_steps`` each, the join applied to its state between them."""
    for fill in pack.fills:
        if fill.linear:
            for row, start in zip(fill.linear, fill.rebuild.linear_states(layer)):
                if row is not None and start is not None:
                    row.start(layer, start)
    pieces = [_pieces(row, layer, start, stop) for row, start, stop in pack.linear]
    states = [row.layers.get(layer) or rule.zero_state(module, hidden.device) for row, _, _ in pack.linear]
    out, whole = torch.empty_like(hidden[0]), all(len(p) == 1 for p in pieces)
    for wave in range(max(len(p) for p in pieces)):  # one wave but where a join cuts a row's span
        rows = [r for r, p in enumerate(pieces) if wave < len(p)]
        for r in rows:
            for join in pieces[r][wave][2]:
                states[r] = join.apply(*states[r])
        spans = [pieces[r][wave][:2] for r in rows]
        fed = hidden[0] if whole else torch.cat([hidden[0, a:b] for a, b in spans])
        stepped, ends = rule.layer_steps(module, fed, [(*states[r], b - a) for r, (a, b) in zip(rows, spans)])
        at = 0
        for r, (a, b), end in zip(rows, spans, ends):
            out[a:b] = stepped[at:at + b - a]
            at, states[r] = at + b - a, end
    for (row, start, stop), end in zip(pack.linear, states):
        row.pending[layer] = end
        row.pending_fed = row.fed + stop - start
    return out[None]


def _pieces(row: RowState, layer: int, start: int, stop: int) -> list[tuple[int, int, list]]:
    """The row's span [start, stop) of the packed tokens cut before each of its joins falling in it: (first, stop, the
    joins applied before its first token) a piece, none empty."""
    pieces, first, joins = [], start, []
    for join in row.joins.get(layer, ()):
        cut = start + join.at - row.fed
        if start <= cut < stop:
            if cut > first:
                pieces.append((first, cut, joins))
                first, joins = cut, []
            joins = joins + [join]
    return pieces + [(first, stop, joins)]
