"""Blocks held once: every row of a batch that places a store block attends the one copy of it the batch holds.

Rows of a batch retrieve mostly the same blocks, each row in its own order. A block's K/V is rebuilt once per
layer into pages of the batch's pools, its keys rotated at the block's own positions 0..T-1 (a store version's
anchor, at 0..Ta-1 in every row, likewise), and every row that places it at offset p attends it with its query
turned back by p (⟨R(m)q, R(p+i)k⟩ = ⟨R(m−p)q, R(i)k⟩: `milo_infer.runtime.attention.Merge`). Only a block worth
it is held (`HeldBlocks.worth_holding`: rows enough that one copy takes fewer columns than theirs, and that the columns
they no longer read pay for its attention call and merge); a row's own pages
hold its other blocks, packed before its query, then its query and answer. A held block counts once against the KV
budget, lives while any row holds it, and after that stays until its pages are needed or the batch is idle, so a
row joining later reuses it: no read, no rebuild. At a window layer a block is rebuilt only once some row that holds it reaches it there (issue 46's reach,
per block): a later row that reaches more layers has them rebuilt then.

A row that recomputes tokens of its prefix (``--recompute``, or a block that could not be read) holds its own copy
of its whole prefix, as every row did before (`Engine(shared_blocks=False)`), and so does a family whose keys are not
a pure rotation of what the store keeps (`models.families.Attention.query_turns`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .cache import HeldColumns, pool_columns
from .pages import FULL, PAGE_TOKENS, WINDOW, PageGroups, pages_for, run_start


# What holding a block costs at every layer, in the columns a row's own attention reads in that time (a decode token
# ~0.1 us a column at the default model's 3 KV heads of 64 on this CPU): the block's own attention call and merge,
# ~55 us, and for each row placing it, its query turned and merged and its own columns attended with their
# log-sum-exp (~20 us more than one SDPA call). Measured with tools/bench_engine.py --profile and bench_shared_blocks.py
# (docs/benchmarks.md, issue 64): below it, holding small blocks made a batch slower.
HELD_CALL_COLUMNS, HELD_PLACEMENT_COLUMNS = 512, 256


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


@dataclass(frozen=True)
class Build:
    """A held block an admission writes: at ``layers`` (all it holds, when ``created`` by it; else the window layers
    a later row reached first)."""
    block: HeldBlock
    layers: frozenset
    created: bool


class HeldBlocks(Mapping):
    """A batch's held blocks by (StorePrefix, block; None: its anchor), in pages of its page groups (``pages``): which
    it holds, what they take of the budget, and which go when pages are needed. ``retired``: blocks of given-up
    admissions, out of reach of any row, whose pages go once no rebuild writes them any more."""

    def __init__(self, pages: PageGroups, window_layers: frozenset):
        self.pages, self.window_layers = pages, window_layers
        self.blocks: dict[tuple, HeldBlock] = {}
        self.retired: list[HeldBlock] = []

    def __getitem__(self, key: tuple) -> HeldBlock:
        return self.blocks[key]

    def __iter__(self):
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def page_bytes(self, block: HeldBlock) -> int:
        """Bytes a page of ``block`` takes in the groups it is held in (the window layers' only once it has pages
        there)."""
        return self.pages.bytes_of({FULL: 1, **({WINDOW: 1} if block.window_pages is not None else {})})

    def held_bytes(self) -> int:
        """The K/V bytes of the columns of the blocks rows hold, each once."""
        return sum(b.tokens * self.page_bytes(b) for b in self.blocks.values() if b.rows) // PAGE_TOKENS

    def kept_bytes(self) -> int:
        """The K/V bytes of the pages of the blocks no row holds, kept for later rows until their pages are needed."""
        return sum(pages_for(b.tokens) * self.page_bytes(b) for b in self.blocks.values() if not b.rows)

    def held_blocks(self) -> int:
        """Distinct blocks rows hold (anchors not counted)."""
        return sum(b.block is not None and b.rows > 0 for b in self.blocks.values())

    @staticmethod
    def worth_holding(rows: int, tokens: int) -> bool:
        """Whether a block of ``tokens`` that ``rows`` rows place is held once rather than in each row's own pages:
        where one copy in whole pages takes fewer columns than the rows' copies (never more K/V), and the columns the
        other rows no longer read pay for what holding it adds at every layer (`HELD_CALL_COLUMNS`,
        `HELD_PLACEMENT_COLUMNS`); so never for a block one row places, nor on this CPU for one of fewer than ~260
        tokens (issue 64)."""
        return (rows > 1 and rows * tokens > pages_for(tokens) * PAGE_TOKENS
                and (rows - 1) * tokens >= HELD_CALL_COLUMNS + rows * HELD_PLACEMENT_COLUMNS)

    def new_pages(self, wanted) -> dict:
        """Pages the blocks ``wanted`` add to each group: those not held yet, and window pages of those held without
        any that some window layer of the row now attends."""
        full = window = 0
        for key, _, tokens, layers in wanted:
            held = self.blocks.get(key)
            if held is None:
                full += pages_for(tokens)
            if (self.pages.windowed and (held is None or held.window_pages is None)
                    and layers & self.window_layers):
                window += pages_for(tokens)
        return {FULL: full, **({WINDOW: window} if self.pages.windowed else {})}

    def fits(self, own: int, wanted, now: bool = True) -> bool:
        """A row of ``own`` pages placing the blocks ``wanted`` fits now, once blocks no row holds (other than
        ``wanted``'s) are let go as needed; ``now`` False: whether it would fit an empty batch."""
        while True:
            if now:
                new = self.new_pages(wanted)
            else:
                new = {FULL: sum(pages_for(t) for _, _, t, _ in wanted),
                       WINDOW: sum(pages_for(t) for _, _, t, layers in wanted if layers & self.window_layers)}
            fits = self.pages.fits({group: own + new[group] for group in self.pages.groups}, now)
            if fits or not now or not self.let_go({key for key, _, _, _ in wanted}):
                return fits

    def hold(self, wanted, builds: dict, used: int) -> list[tuple[HeldBlock, int]]:
        """Take the blocks ``wanted`` for a row: a held one once more, a new one with its pages (and window pages
        where a window layer attends it); what is to be written at which layers joins ``builds``. ``used``: now, in
        the batch's seatings (the least recently placed goes first)."""
        held = []
        for key, offset, tokens, layers in wanted:
            block = self.blocks.get(key)
            created = block is None
            if created:
                block = self.blocks[key] = HeldBlock(*key, tokens, self.pages.take(FULL, pages_for(tokens)))
            added = layers - block.layers
            if added & self.window_layers and block.window_pages is None and self.pages.windowed:
                block.window_pages = self.pages.take(WINDOW, pages_for(tokens))
            if added:
                block.layers |= added
                before = builds.get(block)
                builds[block] = Build(block, added | (before.layers if before else frozenset()),
                                      created or (before is not None and before.created))
            block.rows += 1
            block.used = used
            held.append((block, offset))
        return held

    def let_go(self, keep: set) -> bool:
        """Give back the pages of the least recently placed held block no row holds (none of ``keep``'s): False when
        there is none."""
        idle = [b for key, b in self.blocks.items() if b.cached and key not in keep]
        if not idle:
            return False
        self.drop(min(idle, key=lambda b: b.used))
        return True

    def drop(self, block: HeldBlock) -> None:
        del self.blocks[block.key]
        self.give_pages(block)

    def drop_cached(self) -> None:
        """Let go of every block no row holds (the batch is idle)."""
        for block in [b for b in self.blocks.values() if b.cached]:
            self.drop(block)

    def retire(self, block: HeldBlock) -> None:
        """``block`` will never be written (its admission was given up): out of reach now, its pages once no rebuild
        writes them (`free_retired`)."""
        self.blocks.pop(block.key, None)
        self.retired.append(block)

    def free_retired(self) -> None:
        for block in [b for b in self.retired if not b.builders]:
            self.retired.remove(block)
            self.give_pages(block)

    def give_pages(self, block: HeldBlock) -> None:
        self.pages.give(FULL, block.pages)
        self.pages.give(WINDOW, block.window_pages)


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
