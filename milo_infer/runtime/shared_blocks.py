"""Blocks held once: every row of a batch that places a store block attends the one copy of it the batch holds.

Rows of a batch retrieve mostly the same blocks, each row in its own order. A block's K/V is rebuilt once per
layer into pages of the batch's pools, its keys rotated at the block's own positions 0..T-1 (a store version's
anchor, at 0..Ta-1 in every row, likewise), and every row that places it at offset p attends it with its query
turned back by p (⟨R(m)q, R(p+i)k⟩ = ⟨R(m−p)q, R(i)k⟩: `milo_infer.runtime.attention.Merge`). A row's own pages
hold only its query and answer. A held block counts once against the KV budget, lives while any row holds it, and
after that stays until its pages are needed or the batch is idle, so a row joining later reuses it: no read, no
rebuild. At a window layer a block is rebuilt only once some row that holds it reaches it there (issue 46's reach,
per block): a later row that reaches more layers has them rebuilt then.

A row that recomputes tokens of its prefix (``--recompute``, or a block that could not be read) holds its own copy
of its whole prefix, as every row did before (`Engine(shared_blocks=False)`), and so does a family whose keys are not
a pure rotation of what the store keeps (`models.families.Attention.query_turns`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import HeldColumns, pool_columns
from .pages import PAGE_TOKENS, run_start


@dataclass(eq=False)
class HeldBlock:
    """One block of a mounted store version (``block`` None: its anchor) held at positions 0..T-1 in the pools:
    ``pages`` in the full layers' pools, ``window_pages`` in the window layers' (None: none yet). ``layers``: the
    layers some rebuild writes it at; ``builders``: the admissions whose rebuilds still have to write it (a row
    attends it once they have filled); ``rows``: the rows holding it (0: kept until its pages are needed);
    ``used``: when it was last placed (the least recently used goes first)."""
    prefix: object  # StorePrefix
    block: int | None
    tokens: int
    pages: list[int]
    window_pages: list[int] | None = None
    layers: frozenset = frozenset()
    builders: list = field(default_factory=list)
    rows: int = 0
    used: int = 0
    gathers: dict = field(default_factory=dict, repr=False)  # per page group, its columns on the device

    @property
    def key(self) -> tuple:
        return self.prefix, self.block

    @property
    def cached(self) -> bool:
        """No row holds it and nothing is left to write: its pages may go."""
        return not self.rows and not self.builders

    def columns(self, window: bool, start: int, stop: int, device) -> HeldColumns:
        """Its columns in one page group's pools, for the pairs ``start:stop`` of a forward's `HeldQueries`."""
        pages = self.window_pages if window else self.pages
        run = run_start(pages)
        if run is None and window not in self.gathers:
            self.gathers[window] = pool_columns(pages, torch.arange(self.tokens)).to(device)
        return HeldColumns(run, self.gathers.get(window) if run is None else None, self.tokens, start, stop)

    def placement(self, layers: frozenset, num_layers: int):
        """What a `PrefixRebuild` rebuilds it from: the anchor, or the block alone at 0..T-1 at ``layers``."""
        if self.block is None:
            return self.prefix.anchor_alone()
        reach = None if len(layers) == num_layers else tuple((0,) if l in layers else () for l in range(num_layers))
        return self.prefix.alone(self.block, reach)


def layers_reached(windows: list[int | None] | None, num_layers: int, offset: int, tokens: int,
                   first_position: int) -> frozenset:
    """The layers at which a row whose first fed token sits at ``first_position`` attends a block placed at
    ``offset``: every full layer, and each window layer of W whose window reaches the block's last token from there
    (a later token's window only moves forward). Every layer where windows are not read apart (None)."""
    if windows is None:
        return frozenset(range(num_layers))
    return frozenset(l for l, w in enumerate(windows) if w is None or offset + tokens - 1 > first_position - w)


def own_table(taken: list[int], skip: int) -> list[int]:
    """A row's page table when its first ``skip`` pages are held blocks' columns, not its own: those map to its first
    own page (never read or written there: its own columns start past them)."""
    return [taken[0]] * skip + list(taken)



def own_run(pages: list[int], own_from: int) -> int | None:
    """Where a row's columns from ``own_from`` on lie as one run of the pool, the way `pages.run_start` says it for a
    whole row (column c at run·PAGE_TOKENS + c; the pages before ``own_from``'s stand for held blocks' columns and are
    never read), or None when its own pages are not consecutive."""
    skip = own_from // PAGE_TOKENS
    run = run_start(pages[skip:])
    return None if run is None else run - skip
