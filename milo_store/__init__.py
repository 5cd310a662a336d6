"""milo_store: block-wise low-rank KV factors, their allocation, and the Zarr v3 store that keeps them."""
from . import text_index
from .allocation import allocate_ranks
from .codec import BlockFactors, factorize_block, pack_block, reconstruct, unpack_block
from .compress import CompressionConfig, plan_ranks, write_store
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
