"""Rebuilding [anchor][blocks] prefixes from stores: what the engine's batches and the vLLM connector share.

A `StorePrefix` is a store's anchor K/V, rotated once onto the device (the anchor always sits at
positions 0..Ta-1), and the placement of any blocks after it (`BlockPlacement`: each block's first
row and every layer's segment table, and the `StorePrefix` it was made by, so that a placement made
against one version of a store is rebuilt from that version even after a newer one is mounted). A
`PrefixRebuild` takes one placement per row (a `QueryPlan` holds one; the vLLM connector makes its
own), fetches each mounted store's union of their blocks once (a block several rows use crosses the
link once), streams those factors a layer ahead, and rebuilds any layer of every row's prefix, keys
rotated at that row's positions, into buffers the caller owns. It knows nothing of models or of how the rows' tokens are attended to.
A `KVShare` limits it to the layers and KV heads one worker's cache holds (a pipeline stage, a
tensor-parallel rank): only those layers are staged and only those heads rebuilt. Blocks are still read
whole, since each block's CRC32C covers the whole block (docs/design.md, "vLLM").

On a CPU each layer of a block several of its rows use is decoded once (its factors' products, keys pre-RoPE)
and rotated at each distinct position the rows place it at (issue 47: in a served batch of the 512-shot
Banking77 store, rows admitted together mostly share blocks, seldom at the same position); the values are the
kernels' CPU path's to the bit. The Triton path rebuilds each row in one launch per layer; a store whose codec
describes its stored bytes to a kernel (the bits codec) is staged as those bytes and rebuilt from its codes there
(`staged_codes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from milo_kernels import apply_rope, decode_layer, kernel_backend, plan_layers, reconstruct_layer
from milo_kernels.cpu import rope
from milo_store import IncompatibleStoreError, MiloStore, StoreError, full_kv_bytes

from ..models import RopeTables

from .device_tier import DeviceTier
from .prefetch import LayerPrefetcher, TransferPool
from .staged_codes import StagedCodes, rebuilds_from_codes
from .timing import StageClock


UNREADABLE = (StoreError, OSError)  # a block failing its checksum; a read that failed after its retries
FETCH_STATS = ("rows", "blocks", "unique_blocks", "device_hits", "memory_hits", "block_cache_hits", "object_store_reads",
               "remote_bytes", "remote_gets", "buffer_bytes", "staged_bytes", "bytes")  # `PrefixRebuild.fetch_stats`


def rebuild_layer(factors, segments, out_k, out_v, cos, sin, *, interleaved, quant, plan=None,
                  rotary_dim=None) -> None:
    """The default rebuild: the kernels' reconstruction (Triton on CUDA, the CPU path otherwise)."""
    reconstruct_layer(factors, segments, out_k, out_v, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim,
                      quant=quant, plan=plan)


def carried(section: dict, state: torch.Tensor) -> torch.Tensor:
    """A state carried across a block by its section's pair, M S + C in fp32: a Gated DeltaNet layer's M a matrix a
    head, a Mamba2 layer's a scalar a head."""
    m, c = section["M"].float(), section["C"].float()
    return (m @ state if m.dim() == 3 else m[:, None, None] * state) + c


def composed(pair: tuple[torch.Tensor, torch.Tensor] | None, section: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair (M, C) of a run of blocks followed by one more (its section): S -> M_b (M S + C) + C_b, fp32; ``pair``
    None (the run's first block): the block's own pair, copied, since a section is a view of the staged layer."""
    m = section["M"].float()
    if pair is None:
        return m.clone(), section["C"].float().clone()
    M, C = pair
    return (m @ M if m.dim() == 3 else m * M), carried(section, C)


@dataclass(frozen=True)
class Join:
    """Where a row's fed tokens meet the blocks read after an unreadable one (`PrefixRebuild.linear_states`): before
    its fed token ``at`` its state moves by those blocks' pairs composed (``pair``: M, C) and its conv window becomes
    the last of them's tail. The row's own copies: nothing here is a view of a staged layer."""
    at: int
    pair: tuple[torch.Tensor, torch.Tensor]
    window: torch.Tensor

    def apply(self, state: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state and conv window after the join, from those the row's tokens before it left (``window`` is
        replaced: the blocks' tails are what the next token's convolution reads)."""
        m, c = self.pair
        return carried({"M": m, "C": c}, state), self.window


@dataclass(frozen=True)
class LinearStart:
    """A row's linear layer as its rebuild leaves it: the state (fp32) and conv window entering its first fed token,
    and the `Join` at the end of each run of unreadable blocks that a read block follows, in order. The row's own
    copies: nothing here is a view of a staged layer, which a later layer's fetch may overwrite (CUDA's buffers)."""
    state: torch.Tensor
    window: torch.Tensor
    joins: tuple[Join, ...] = ()


@dataclass(frozen=True)
class BlockPlacement:
    """Where one row's blocks go: the one type the engine's plans and the vLLM connector's loads share."""
    store: str  # the mounted store's name
    blocks: list[int]  # store blocks, in context order
    dst_rows: np.ndarray  # int64 [n]: each block's first row in the assembled context
    segments: tuple[np.ndarray, ...]  # per layer, int64 [n*S_l, 6]: SEGMENT_COLUMNS, src_offset relative to the
    # block's layer slice (S_l: the units layer l stores, `Layout.segments_per_block`)
    prefix_tokens: int  # anchor + blocks
    kv_bytes_full: int  # fp16 K/V of the blocks
    kv_bytes_stored: int  # the factor bytes the blocks take in the store
    prefix: "StorePrefix | None" = field(default=None, compare=False, repr=False)  # the mounted version that
    # placed them, which rebuilds them (None: a placement with no store behind it, as a test's fake engine makes)
    reach: tuple[tuple[int, ...], ...] | None = None  # per layer, the blocks (indices into ``blocks``) the row's
    # windows reach: only those are read and rebuilt at that layer (None: every block at every layer)
    anchor: bool = True  # the rebuild writes the anchor first (False: a block alone at positions 0..T-1, as the
    # engine holds a block that rows share: `milo_infer.runtime.shared_blocks`)

    def reached_by_windows(self, first_position: int, windows: list[int | None]) -> list[list[int]]:
        """Per layer, which of ``blocks`` (indices into it) the row's tokens can attend, the first of them fed at
        ``first_position``: every block at a full layer (None); at a window layer of W, those with a token after
        ``first_position`` − W (a later token's window only moves forward)."""
        ends = self.block_ends()
        return [list(range(len(self.blocks))) if w is None else
                [i for i, end in enumerate(ends) if int(end) - 1 > first_position - w] for w in windows]

    def block_tokens(self) -> np.ndarray:
        """Each placed block's tokens (int64)."""
        tokens = self.prefix.store.block_tokens[self.blocks] if self.prefix is not None else np.diff(
            np.append(self.dst_rows, self.prefix_tokens))
        return np.asarray(tokens, dtype=np.int64)

    def block_ends(self) -> np.ndarray:
        """Each placed block's end in the context, exclusive (an unread block between two keeps its columns)."""
        return self.dst_rows + self.block_tokens()

    def block_positions(self) -> np.ndarray:
        """The context positions of its blocks' tokens, in order (int64)."""
        return np.concatenate([np.arange(dst, end) for dst, end in zip(self.dst_rows, self.block_ends())]
                              or [np.zeros(0, np.int64)])

    def windowed(self, first_position: int, windows: list[int | None] | None) -> "BlockPlacement":
        """This placement reading and rebuilding, at each window layer, only the blocks its window reaches from
        ``first_position`` (the row's first fed token); itself where no layer has a window."""
        if not windows or all(w is None for w in windows):
            return self
        return replace(self, reach=tuple(map(tuple, self.reached_by_windows(first_position, windows))))

    def layer_blocks(self, layer: int) -> list[int]:
        """The blocks (indices into ``blocks``) read and rebuilt at ``layer``."""
        return list(range(len(self.blocks))) if self.reach is None else list(self.reach[layer])

    def only(self, keep: list[int]) -> "BlockPlacement":
        """The blocks ``keep`` (indices into ``blocks``) where they are, without the anchor and the others: what a row
        holding the rest once for every row rebuilds into its own pages (`engine.Batch`). Its rebuild still writes
        the context's positions (``prefix_tokens`` unchanged); the bytes are the kept blocks'."""
        if self.reach is not None:
            raise ValueError("a placement read by windows' reach keeps every block's columns where they are")
        segments = tuple(table.reshape(len(self.blocks), -1, table.shape[1])[keep].reshape(-1, table.shape[1])
                         if len(self.blocks) else table for table in self.segments)
        blocks = [self.blocks[i] for i in keep]
        tokens = self.block_tokens()
        share = tokens[keep].sum() / max(1, tokens.sum())
        return replace(self, blocks=blocks, dst_rows=self.dst_rows[keep], segments=segments, anchor=False,
                       kv_bytes_full=int(self.kv_bytes_full * share),
                       kv_bytes_stored=int(self.prefix.store.block_bytes(blocks).sum()) if self.prefix is not None
                       else int(self.kv_bytes_stored * share))


def tensor_parallel_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads (the store's numbering) that tensor-parallel rank ``tp_rank`` of ``tp_size`` holds, as vLLM
    shards them (its QKVParallelLinear): H / tp consecutive heads each where tp divides H; where H < tp,
    each head is replicated on tp / H consecutive ranks."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks")
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} tensor-parallel ranks do not replicate {num_kv_heads} KV heads evenly")
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class KVShare:
    """The layers and KV heads of a store's layout that one cache holds, in the store's numbering: what a
    `PrefixRebuild` stages and rebuilds. A layer's heads (`layer_heads`) are ``heads``, one run for every layer;
    or, with ``tp`` (size, rank), that tensor-parallel rank's heads of each layer's own (layers may differ in
    heads); or, with neither, each layer's own. Its buffers for a layer hold those heads, the first one first."""
    layers: range
    heads: range | None = None
    tp: tuple[int, int] | None = None

    @classmethod
    def whole(cls, layout) -> "KVShare":
        return cls(range(layout.num_layers))

    def layer_heads(self, spec) -> range:
        if self.tp is not None:
            return tensor_parallel_heads(spec.kv_heads, *self.tp)
        return self.heads if self.heads is not None else range(spec.kv_heads)

    def check(self, layout) -> None:
        heads_fit = self.heads is None or (self.heads and self.heads.step == 1 and 0 <= self.heads.start and all(
            self.heads.stop <= spec.kv_heads for spec in layout.layers if spec.holds_cache))
        if not (self.layers and self.layers.step == 1 and 0 <= self.layers.start
                and self.layers.stop <= layout.num_layers and heads_fit):
            raise ValueError(f"{self} is not a run of the layout's {layout.num_layers} layers and of its layers' "
                             f"KV heads")


def prefix_token_ids(store: MiloStore, blocks: list[int]) -> list[int] | None:
    """The token ids the store encoded its anchor and ``blocks`` from, in that order (None: it keeps none)."""
    anchor = store.meta.get("build", {}).get("anchor_token_ids")
    texts = [store.token_ids(b) for b in blocks]
    if anchor is None or any(ids is None for ids in texts):
        return None
    return [int(t) for t in anchor] + [int(t) for block in texts for t in block]


class StorePrefix:
    """A store's anchor K/V on the device, and where any blocks go after it. ``layers``: the store's description of
    each layer (`milo_store.layers.LayerSpec`: what it holds, its heads, width and RoPE layout)."""

    def __init__(self, name: str, store: MiloStore, rope: RopeTables, device, dtype):
        self.name, self.store, self.layout = name, store, store.layout
        self.layers = store.layout.layers
        anchor = store.anchor_kv()  # [L, 2, H, Ta, d] on the layout's grid, keys pre-RoPE
        if anchor is None:
            raise IncompatibleStoreError(f"{store.path} has no anchor K/V: not a store `milo build` wrote")
        Ta = anchor.shape[3]
        self.anchor_k, self.anchor_v = [], []  # per layer [H, Ta, d], keys rotated (None: a layer holding none)
        for l, spec in enumerate(self.layers):
            if not spec.holds_cache:
                self.anchor_k.append(None)
                self.anchor_v.append(None)
                continue
            k, v = (anchor[l, kind, :spec.kv_heads, :, :spec.head_dim] for kind in (0, 1))
            cos, sin = rope.layer(l)
            self.anchor_k.append(apply_rope(k.float(), cos[:Ta].cpu(), sin[:Ta].cpu(), **self.rope_layout(l))
                                 .to(device, dtype))
            self.anchor_v.append(v.to(device, dtype) if spec.caches_values else None)
        self.anchor_len = Ta
        # a K = V layer's keys are its values times this gain ([d], fp32, on the device)
        self.key_gain = {l: store.key_gain(l).to(device) for l, spec in enumerate(self.layers)
                         if spec.keys_from_values}
        # a linear layer's state after the anchor ([H, dk, dv], fp32: the anchor's C, from zero) and its conv tail
        self.anchor_state = {l: (section["C"].to(device), section["conv"].to(device, dtype)) for l, section in (
            (l, self.layout.state_section(l, values)) for l, values in (store.anchor_states() or {}).items())}

    def rope_layout(self, layer: int) -> dict:
        """The kernels' RoPE layout arguments for this store's keys at ``layer``: ``apply_rope(x, cos, sin,
        **rope_layout(l))``, ``reconstruct_layer(..., **rope_layout(l))``."""
        return self.layers[layer].rope_layout()

    def place(self, blocks: list[int], with_segments: bool = True,
              unread: frozenset[int] = frozenset()) -> BlockPlacement:
        """``blocks`` in this order after the anchor; ``with_segments=False`` skips the segment tables. Blocks
        in ``unread`` keep their columns in the context but are not placed (nothing reads or rebuilds them:
        the model computes their tokens)."""
        tokens = self.store.block_tokens[blocks]
        dst = self.anchor_len + np.concatenate(([0], np.cumsum(tokens)[:-1])).astype(np.int64)
        keep = [i for i, b in enumerate(blocks) if b not in unread]
        placed = [blocks[i] for i in keep]
        if with_segments and placed:
            zeros = np.zeros(len(placed), np.int64)
            segments = tuple(self.layout.layer_segments(l, self.store.ranks[placed, l], tokens[keep], dst[keep], zeros)
                             for l in range(self.layout.num_layers))
        else:
            segments = self._no_segments()
        stored = int(self.store.block_bytes(placed).sum())
        return BlockPlacement(store=self.name, blocks=placed, dst_rows=dst[keep], segments=segments,
                              prefix_tokens=self.anchor_len + int(tokens.sum()),
                              kv_bytes_full=full_kv_bytes(self.layout, tokens[keep]), kv_bytes_stored=stored,
                              prefix=self)

    def _no_segments(self) -> tuple[np.ndarray, ...]:
        return tuple(np.zeros((0, 6), np.int64) for _ in range(self.layout.num_layers))

    def unreadable(self, blocks: list[int]) -> dict[int, Exception]:
        """Which of ``blocks`` cannot be read, each read alone, with what reading it raised."""
        found = {}
        for b in dict.fromkeys(blocks):
            try:
                self.store.blocks([b])
            except UNREADABLE as err:
                found[b] = err
        return found

    def alone(self, block: int, reach: tuple[tuple[int, ...], ...] | None = None) -> BlockPlacement:
        """``block`` by itself at positions 0..T-1, without the anchor: the one copy rows that place it share (each
        row's query is turned to it, `milo_infer.runtime.attention`); ``reach``: the layers it is rebuilt at."""
        placed = self.place([block])
        tokens = int(self.store.block_tokens[block])
        segments = tuple(table.copy() for table in placed.segments)
        for table in segments:
            table[:, 3] -= self.anchor_len
        return replace(placed, dst_rows=placed.dst_rows - self.anchor_len, segments=segments, prefix_tokens=tokens,
                       anchor=False, reach=reach)

    def anchor_alone(self) -> BlockPlacement:
        """The anchor by itself (at positions 0..Ta-1 in every row): the copy every row of this version shares."""
        return replace(self.nothing_placed(), prefix_tokens=self.anchor_len)

    def nothing_placed(self) -> BlockPlacement:
        """No prefix at all, not even the anchor: a row whose model computes every token (prefill)."""
        return BlockPlacement(store=self.name, blocks=[], dst_rows=np.zeros(0, np.int64),
                              segments=self._no_segments(), prefix_tokens=0, kv_bytes_full=0, kv_bytes_stored=0,
                              prefix=self)


class PrefixRebuild:
    """Every row's [anchor][blocks] (one `BlockPlacement` per row), one layer at a time: ``fill(layer, k, v)``
    writes row r's prefix into ``k[r][:, :P_r]`` and ``v[r][:, :P_r]``: rows of [rows, H, T, d] buffers (the vLLM
    connector's), or one [H, ≥P_r, d] destination per row (the engine's pages). The blocks are read when it is made
    (a block that fails its checksum raises `StoreCorruptedError` here, before anything is written).
    ``share`` (default: every layer and head) is the part a worker's cache holds: ``fill`` takes only its
    layers and writes only its heads at each (H = ``len(heads(layer))``); only its layers are staged. ``rope`` holds each
    layer's tables (a NoPE layer's rotate by nothing). A row whose placement has a ``reach`` (window layers) is
    staged and rebuilt at each layer only for the blocks reached there; its other blocks' columns of that layer are
    left as they were (its attention reads them masked).
    ``fetch_stats`` says what the fetch read, moved and staged; ``clock`` (optional) times its stages."""

    def __init__(self, rows: list[BlockPlacement], rope: RopeTables, device,
                 *, depth: int = 2, tier: DeviceTier | None = None, pools: dict[str, TransferPool] | None = None,
                 rebuild=rebuild_layer, clock: StageClock | None = None, share: KVShare | None = None):
        if not rows:
            raise ValueError("a rebuild needs at least one row")
        self.rows, self.rope, self.rebuild = rows, rope, rebuild
        layout = rows[0].prefix.layout  # stores mounted together are of one model
        self.share = share or KVShare.whole(layout)
        self.share.check(layout)
        self.clock = clock or StageClock(device)
        pools = pools or {}
        unions: dict[StorePrefix, list[int]] = {}  # each mounted version's blocks, once each
        for row in rows:
            unions.setdefault(row.prefix, []).extend(row.blocks)
        unions = {prefix: list(dict.fromkeys(blocks)) for prefix, blocks in unions.items()}
        reaches = {prefix: self.union_reach(prefix, unions[prefix]) for prefix in unions}
        pooled: set[str] = set()  # a store's transfer pool serves one of its versions per fetch; another stages its own
        self.fetched: dict[StorePrefix, LayerPrefetcher] = {}
        # a codec whose stored bytes the Triton kernel rebuilds (the bits codec) is staged as those bytes, whole
        # blocks, and rebuilt from its codes (`staged_codes`), unless a caller's own rebuild or a window's reach
        self.codes: dict[StorePrefix, StagedCodes] = {}
        from_codes = rebuild is rebuild_layer and kernel_backend(torch.device(device)) == "triton"
        with self.clock.host("read"):
            for prefix, ids in unions.items():
                if ids and from_codes and reaches[prefix] is None and rebuilds_from_codes(prefix.store):
                    self.codes[prefix] = StagedCodes(prefix.store, ids, device, tier)
                elif ids:  # prefill rows read nothing
                    pool = pools.get(prefix.name) if prefix.name not in pooled else None
                    pooled.add(prefix.name)
                    self.fetched[prefix] = LayerPrefetcher(prefix.store, ids, device, depth=depth, tier=tier, pool=pool,
                                                           layers=self.share.layers, reach=reaches[prefix])
        for pf in self.fetched.values():
            self.clock.defer("transfer", pf.transfer_seconds)
        staged = [*self.fetched.values(), *self.codes.values()]
        for pf in staged:
            if pf.store.remote:  # this fetch's own block cache misses of a store URL
                self.clock.defer("remote", lambda pf=pf: pf.read_stats.remote_seconds)
        self.fetch_stats = {
            "rows": len(rows), "blocks": sum(len(row.blocks) for row in rows),
            "unique_blocks": sum(len(u) for u in unions.values()),
            "device_hits": sum(pf.tier_hits for pf in staged),
            "memory_hits": sum(pf.read_stats.memory_hits  # the host tier's blocks are views, not counted there
                               + (len(pf.block_ids) - pf.tier_hits) * (pf.store.tier == "host")
                               for pf in staged),
            "block_cache_hits": sum(pf.read_stats.block_cache_hits for pf in staged),
            "object_store_reads": sum(pf.read_stats.block_cache_misses for pf in staged),
            "remote_bytes": sum(pf.read_stats.remote_bytes for pf in staged),
            "remote_gets": sum(pf.read_stats.remote_gets for pf in staged),
            "buffer_bytes": sum(pf.buffer_bytes for pf in staged),
            "staged_bytes": sum(pf.staged_bytes for pf in staged),
            "bytes": sum(pf.bytes_moved for pf in staged)}
        self.tables = []
        layers, triton = self.share.layers, kernel_backend(torch.device(device)) == "triton"
        for row in rows:
            prefix = row.prefix
            if row.blocks and prefix in self.codes:  # per layer, the kernel's plan over the staged stored bytes
                code = self.codes[prefix]
                self.tables.append(({l: code.plan(row.blocks, row.dst_rows, l, self.heads(l)) for l in layers},
                                    None))
                continue
            where = {b: i for i, b in enumerate(unions[prefix])}
            at = [where[b] for b in row.blocks]
            segments, kernel_plans = {}, {}
            for l in layers:
                # the block's layer slice in the staged factors; this share's heads, numbered from the buffers' first
                seg = row.segments[l].copy()
                per_block, heads = prefix.layout.segments_per_block(l), self.heads(l)
                if row.blocks:
                    seg[:, 0] += np.repeat(self.fetched[prefix].starts[l, at], per_block)
                kept = (seg[:, 4] >= heads.start) & (seg[:, 4] < heads.stop)
                if row.reach is not None:  # the blocks its windows reach at this layer
                    kept &= np.isin(np.arange(len(seg)) // max(1, per_block), row.layer_blocks(l))
                seg = seg[kept]
                seg[:, 4] -= heads.start
                segments[l] = torch.from_numpy(seg)
            if triton and row.blocks:  # planned in one pass per shape of table (every layer at once, most often)
                alike: dict[tuple[int, int], list[int]] = {}
                for l in layers:
                    if len(segments[l]):
                        alike.setdefault((len(segments[l]), prefix.layers[l].head_dim), []).append(l)
                for (_, d), run in alike.items():
                    kernel_plans.update(zip(run, plan_layers(torch.stack([segments[l] for l in run]), d,
                                                             factor_dtype=prefix.store.torch_dtype, device=device,
                                                             quant=prefix.layout.quant)))
            self.tables.append((segments, kernel_plans))
        self.shared = (self._shared_blocks() if rebuild is rebuild_layer and kernel_backend(device) == "cpu"
                       and all(row.reach is None for row in self.rows) else None)  # a window's reach: per row
        # the CPU's decoded layer of the rows' distinct blocks (fp32 K and V on the layout's grid, each layer a corner
        # of it): staged like the factors, and counted
        width = max((len(self.heads(l)) for l in layers if layout.layers[l].holds_cache), default=0)
        self.decoded, self.decoded_shape = None, (2, width, max((c for _, c, _ in (self.shared or {}).values()),
                                                                default=0), layout.head_dim)
        self.fetch_stats["buffer_bytes"] += int(np.prod(self.decoded_shape)) * 4

    def linear_states(self, layer: int) -> list[LinearStart | None]:
        """Each row's start at linear ``layer`` (`milo_infer.runtime.linear_rows`), its blocks in placement order: the
        anchor's state carried through the pairs (M, C) of the blocks before its first unreadable one (fp32) and the
        conv tail of the last of them, or the anchor's; then, where read blocks follow unreadable ones, a `Join` at the
        end of those unreadable blocks' tokens in what the row feeds, which opens with every unreadable block's tokens
        in context order (the columns its placement leaves out: a hybrid recomputes nothing else, `MountedStore.plan`).
        None: a prefill row, which starts from zero."""
        with self.clock.device_stage("wait"):
            staged = {prefix: pf.layer(layer) for prefix, pf in self.fetched.items()}
        where = {prefix: {b: i for i, b in enumerate(pf.block_ids)} for prefix, pf in self.fetched.items()}
        states = []
        with self.clock.device_stage("rebuild"):
            for row in self.rows:
                if not row.anchor or not row.prefix_tokens:
                    states.append(None)
                    continue
                prefix = row.prefix
                state, window = prefix.anchor_state[layer]
                joins, column, fed = [], prefix.anchor_len, 0  # column: where the blocks walked so far end
                flat, starts = staged[prefix] if row.blocks else (None, None)
                size = int(prefix.layout.state_sizes[layer])
                for b, dst, end in zip(row.blocks, row.dst_rows.tolist(), row.block_ends().tolist()):
                    at = int(starts[where[prefix][b]])
                    section = prefix.layout.state_section(layer, flat[at:at + size])
                    if dst > column:  # unreadable blocks' columns before it: the row feeds their tokens first
                        fed += dst - column
                        joins.append([fed, None, None])
                    if joins:
                        joins[-1][1:] = composed(joins[-1][1], section), section["conv"]
                    else:
                        state, window = carried(section, state), section["conv"]
                    column = end
                states.append(LinearStart(state, window.clone(),
                                          tuple(Join(at, pair, tail.clone()) for at, pair, tail in joins)))
        return states

    def heads(self, layer: int) -> range:
        """The KV heads of ``layer`` this rebuild writes (the share's), in the store's numbering."""
        return self.share.layer_heads(self.rows[0].prefix.layers[layer])

    def _shared_blocks(self) -> dict:
        """Per mounted version: per layer, one segment table of each block its rows place, once, one after another
        from row 0 (a scratch of their columns), and each (block's first scratch row, tokens, first row in the
        context, the rows placing it there)."""
        seen: dict = {}  # (version, block) -> its first scratch row and tokens
        shared: dict = {}  # version -> {layer: [tables]}, columns, {(scratch row, tokens, dst): [rows]}
        for r, (row, (segments, _)) in enumerate(zip(self.rows, self.tables)):
            tables, columns, placed = shared.setdefault(row.prefix, ({l: [] for l in self.share.layers}, [0], {}))
            for i, (block, dst) in enumerate(zip(row.blocks, row.dst_rows.tolist())):
                if (row.prefix, block) not in seen:
                    tokens = int(row.prefix.store.block_tokens[block])
                    for l in self.share.layers:  # the block's rows: keys', then values', head by head
                        per_block = len(segments[l]) // len(row.blocks)
                        table = segments[l][i * per_block:(i + 1) * per_block].clone()
                        table[:, 3] = columns[0]
                        tables[l].append(table)
                    seen[row.prefix, block] = (columns[0], tokens)
                    columns[0] += tokens
                placed.setdefault((*seen[row.prefix, block], dst), []).append(r)
        return {m: ({l: torch.cat(t) for l, t in tables.items()}, columns[0], placed)
                for m, (tables, columns, placed) in shared.items() if columns[0]}

    def union_reach(self, prefix: "StorePrefix", union: list[int]) -> dict[int, list[int]] | None:
        """Per layer of the share, the blocks of ``union`` (indices into it) some row of ``prefix`` rebuilds there;
        None when every such row rebuilds every block at every layer."""
        rows = [row for row in self.rows if row.prefix is prefix and row.blocks]
        if all(row.reach is None for row in rows):
            return None
        where = {b: i for i, b in enumerate(union)}
        return {l: sorted({where[row.blocks[i]] for row in rows for i in row.layer_blocks(l)})
                for l in self.share.layers}

    def fill(self, layer: int, k_buf, v_buf) -> None:
        """Write ``layer`` of every row's prefix into its buffers (a latent layer's: keys only, its rows' ``v_buf``
        entries None)."""
        if layer not in self.share.layers:
            raise ValueError(f"layer {layer} is not in this rebuild's layers {self.share.layers}")
        if not self.rows[0].prefix.layers[layer].holds_cache:  # a shared layer attends its source's: nothing here
            return
        heads = slice(self.heads(layer).start, self.heads(layer).stop)
        cos, sin = self.rope.layer(layer)
        with self.clock.device_stage("wait"):
            factors = {prefix: pf.layer(layer)[0] for prefix, pf in self.fetched.items()}
        with self.clock.device_stage("rebuild"):
            scales = {m: code.channel_scale(layer, self.heads(layer)) for m, code in self.codes.items()}
            for row, (segments, kernel_plans), k, v in zip(self.rows, self.tables, k_buf, v_buf):
                if not row.prefix_tokens:  # a prefill row: no prefix, not even the anchor
                    continue
                m = row.prefix
                if row.anchor:
                    k[:, :m.anchor_len] = m.anchor_k[layer][heads]
                    if v is not None:
                        v[:, :m.anchor_len] = m.anchor_v[layer][heads]
                v = k if v is None else v  # a latent layer's: no value segments, so never written
                if kernel_plans is None:  # rebuilt from its stored codes
                    self.codes[m].rebuild(segments[layer], scales[m], k[:, :row.prefix_tokens], v[:, :row.prefix_tokens],
                                          cos, sin, **m.rope_layout(layer))
                elif self.shared is None and len(segments[layer]):
                    self.rebuild(factors[m], segments[layer], k[:, :row.prefix_tokens], v[:, :row.prefix_tokens],
                                 cos, sin, **m.rope_layout(layer), quant=m.layout.quant,
                                 plan=kernel_plans.get(layer))
                    if layer in m.key_gain:
                        self._keys_from_values(row, layer, k, v, cos, sin)
            if self.shared is not None:
                self._fill_shared(layer, factors, k_buf, v_buf, cos, sin)

    def _keys_from_values(self, row: BlockPlacement, layer: int, k, v, cos, sin) -> None:
        """A K = V layer's keys of the row's blocks: their rebuilt values times the store's gain, rotated."""
        m, ends = row.prefix, row.block_ends()
        for i in row.layer_blocks(layer):
            at = slice(int(row.dst_rows[i]), int(ends[i]))
            k[:, at] = rope(v[:, at].float() * m.key_gain[layer], cos[at], sin[at], **m.rope_layout(layer))

    def _fill_shared(self, layer: int, factors: dict, k_buf, v_buf, cos, sin) -> None:
        """The CPU's rebuild of this layer: each block decoded once (fp32, keys pre-RoPE), its keys rotated into each
        row that places it, once per position where the rows' buffers are not fp32."""
        if self.decoded is None:  # one buffer for every layer of this rebuild, not one a layer
            self.decoded = torch.empty(self.decoded_shape, dtype=torch.float32, device=cos.device)
        for m, (segments, columns, placed) in self.shared.items():
            spec = m.layers[layer]
            decoded = self.decoded[:, :len(self.heads(layer)), :columns, :spec.head_dim]
            decode_layer(factors[m], segments[layer], decoded[0], decoded[1], quant=m.layout.quant)
            if layer in m.key_gain:
                torch.mul(decoded[1], m.key_gain[layer], out=decoded[0])
            layout = m.rope_layout(layer)
            for (first, tokens, dst), rows in placed.items():
                block, at = slice(first, first + tokens), slice(dst, dst + tokens)
                keys = None
                for r in rows:
                    k = k_buf[r][:, at]
                    if k.dtype == torch.float32:
                        rope(decoded[0][:, block], cos[at], sin[at], out=k, **layout)
                    else:
                        if keys is None:
                            keys = rope(decoded[0][:, block], cos[at], sin[at], **layout)
                        k.copy_(keys)
                    if v_buf[r] is not None:
                        v_buf[r][:, at].copy_(decoded[1][:, block])
        if layer == self.share.layers[-1]:
            self.decoded = None
