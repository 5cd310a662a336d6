"""The codec room: how a store's block bytes are planned, encoded, quantized, allocated and decoded.

It holds one module per codec beside its naive reference decode, the parts they share, and pass two's
planning; the storage room (the rest of `milo_store`) reaches it only through the names exported here:

- `lowrank` (+ `lowrank_reference`): SVD factors packed at given ranks, and `LowRankCodec`;
- `bits` (+ `bits_reference`): `BitsCodec`, one code width per query-weighted component;
- `transform` (+ `transform_reference`): the study's corpus-basis codec, not a store codec yet;
- `baselines`: global-proj and example-svd, pass-two sources over the same staged SVD factors;
- shared parts: `quant` (INT8/INT4/INT2 segment bytes), `allocation` (ranks under a byte budget),
  `rate_distortion` (per-column widths by measured distortion);
- `planning`: pass two's planning (`CompressionConfig`, `plan_store`); `registry`: which codec a store holds.

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

`lowrank.LowRankCodec` holds every store written before issue 45 (svd, identity, raw and the baselines;
its bytes are the kernels' segments); `bits.BitsCodec` per-block bases (docs/format.md "Bits stores").
"""
from __future__ import annotations

from .allocation import BudgetError, allocate_ranks
from .bits import BitsCodec
from .lowrank import BlockFactors, LowRankCodec, factorize_block, pack_block
from .lowrank_reference import reconstruct, unpack_block
from .planning import (CompressionConfig, allocation_record, check_budget, demonstration_blocks, plan_ranks,
                       plan_store, quant_layout, staging_codec)
from .registry import STORE_CODECS, for_config, open_codec

__all__ = [
    "BudgetError", "allocate_ranks", "BitsCodec", "BlockFactors", "LowRankCodec", "factorize_block", "pack_block",
    "reconstruct", "unpack_block", "CompressionConfig", "allocation_record", "check_budget", "demonstration_blocks",
    "plan_ranks", "plan_store", "quant_layout", "staging_codec", "STORE_CODECS", "for_config", "open_codec",
]
