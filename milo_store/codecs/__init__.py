"""The codec room: how a store's block bytes are planned, encoded and decoded (issue 45).

Every store has one *store codec*, chosen from its attributes (`open_codec`) or from a build's
configuration (`for_config`). Writer, reader and pass two call it through one small protocol, so that
nothing outside this room asks which codec a store holds:

- ``stored_offsets`` (int64 [N + 1]) and ``stored_dtype``: where each block's bytes lie in the store's
  flat block array, in items of that dtype (what reads, checksums and `block_bytes` count; a mounted
  store's ``stored_itemsize`` and ``stored_torch_dtype`` say the same); ``segments_stored``: whether those
  bytes are the decoded segments themselves, layer after layer (so a share of layers or heads is a byte range);
- ``ranks`` [N, L, 2, H], ``layout`` and ``dtype``: the *decoded* form every front end reads, fp16 or
  quantized low-rank segments as `milo_store.layout` lays them out and `milo_kernels.reconstruct_layer`
  rebuilds them (keys rotated at each row's positions);
- ``decode(i, stored)``: block i's stored bytes to that decoded form (the low-rank codec: the bytes
  themselves, no copy);
- ``kernel_tables(i, layer, dst_row, base, first)`` and ``channel_scale(layer)``, only where a kernel rebuilds
  the codec's stored bytes directly (the bits codec: `milo_kernels.bits`'s component and segment tables,
  with no host decode); a codec without them is rebuilt from its decoded form;
- ``arrays()``: the codec's own metadata arrays, written checked beside the index; ``fixed_bytes`` and
  ``index_bytes``: what they add to the store's counted bytes.

Codecs: `lowrank.LowRankCodec` (every store written before issue 45: svd, identity, raw and the
baselines; its bytes are the kernels' segments) and `bits.BitsCodec` (per-block bases with one code
width per component, docs/format.md "Bits stores"). `transform.TransformCodec` (a corpus basis) is the
study's, not a store codec yet.
"""
from __future__ import annotations

from .bits import BitsCodec
from .lowrank import LowRankCodec

STORE_CODECS = {BitsCodec.name: BitsCodec}  # codecs with their own block format; every other name is low-rank


def open_codec(meta: dict, layout, dtype: str, ranks, tokens, read_array):
    """The codec of a mounted store (``read_array(name)``: a checked metadata array of the store)."""
    cls = STORE_CODECS.get(meta.get("codec"))
    if cls is None:
        return LowRankCodec(layout, dtype, ranks, tokens)
    return cls.open(meta, layout, ranks, tokens, read_array)


def for_config(codec: str):
    """The class whose ``write_store`` pass two runs for a build of ``codec`` (None: the low-rank pass two)."""
    return STORE_CODECS.get(codec)


__all__ = ["BitsCodec", "LowRankCodec", "STORE_CODECS", "open_codec", "for_config"]
