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

The sizes themselves, and RAW_RANK, SCALE_SPAN and the bit widths, live in ``milo_format``, which
the kernels read segments by too.
"""
from dataclasses import dataclass

import numpy as np

import milo_format
from milo_format import QUANT_BITS, RAW_RANK

KINDS = ("key", "value")
# Bytes per value of the index arrays that the accounting counts beside the factors.
RANK_BYTES, TOKENS_BYTES, CHECKSUM_BYTES = 2, 4, 4


@dataclass(frozen=True)
class Layout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quant: str | None = None  # "int8", "int4", "int2": quantized factors, sizes and offsets in bytes

    def __post_init__(self):
        if self.quant is not None and self.quant not in QUANT_BITS:
            raise ValueError(f"unknown quantization {self.quant!r}; expected one of {tuple(QUANT_BITS)}")

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
        return milo_format.unit_size(np.asarray(tokens, dtype=np.int64), self.head_dim, self.bits, np.asarray(kind))

    def fixed_size(self, tokens, kind=0):
        """Bytes a segment of rank > 0 costs beyond its rank units: a low-bit value's per-token scale and min."""
        return milo_format.fixed_size(np.asarray(tokens, dtype=np.int64), self.bits, np.asarray(kind))

    def raw_size(self, tokens, kind=0):
        """Elements (bytes when quantized) of a raw ``kind`` segment over ``tokens`` tokens (docs/format.md).

        Floating: T·d values. INT8: a scale and minimum per channel, 4d, plus T'·d codes (T' even).
        INT4/INT2: a low-bit A of rank d without Σ and B: key scales per channel and span, 4d·G, or
        value scales per token, 4T, plus d columns of codes.
        """
        return milo_format.raw_size(np.asarray(tokens, dtype=np.int64), self.head_dim, self.bits, np.asarray(kind))

    def _sizes(self, ranks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Elements of each segment: ranks [..., 2, H] against tokens broadcast to ranks[..., None, None]."""
        r = np.asarray(ranks, dtype=np.int64)
        t = np.asarray(tokens, dtype=np.int64)[..., None, None]
        return milo_format.segment_size(r, t, self.head_dim, self.bits, np.arange(2).reshape(2, 1))

    def ranks_in_range(self, ranks) -> bool:
        """Every rank is RAW_RANK or in [0, d]: what writer and reader both require (a projection's
        rank may exceed a block's token count, never d)."""
        r = np.asarray(ranks)
        return not ((r < RAW_RANK) | (r > self.head_dim)).any()

    @property
    def units_per_block(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads

    def segment_sizes(self, ranks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Values per segment, shape like ranks [N, L, 2, H], given tokens [N]."""
        return self._sizes(ranks, np.asarray(tokens, dtype=np.int64).reshape(-1, 1))

    def block_offsets(self, ranks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Start of each block in the flat factor array, plus the end: int64 [N + 1]."""
        sizes = self.segment_sizes(ranks, tokens).reshape(len(tokens), -1).sum(axis=1)
        return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)

    def layer_offsets(self, block_ranks: np.ndarray, tokens: int) -> np.ndarray:
        """Start of each layer inside one block (ranks [L, 2, H]), plus the end: int64 [L + 1]."""
        sizes = self._sizes(block_ranks, np.int64(tokens)).reshape(self.num_layers, -1)
        return np.concatenate(([0], np.cumsum(sizes.sum(axis=1)))).astype(np.int64)

    def layer_segments(self, layer_ranks: np.ndarray, tokens: np.ndarray, dst_rows: np.ndarray,
                       src_starts: np.ndarray) -> np.ndarray:
        """Segment table for one layer of several blocks, as the reconstruction kernel takes it.

        layer_ranks [n, 2, H]; tokens, dst_rows (first output row of each block) and src_starts (where
        each block's layer slice starts in the gathered factor buffer) are [n]. Returns int64 [n*2*H, 6]:
        src_offset, rank, tokens, dst_row, head, kind.
        """
        r = np.asarray(layer_ranks, dtype=np.int64)
        n, H = r.shape[0], self.num_kv_heads
        t = np.asarray(tokens, dtype=np.int64)
        sizes = self._sizes(r, t).reshape(n, -1)
        within = np.cumsum(sizes, axis=1) - sizes
        src = np.asarray(src_starts, dtype=np.int64).reshape(-1, 1) + within
        kind, head = np.divmod(np.arange(2 * H), H)
        table = np.stack(np.broadcast_arrays(
            src, r.reshape(n, -1), t.reshape(-1, 1), np.asarray(dst_rows, dtype=np.int64).reshape(-1, 1),
            head.reshape(1, -1), kind.reshape(1, -1)), axis=-1)
        return table.reshape(-1, 6)


def full_kv_bytes(layout: Layout, tokens: np.ndarray, bytes_per_value: int = 2) -> int:
    """Bytes of the uncompressed K and V of these blocks (fp16 unless told otherwise)."""
    return int(np.sum(tokens, dtype=np.int64)) * layout.units_per_block * layout.head_dim * bytes_per_value


def index_bytes(layout: Layout, num_blocks: int) -> int:
    """Bytes of the per-block index a compressed store keeps: ranks, token counts, checksums."""
    return num_blocks * (layout.units_per_block * RANK_BYTES + TOKENS_BYTES + CHECKSUM_BYTES)


def compressed_bytes(layout: Layout, ranks: np.ndarray, tokens: np.ndarray, bytes_per_value: int = 2) -> dict:
    """Exact bytes of a compressed set: factors plus index, and their ratio to the fp16 full KV."""
    factors = int(layout.segment_sizes(ranks, tokens).sum()) * bytes_per_value
    index = index_bytes(layout, len(tokens))
    full = full_kv_bytes(layout, tokens)
    return {"factor_bytes": factors, "index_bytes": index, "total_bytes": factors + index,
            "full_fp16_bytes": full, "ratio": (factors + index) / full if full else 0.0}
