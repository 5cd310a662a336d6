"""Where every factor lives: the byte layout of blocks, layers and segments, and exact byte accounting.

A block is one contiguous run of the store's flat factor array. Inside it, layers follow each other;
inside a layer, segments are ordered (kind, head) with keys (kind 0) before values (kind 1). A
segment of rank r over T tokens with head dim d is ``A [T, r]`` row-major, ``Σ [r]``, ``B [d, r]``
row-major: r * (T + d + 1) values. Everything here derives from the ranks and token counts alone.

A quantized layout (``quant`` set) counts bytes instead, laid out by ``codecs/quant.py``: an ``int8``
segment is r * (T' + d + 10) bytes with T' = T rounded up to even. ``int4`` and ``int2`` segments
(KIVI-style: key factors per channel in spans of SCALE_SPAN tokens, value factors per
token) cost ``unit_size`` bytes per rank unit plus, for values, a fixed ``fixed_size`` (each token's
scale and minimum) whenever the rank is above zero.

A unit may instead be *raw* (rank ``RAW_RANK``): its K or V [T, d] itself in the factor dtype, or
quantized as the A part of a rank-d segment whose Σ = 1 and B = I go unstored (``raw_size``).

Units sit on a grid [L, 2, H] (layer, kind, head) that the layers' descriptions (``layers``,
`milo_store.layers.LayerSpec`) fill: ``num_kv_heads`` and ``head_dim`` are the grid's, the most heads and the
widest head any layer stores; a unit's own width is its layer's (``widths``), and a unit its layer does not store
(``present``: a shared layer's, a K = V layer's keys, heads past its own) has rank 0 and no bytes. Every store
written before per-layer descriptions has one shape for every layer: its grid is its layout.

A linear layer (`LayerSpec` ``linear``) stores no units but a *state section* at the end of its layer's place in a
block, of a fixed size whatever the block's length (``state_sizes``): its values M, C and conv tail in the factor
dtype, or as float16 (two bytes a value) in a quantized store; `state_section` reads them back.

The sizes themselves, and RAW_RANK, SCALE_SPAN and the bit widths, live in ``milo_format``, which
the kernels read segments by too.
"""
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

import milo_format
from milo_format import QUANT_BITS, RAW_RANK

from .layers import LayerSpec, check_layers, grid, present_units, uniform_layers, unit_widths

KINDS = ("key", "value")
# Bytes per value of the index arrays that the accounting counts beside the factors.
RANK_BYTES, TOKENS_BYTES, CHECKSUM_BYTES = 2, 4, 4


@dataclass(frozen=True)
class Layout:
    num_layers: int
    num_kv_heads: int  # the grid's: the most heads a layer stores
    head_dim: int  # the grid's: the widest head a layer stores
    quant: str | None = None  # "int8", "int4", "int2": quantized factors, sizes and offsets in bytes
    layers: tuple[LayerSpec, ...] | None = None  # None: every layer its own keys and values of the grid's shape

    def __post_init__(self):
        if self.quant is not None and self.quant not in QUANT_BITS:
            raise ValueError(f"unknown quantization {self.quant!r}; expected one of {tuple(QUANT_BITS)}")
        if self.layers is None:
            object.__setattr__(self, "layers", uniform_layers(self.num_layers, self.num_kv_heads, self.head_dim))
            return
        object.__setattr__(self, "layers", tuple(self.layers))
        check_layers(self.layers)
        if len(self.layers) != self.num_layers or grid(self.layers) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"{len(self.layers)} layers of grid {grid(self.layers)} do not make a layout of "
                             f"{self.num_layers} layers, {self.num_kv_heads} heads of {self.head_dim}")

    @classmethod
    def of(cls, layers, quant: str | None = None) -> "Layout":
        """The layout of these layers' descriptions (its grid their most heads and widest head)."""
        layers = tuple(layers)
        return cls(len(layers), *grid(layers), quant, layers)

    @cached_property
    def present(self) -> np.ndarray:
        """bool [L, 2, H]: the units the layers store."""
        return present_units(self.layers)

    @cached_property
    def widths(self) -> np.ndarray:
        """int64 [L, 2, 1]: each layer's keys' and values' width, broadcast over heads (0: none stored)."""
        return unit_widths(self.layers)

    @cached_property
    def state_sizes(self) -> np.ndarray:
        """int64 [L]: elements (bytes when quantized: float16 values) of each layer's state section in a block."""
        per_value = 2 if self.quant else 1
        return np.array([spec.state_values * per_value for spec in self.layers], dtype=np.int64)

    def state_section(self, layer: int, section: torch.Tensor) -> dict[str, torch.Tensor]:
        """A linear layer's state section (its ``state_sizes[layer]`` stored elements, or its values in any float
        dtype) as views: M ([heads, head_dim, head_dim], or [heads] for a ``mamba2`` rule), C [heads, head_dim,
        value_dim], conv tail [conv_kernel - 1, conv_dim]."""
        spec = self.layers[layer]
        values = section.view(torch.float16) if section.dtype == torch.uint8 else section  # a quantized store's bytes
        if len(values) != spec.state_values or not spec.state_values:
            raise ValueError(f"{len(values)} values are not layer {layer}'s state section ({spec.state_values})")
        H, dk, dv = spec.kv_heads, spec.head_dim, spec.value_dim
        m, c = spec.transition_values, H * dk * dv
        return {"M": values[:m].view(H, dk, dk) if spec.rule == "gated_delta" else values[:m],
                "C": values[m:m + c].view(H, dk, dv), "conv": values[m + c:].view(spec.conv_kernel - 1, spec.conv_dim)}

    def block_states(self, block_ranks: np.ndarray, tokens: int, block: torch.Tensor) -> dict[int, dict]:
        """Every linear layer's state (`state_section`) in one block's stored elements (ranks [L, 2, H])."""
        ends = self.layer_offsets(block_ranks, tokens)[1:]
        return {l: self.state_section(l, block[ends[l] - size:ends[l]])
                for l, size in enumerate(self.state_sizes.tolist()) if size}

    @property
    def uniform(self) -> bool:
        """Every unit of the grid stored, of one width: the layout of every store before per-layer descriptions."""
        return bool(self.present.all() and (self.widths == self.head_dim).all())

    def record(self) -> dict:
        """What a store's attributes keep of it (``layout``): the grid, and each layer where they are not all alike
        (format 5; a uniform layout's layers are read back from its model's RoPE record, `from_record`)."""
        record = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                  "quant": self.quant, "quantized": self.quant == "int8"}  # what readers before INT4 look for
        if not self.uniform:
            record["layers"] = [spec.record() for spec in self.layers]
        return record

    @classmethod
    def from_record(cls, record: dict, rope: dict | None = None) -> "Layout":
        """The layout a store's attributes describe. A store written before per-layer descriptions names its RoPE
        layout in its model's record (``rope``: 'layout', 'rotary_dim', 'nope_layers')."""
        quant = record.get("quant", "int8" if record.get("quantized") else None)  # "quantized": before int4/int2
        L, H, d = record["num_layers"], record["num_kv_heads"], record["head_dim"]
        if "layers" in record:
            return cls(L, H, d, quant, tuple(LayerSpec.from_record(r) for r in record["layers"]))
        rope = rope or {}
        interleaved = rope.get("layout") == "interleaved"
        rotary_dim = rope.get("rotary_dim") if not interleaved and rope.get("rotary_dim") not in (None, d) else None
        return cls(L, H, d, quant, uniform_layers(L, H, d, "interleaved" if interleaved else "half", rotary_dim,
                                                  frozenset(rope.get("nope_layers", ()))))

    def pack_units(self, x: torch.Tensor) -> torch.Tensor:
        """The units this layout stores of ``x`` [L, 2, H, T, d] (its grid), each [T, its width], one after another in
        grid order, flat: how a format-5 store keeps its uncompressed anchor."""
        parts = [x[l, k, h, :, :self.widths[l, k, 0]].reshape(-1) for l, k, h in zip(*np.nonzero(self.present))]
        return torch.cat(parts) if parts else x.new_zeros(0)

    def unpack_units(self, flat: torch.Tensor, tokens: int) -> torch.Tensor:
        """`pack_units`' inverse: the grid [L, 2, H, T, d], zero where a unit is absent or past its width."""
        out = flat.new_zeros(self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)
        at = 0
        for l, k, h in zip(*np.nonzero(self.present)):
            width = int(self.widths[l, k, 0])
            out[l, k, h, :, :width] = flat[at:at + tokens * width].reshape(tokens, width)
            at += tokens * width
        if at != len(flat):
            raise ValueError(f"{len(flat)} values are not {tokens} tokens of this layout's units ({at})")
        return out

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    @property
    def bits(self) -> int:
        """Code width of the quantized factors; 0 for floating ones (milo_format's sizes take it)."""
        return QUANT_BITS[self.quant] if self.quantized else 0

    def unit_size(self, tokens, kind=0):
        """Storage elements one rank unit of a ``kind`` segment costs over ``tokens`` tokens (bytes when quantized).

        Every size is even when quantized, so each segment's fp16 header stays 2-byte aligned.
        """
        return milo_format.unit_size(np.asarray(tokens, dtype=np.int64), self._width(kind), self.bits, np.asarray(kind))

    def fixed_size(self, tokens, kind=0):
        """Bytes a segment of rank > 0 costs beyond its rank units: a low-bit value's per-token scale and min."""
        return milo_format.fixed_size(np.asarray(tokens, dtype=np.int64), self.bits, np.asarray(kind))

    def raw_size(self, tokens, kind=0):
        """Elements (bytes when quantized) of a raw ``kind`` segment over ``tokens`` tokens (docs/format.md).

        Floating: T·d values. INT8: a scale and minimum per channel, 4d, plus T'·d codes (T' even).
        INT4/INT2: a low-bit A of rank d without Σ and B: key scales per channel and span, 4d·G, or
        value scales per token, 4T, plus d columns of codes.
        """
        return milo_format.raw_size(np.asarray(tokens, dtype=np.int64), self._width(kind), self.bits, np.asarray(kind))

    def _width(self, kind):
        """The units' widths for sizes taken per ``kind``: the grid's [L, 2, 1], or the one width of a uniform layout
        (whose sizes keep the shapes they always had)."""
        return self.head_dim if self.uniform else self.widths

    def _sizes(self, ranks: np.ndarray, tokens: np.ndarray, layer: int | None = None) -> np.ndarray:
        """Elements of each segment: ranks [..., L, 2, H] (``layer``: one layer's [..., 2, H]) against tokens
        broadcast to ranks[..., None, None]."""
        r = np.asarray(ranks, dtype=np.int64)
        t = np.asarray(tokens, dtype=np.int64)[..., None, None]
        widths = self.widths if layer is None else self.widths[layer]
        return milo_format.segment_size(r, t, widths, self.bits, np.arange(2).reshape(2, 1))

    def ranks_in_range(self, ranks) -> bool:
        """Every rank of a present unit is RAW_RANK or in [0, its width], and every absent unit's 0: what writer
        and reader both require (a projection's rank may exceed a block's token count, never its width)."""
        r = np.asarray(ranks)
        width = np.broadcast_to(self.widths, self.present.shape)
        return not ((r < RAW_RANK) | (r > width) | (~self.present & (r != 0))).any()

    @property
    def units_per_block(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads

    def segment_sizes(self, ranks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Values per segment, shape like ranks [N, L, 2, H], given tokens [N]."""
        return self._sizes(ranks, np.asarray(tokens, dtype=np.int64).reshape(-1, 1))

    def block_offsets(self, ranks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Start of each block in the flat factor array, plus the end: int64 [N + 1]."""
        sizes = self.segment_sizes(ranks, tokens).reshape(len(tokens), -1).sum(axis=1) + self.state_sizes.sum()
        return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)

    def layer_offsets(self, block_ranks: np.ndarray, tokens: int) -> np.ndarray:
        """Start of each layer inside one block (ranks [L, 2, H]), plus the end: int64 [L + 1]. A layer's state
        section is its place's last ``state_sizes[layer]`` elements."""
        sizes = self._sizes(block_ranks, np.int64(tokens)).reshape(self.num_layers, -1).sum(axis=1) + self.state_sizes
        return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)

    def segments_per_block(self, layer: int) -> int:
        """Rows a block has in ``layer``'s segment table: the units the layer stores."""
        return int(self.present[layer].sum())

    def layer_segments(self, layer: int, layer_ranks: np.ndarray, tokens: np.ndarray, dst_rows: np.ndarray,
                       src_starts: np.ndarray) -> np.ndarray:
        """Segment table for one layer of several blocks, as the reconstruction kernel takes it: a row per unit the
        layer stores (`segments_per_block`), keys before values, head by head.

        layer_ranks [n, 2, H]; tokens, dst_rows (first output row of each block) and src_starts (where
        each block's layer slice starts in the gathered factor buffer) are [n]. Returns int64 [n*S, 6]:
        src_offset, rank, tokens, dst_row, head, kind.
        """
        r = np.asarray(layer_ranks, dtype=np.int64)
        n, H = r.shape[0], self.num_kv_heads
        t = np.asarray(tokens, dtype=np.int64)
        sizes = self._sizes(r, t, layer).reshape(n, -1)
        within = np.cumsum(sizes, axis=1) - sizes
        src = np.asarray(src_starts, dtype=np.int64).reshape(-1, 1) + within
        kind, head = np.divmod(np.arange(2 * H), H)
        table = np.stack(np.broadcast_arrays(
            src, r.reshape(n, -1), t.reshape(-1, 1), np.asarray(dst_rows, dtype=np.int64).reshape(-1, 1),
            head.reshape(1, -1), kind.reshape(1, -1)), axis=-1)
        return table[:, self.present[layer].reshape(-1)].reshape(-1, 6)

    def unit_bytes(self, tokens: np.ndarray, bytes_per_value: int = 2) -> np.ndarray:
        """Uncompressed bytes of each unit of these blocks [N, L, 2, H] (0 where absent)."""
        t = np.asarray(tokens, dtype=np.int64).reshape(-1, 1, 1, 1)
        return t * self.widths * self.present * bytes_per_value

    def layer_groups(self) -> dict[str, list[int]]:
        """The layers by what they hold, for reports: 'kv HxD', 'v HxD' (keys from values), 'latent R+C' (a rope key
        and a latent), 'linear HxKxV' (a state of H heads, K by V), 'shared'."""
        groups: dict[str, list[int]] = {}
        for l, spec in enumerate(self.layers):
            name = (f"conv {spec.conv_kernel - 1}x{spec.conv_dim}" if spec.rule == "conv" and spec.state_values else
                    f"{'linear' if spec.rule == 'gated_delta' else spec.rule} "
                    f"{spec.kv_heads}x{spec.head_dim}x{spec.value_dim}" if spec.state_values else
                    spec.kind if spec.kind == "mlp" else "shared" if not spec.holds_cache else
                    f"latent {spec.head_dim - spec.latent}+{spec.latent}" if spec.latent else
                    f"{'v' if spec.keys_from_values else 'kv'} {spec.kv_heads}x{spec.head_dim}")
            groups.setdefault(name, []).append(l)
        return groups


def full_kv_bytes(layout: Layout, tokens: np.ndarray, bytes_per_value: int = 2) -> int:
    """Bytes of the uncompressed keys and values these blocks' layers store (fp16 unless told otherwise): what
    a ratio is of. A shared layer stores none, a K = V layer one copy."""
    per_token = int((np.broadcast_to(layout.widths, layout.present.shape) * layout.present).sum())
    return int(np.sum(tokens, dtype=np.int64)) * per_token * bytes_per_value


def index_bytes(layout: Layout, num_blocks: int) -> int:
    """Bytes of the per-block index a compressed store keeps: ranks, token counts, checksums."""
    return num_blocks * (layout.units_per_block * RANK_BYTES + TOKENS_BYTES + CHECKSUM_BYTES)


def compressed_bytes(layout: Layout, ranks: np.ndarray, tokens: np.ndarray, bytes_per_value: int = 2) -> dict:
    """Exact bytes of a compressed set: factors plus index (and linear layers' state sections, ``state_bytes``, which
    no budget compresses), and their ratio to the fp16 full KV."""
    factors = int(layout.segment_sizes(ranks, tokens).sum()) * bytes_per_value
    state = len(tokens) * int(layout.state_sizes.sum()) * bytes_per_value
    index = index_bytes(layout, len(tokens))
    full = full_kv_bytes(layout, tokens)
    total = factors + state + index
    return {"factor_bytes": factors, "state_bytes": state, "index_bytes": index, "total_bytes": total,
            "full_fp16_bytes": full, "ratio": total / full if full else 0.0}
