"""milo_store: a store of encoded KV blocks, in two rooms.

- The codec room, `milo_store.codecs`: how a block's bytes are planned, encoded, quantized, allocated and
  decoded (the low-rank and bits codecs, their references, quantization, rank and width allocation, pass
  two's planning). Its package names the only seam the rest of milo_store uses.
- The storage room, every other module: the Zarr v3 store on disk or behind a URL (`format`, `layout`,
  `store`, `writer`, `sources`, `chunks`, `blockcache`, `remote`, `segments`, `compaction`, `absence`,
  `push`), pass one's staging (`staging`), pass two's writing (`compress`), the retrieval text
  (`text_index`), and the CLI (`cli`). Change the object-store tier here without touching a codec.
"""
from . import text_index
from .codecs import (BlockFactors, CompressionConfig, allocate_ranks, factorize_block, pack_block, plan_ranks,
                     reconstruct, unpack_block)
from .compress import write_store
from .errors import (FormatVersionError, IncompatibleStoreError, NotAStoreError, StoreCorruptedError, StoreError,
                     StoreLockedError)
from .layout import Layout, compressed_bytes, full_kv_bytes
from .staging import Staging
from .store import MiloStore
from .writer import StoreWriter

__all__ = [
    "allocate_ranks", "BlockFactors", "factorize_block", "pack_block", "reconstruct", "unpack_block",
    "CompressionConfig", "plan_ranks", "write_store", "FormatVersionError", "IncompatibleStoreError",
    "NotAStoreError", "StoreCorruptedError", "StoreError", "StoreLockedError", "Layout", "compressed_bytes",
    "full_kv_bytes", "Staging", "MiloStore", "StoreWriter",
]
