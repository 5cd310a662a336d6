"""The paged K/V cache: every row of a running batch holds pages of one pool per layer, and nothing ever moves.

Each layer's K and V pools are [H, pages × PAGE_TOKENS, d] (head-major, so one row's pages are a column
range of every head when they are consecutive). A row's page table maps its columns to the pool's: column
c (its RoPE position) lives at ``pages[c // PAGE_TOKENS] * PAGE_TOKENS + c % PAGE_TOKENS``. The pools are made
once, at each page group's pages of the KV budget (`milo_infer.runtime.pages`), and kept for the batch's life:
rows take pages and give them back, no pool is ever copied or resized. They are made uninitialised (on a CPU,
memory untouched is not resident: `torch.empty` of gigabytes costs nothing until written) and a page is zeroed
when first handed out (`zero_reached`): attention over a row's last page reads columns not written yet, masked,
and a masked 0 × NaN would still be NaN. A page given back keeps what its last row wrote, finite.

A forward feeds a `Pack`: every row's new tokens concatenated into one sequence; ``update`` first runs the
prefix fills of rows joining in this forward (`PrefixFill`: the rebuild writes a row's prefix straight into its
pages when they are consecutive, else into a scratch of one layer that is then scattered to them), then
scatters each new token's K/V to its pool column, and the attention (`milo_infer.runtime.attention`) reads
each row's columns only. A row that joins or leaves touches its own pages only.

Each layer's pools have its own shape (`milo_store.layers.LayerSpec`: Gemma 4's full layers have other heads and
widths than its sliding ones); a layer that attends another's K/V (a shared layer) has none and is never written:
its attention reads its source's pools, which its model hands it.

A model with sliding-window layers keeps them in pools of their own (``windowed``), each row with a page table
of its own there (`pages.window_table`): it holds pages only from the one its windows first reach (from the
row's first fed token: later tokens only move them forward), and its columns before that all map to one spill
page of the row's, which the rebuild may write and no token reads. The pack then carries the window layers'
segments and columns too (``Pack.window``), and each layer's ``update`` says which the attention reads.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from milo_store.layers import LATENT, cache_values_per_token

from .pages import PAGE_TOKENS, pages_for, run_start


@dataclass
class Segment:
    """One row's tokens in a pack: ``start:stop`` of the packed sequence, its pages (``run``: the first one when
    they are consecutive, else None), the columns [first, keys) it reads from them, its tokens' positions and the
    bool mask [tokens, keys] it needs (None: every column, i.e. one token at the end). A row that places blocks
    held once for every row (`milo_infer.runtime.shared_blocks`) reads its own pages from ``first`` (its own blocks,
    packed before its query, or its prefix's end) and those blocks through `HeldQueries`; its tokens are
    ``shared_at`` on there (None: a row holding its own copy of its whole prefix)."""
    pages: list[int]
    device_pages: torch.Tensor  # int64 [n]: the same, on the device
    run: int | None
    start: int
    stop: int
    keys: int
    positions: torch.Tensor  # int64 [tokens], on the host
    mask: torch.Tensor | None
    first: int = 0
    shared_at: int | None = None

    @functools.cached_property
    def gather(self) -> torch.Tensor:
        """The pool columns of the row's columns [0, keys), on the device: made once a forward, read by every layer's
        attention (a row on scattered pages gathers them)."""
        return (self.device_pages[:pages_for(self.keys), None] * PAGE_TOKENS
                + torch.arange(PAGE_TOKENS, device=self.device_pages.device)).flatten()[:self.keys]


@dataclass(frozen=True)
class HeldColumns:
    """One held block's columns in a pool (a run: ``run`` is its first page; else ``gather``, on the device), its
    tokens, and where the (token, block) pairs that attend it lie in `HeldQueries`' arrays."""
    run: int | None
    gather: torch.Tensor | None
    tokens: int
    start: int
    stop: int

    def of(self, pool: torch.Tensor) -> torch.Tensor:
        """Its columns of ``pool`` [H, columns, d]: a view when they are a run."""
        if self.run is not None:
            return pool[:, self.run * PAGE_TOKENS:self.run * PAGE_TOKENS + self.tokens]
        return pool.index_select(1, self.gather)

    def indices(self, device) -> torch.Tensor:
        """Its pool columns, int64 [tokens] on ``device``."""
        if self.run is not None:
            return torch.arange(self.run * PAGE_TOKENS, self.run * PAGE_TOKENS + self.tokens, device=device)
        return self.gather


@dataclass
class HeldQueries:
    """What the tokens of a forward's rows that place held blocks attend there: every (token, block) pair, grouped by
    block (``blocks``), with the token (an index into ``packed``, the tokens' places in the packed sequence), the block's
    first column in the token's row (``offset``) and the token's position. ``rope`` turns a query back by an offset
    (`RopeTables.turn`), ``layers`` say each layer's pairing (`LayerSpec.rope_layout`). Made once a forward per page
    group; each layer reads it."""
    packed: torch.Tensor  # int64 [S], device
    blocks: list[HeldColumns]
    token: torch.Tensor  # int64 [P], device: into packed
    offset: torch.Tensor  # int64 [P], device
    offset_host: torch.Tensor  # int64 [P]
    position_host: torch.Tensor  # int64 [P]
    rope: object
    layers: tuple
    reaches: dict = field(default_factory=dict)  # per window: the pairs its layers attend (`attention.Merge`)


@dataclass
class PrefixFill:
    """An admission's prefixes to rebuild: its `PrefixRebuild` and, in its rows' order, each row's pages, prefix
    length and the positions it keeps (None: every column 0..length-1 where it is; else those positions' K/V packed,
    in order, into the columns that end at ``length``: a row's own blocks beside blocks held once) (``window_rows``:
    its window layers' page tables, where they hold pages of their own). ``linear``: in the same order, the
    `linear_rows.RowState` each row's linear layers start from what the rebuild composes (None: a held block's; empty:
    a model without linear layers)."""
    rebuild: object  # PrefixRebuild: fill(layer, k_dsts, v_dsts), linear_states(layer)
    rows: list[tuple[list[int], int, np.ndarray | None]]
    window_rows: list[tuple[list[int], int, None]] | None = None
    linear: list = field(default_factory=list)


@dataclass
class Pack:
    """What one forward feeds: each row's segment, every token's pool column, the prefixes to rebuild before
    the first write of each layer, and the attention to run (``attention``: "flex" or "rows"). ``scratch`` holds
    what the attention derives once per forward and shares across layers (the flex block mask)."""
    segments: list[Segment]
    columns: torch.Tensor  # int64 [T]: pool columns
    attention: str = "rows"
    fills: list[PrefixFill] = field(default_factory=list)
    scratch: dict = field(default_factory=dict)
    window: "Pack | None" = None  # the window layers' segments and columns, on their page tables (None: no
    # layer holds pages of its own)
    held: HeldQueries | None = None  # what rows placing held blocks attend there (None: no such row)
    window_layers: frozenset = frozenset()  # the layers attending the window pools (a shared layer: its source's)
    latent: dict = field(default_factory=dict)  # each latent layer's pool [1, columns, rope + latent], as its update
    # leaves it: its attention reads the unit there (`attention.latent_attention`)
    linear: list = field(default_factory=list)  # a hybrid's rows, in the segments' order: (their
    # `linear_rows.RowState`, start, stop), which its linear layers run one by one (`linear_rows.rows_forward`)

    def attended(self, layer: int) -> "Pack":
        """What ``layer`` attends: its own page tables' segments."""
        return self.window if self.window is not None and layer in self.window_layers else self


def pool_columns(pages: list[int], positions: torch.Tensor) -> torch.Tensor:
    """Where a row's columns ``positions`` live in the pool."""
    table = torch.tensor(pages, dtype=torch.long)
    return table[positions // PAGE_TOKENS] * PAGE_TOKENS + positions % PAGE_TOKENS


class PagedLayer(CacheLayerMixin):
    """One layer's pools. A latent layer (MLA, `milo_infer.models.latent`) keeps one unit a token, [rope key |
    latent], in its K pool and no values (a V pool of no width)."""
    is_sliding = False

    def __init__(self, index: int, cache: "PagedCache", spec, dtype, device, columns: int, windowed: bool = False):
        super().__init__()
        self.windowed = windowed  # a window layer on page tables of its own
        # a proxy, not a reference: a cycle would keep the pools (gigabytes) alive after the batch ends, until the
        # garbage collector next ran
        self.index, self.cache = index, weakref.proxy(cache)
        self.holds = spec.holds_cache  # a shared layer holds no pools
        self.is_latent = spec.kind == LATENT
        H, d, columns = (spec.kv_heads, spec.head_dim, columns) if self.holds else (0, 0, 0)
        self.k_pool = torch.empty(H, columns, d, dtype=dtype, device=device)
        self.v_pool = torch.empty(H, columns, d if spec.caches_values else 0, dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def zero(self, start: int, stop: int) -> None:
        """Zero the columns [start, stop) of its pools (pages handed out for the first time)."""
        if self.holds:
            self.k_pool[:, start:stop].zero_()
            self.v_pool[:, start:stop].zero_()

    def fill(self, prefixes: PrefixFill) -> None:
        """Rebuild this layer of an admission's prefixes into their rows' pages."""
        ks, vs, scattered = [], [], []
        rows = prefixes.window_rows if self.windowed and prefixes.window_rows is not None else prefixes.rows
        for pages, length, kept in rows:
            if pages is None:  # a held block no layer of this group rebuilds: nothing to write
                ks.append(self.k_pool[:, :0])
                vs.append(self.v_pool[:, :0])
                continue
            start = run_start(pages[:pages_for(length)])
            if kept is not None:  # rebuilt at its positions, then packed before the row's query
                k, v = self._scratch(length)
                at = torch.from_numpy(kept).to(k.device)
                columns = pool_columns(pages, torch.arange(length - len(kept), length)).to(k.device)
                scattered.append((columns, k, v, at))
            elif start is not None:  # in place
                at = slice(start * PAGE_TOKENS, start * PAGE_TOKENS + length)
                k, v = self.k_pool[:, at], None if self.is_latent else self.v_pool[:, at]
            else:  # a window layer's rebuild leaves the columns of blocks its windows do not reach: zeros there, since
                # attention reads them masked (the spill page included) and a masked 0 × NaN would still be NaN
                k, v = self._scratch(length, zeroed=self.windowed)
                scattered.append((pool_columns(pages, torch.arange(length)).to(k.device), k, v, None))
            ks.append(k)
            vs.append(v)
        prefixes.rebuild.fill(self.index, ks, vs)
        for columns, k, v, kept in scattered:
            self.k_pool[:, columns] = k if kept is None else k.index_select(1, kept)
            if v is not None:
                self.v_pool[:, columns] = v if kept is None else v.index_select(1, kept)

    def _scratch(self, length: int, zeroed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V buffers of ``length`` columns shaped as this layer's pools (no V for a latent layer: keys only)."""
        make = torch.zeros if zeroed else torch.empty
        k = make(self.k_pool.shape[0], length, self.k_pool.shape[2], dtype=self.k_pool.dtype, device=self.k_pool.device)
        return k, None if self.is_latent else make(k.shape, dtype=k.dtype, device=k.device)

    def update(self, key_states, value_states, *args, **kwargs):
        """Rebuild the joining rows' prefixes of this layer, write the new tokens' K/V to their pool columns, and
        hand the whole pools to the attention (which reads each row's own columns)."""
        pack = self.cache.pack
        for prefixes in pack.fills:
            self.fill(prefixes)
        columns = pack.attended(self.index).columns
        self.cache.updated += 1
        if self.is_latent:  # handed (latent, rotated rope key): kept as one unit, which the attention reads from the
            # pack; the model expands one token's (its modeling file's view takes no empty tensor), not the pool's every
            # column for every head
            if key_states.shape[1] != 1 or key_states.shape[-1] + value_states.shape[-1] != self.k_pool.shape[-1]:
                raise RuntimeError(f"MLA layer {self.index}: its attention handed the cache per-head keys and values, "
                                   "not its latent and rope key: a transformers whose MLA caches the latent is needed")
            self.k_pool[:, columns] = torch.cat((value_states[0], key_states[0]), dim=-1)
            pack.latent[self.index] = self.k_pool
            return key_states[:, :, :1], value_states[:, :, :1]
        self.k_pool[:, columns] = key_states[0]
        self.v_pool[:, columns] = value_states[0]
        attended = self.cache.attended[self.windowed]
        return self.k_pool[None, :, :attended], self.v_pool[None, :, :attended]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.cache.attended[self.windowed], 0

    def get_seq_length(self) -> int:
        """Rows have lengths of their own: the engine always passes every token's position."""
        return 0

    def get_max_length(self) -> int:
        return self.k_pool.shape[1]


class PagedCache(Cache):
    """One PagedLayer per model layer, each of its layer's shape (``layers``: `milo_store.layers.LayerSpec`), its pools
    of ``capacities[windowed]`` pages (`pages.PageGroups`' groups, keyed by whether their layers slide); ``pack`` is
    the forward in flight, ``updated`` counts the layers it wrote (a model that ignored the cache writes none; a
    shared layer never writes). The ``windowed`` layers hold pools of their own. ``attended``: each group's columns
    the attention is handed, from the first (the whole pool; a flex batch's fewer, `Batch._ready_pools`)."""

    def __init__(self, layers, dtype, device, capacities: dict, windowed=frozenset()):
        columns = {group: capacities.get(group, 0) * PAGE_TOKENS for group in (False, True)}
        super().__init__(layers=[PagedLayer(l, self, spec, dtype, device, columns[l in windowed], l in windowed)
                                 for l, spec in enumerate(layers)])
        self.writers = sum(spec.holds_cache for spec in layers)  # the layers a forward writes
        self.pack: Pack | None = None
        self.updated = 0
        self.zeroed = {False: 0, True: 0}  # pages of each group zeroed so far, from the first
        self.attended = dict(columns)

    def zero_reached(self, reached: dict) -> None:
        """Zero each group's pages from those zeroed so far up to ``reached`` (`PageGroups.reached`)."""
        for group, pages in reached.items():
            if pages > self.zeroed[group]:
                for layer in self.layers:
                    if layer.windowed == group:
                        layer.zero(self.zeroed[group] * PAGE_TOKENS, pages * PAGE_TOKENS)
                self.zeroed[group] = pages

    @property
    def allocated_bytes(self) -> int:
        """What the pools take: numel × element size of every K and V pool."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k_pool, layer.v_pool))

    def row_kv(self, layer: int, pages: list[int], columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one row's columns [0, ``columns``) of ``layer``: K and V [H, columns, d]."""
        where = pool_columns(pages, torch.arange(columns)).to(self.layers[layer].k_pool.device)
        return self.layers[layer].k_pool[:, where], self.layers[layer].v_pool[:, where]


def column_bytes(layers, dtype: torch.dtype) -> int:
    """Bytes one column of one row takes: K and V of every layer holding its own (``layers``: `LayerSpec`s)."""
    return cache_values_per_token(layers) * torch.empty(0, dtype=dtype).element_size()
