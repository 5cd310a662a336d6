"""Blocks' packed factors kept on the compute device, bounded in bytes, least recently used out first.

A block that a later batch retrieves again then skips the store's read and the host-to-device link. At
ratio ρ the same device bytes hold about 1/ρ as many blocks as a cache of full K/V would. One tier
serves every store a process mounts, keyed by `MiloStore.block_key`: in a format-4 store a block's chunk,
offset, length and CRC32C, which every version keeping the block shares, so a hot swap leaves the kept
blocks resident (in older stores the store, version and index: a block id of one version is another
block in the next); safe for concurrent callers.
"""
import threading
from collections import OrderedDict

import torch


class DeviceTier:
    def __init__(self, limit_bytes: int, device):
        if limit_bytes < 0:
            raise ValueError(f"device tier size must be >= 0 bytes, got {limit_bytes}")
        self.limit, self.device = int(limit_bytes), torch.device(device)
        self._blocks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = 0

    def get(self, key: tuple) -> torch.Tensor | None:
        """The block's factors on the device, or None (counted as a miss)."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.hits += 1
            return block

    def put(self, key: tuple, block: torch.Tensor) -> None:
        """Keep ``block`` (already on the device), evicting the least recently used; a block larger than
        the whole tier is not kept."""
        size = block.numel() * block.element_size()
        if size > self.limit:
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.bytes -= old.numel() * old.element_size()
            self._blocks[key] = block
            self.bytes += size
            while self.bytes > self.limit:
                _, evicted = self._blocks.popitem(last=False)
                self.bytes -= evicted.numel() * evicted.element_size()

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        with self._lock:
            lookups = self.hits + self.misses
            return {"blocks": len(self._blocks), "bytes": self.bytes, "limit_bytes": self.limit, "hits": self.hits,
                    "misses": self.misses, "hit_rate": self.hits / lookups if lookups else 0.0}
