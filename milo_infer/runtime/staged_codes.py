"""A store's blocks staged on the device as their stored bytes, for a codec whose bytes a kernel rebuilds directly.

Why: the bits codec's blocks decode on the host into fp16 low-rank factors about twice their bytes, which then
cross the link and fill the device tier. Where the Triton kernel rebuilds (CUDA, or MILO_KERNEL=triton under
TRITON_INTERPRET=1) and the store's codec offers ``kernel_tables`` (milo_store/codecs, the seam), a
`PrefixRebuild` stages the union of its rows' blocks here instead: their stored bytes, checked, in one device
buffer (a block the device tier holds is copied from it; a block read is put there, keyed apart from decoded
factors), and each row's layer is planned once from the codec's tables and launched per layer (`milo_kernels.bits`).
"""
from __future__ import annotations

import numpy as np
import torch

from milo_kernels.bits import launch_bits, plan_bits_tables
from milo_store.sources import ReadStats
from milo_store.store import MiloStore

from .device_tier import DeviceTier


def rebuilds_from_codes(store: MiloStore) -> bool:
    """Whether the store's codec describes its stored bytes to a kernel (`kernel_tables`)."""
    return hasattr(store.codec, "kernel_tables")


class StagedCodes:
    """``ids``' stored bytes on ``device`` and, per row, each layer's kernel tables over them."""

    def __init__(self, store: MiloStore, ids: list[int], device, tier: DeviceTier | None = None):
        self.store, self.codec, self.device, self.block_ids = store, store.codec, torch.device(device), list(ids)
        self.read_stats = ReadStats()
        keys = {i: ("stored",) + tuple(store.block_key(i)) for i in ids}  # apart from decoded factors' entries
        resident = {i: tier.get(keys[i]) for i in ids} if tier is not None else {}
        missing = [i for i in ids if resident.get(i) is None]
        self.tier_hits = len(ids) - len(missing) if tier is not None else 0
        read = dict(zip(missing, store.stored_blocks(missing, self.read_stats)))
        for i in missing:
            resident[i] = read[i].to(self.device, non_blocking=True)
            if tier is not None:
                tier.put(keys[i], resident[i])
        parts = [resident[i] for i in ids]
        sizes = np.array([p.numel() for p in parts], dtype=np.int64)
        self.base = dict(zip(ids, (np.cumsum(sizes) - sizes).tolist()))
        self.data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=self.device)
        self.bytes_moved = int(store.block_bytes(missing).sum()) if missing else 0
        self.staged_bytes = self.buffer_bytes = int(sizes.sum())

    def plan(self, blocks: list[int], dst_rows, layer: int, heads: range):
        """One row's layer planned for the kernel (`plan_bits_tables`: validated, tiled and uploaded once, at
        admission): ``blocks`` placed at ``dst_rows``, only ``heads``, numbered from heads.start (the caller's
        buffers hold those heads)."""
        comps, segs, first = [], [], 0
        for block, dst in zip(blocks, np.asarray(dst_rows).tolist()):
            c, s = self.codec.kernel_tables(block, layer, int(dst), base=self.base[block], first=first)
            comps.append(c)
            segs.append(s)
            first += len(c)
        components = torch.cat(comps) if comps else torch.zeros(0, 4, dtype=torch.int64)
        segments = torch.cat(segs) if segs else torch.zeros(0, 6, dtype=torch.int64)
        segments = segments[(segments[:, 4] >= heads.start) & (segments[:, 4] < heads.stop)]
        segments[:, 4] -= heads.start
        return plan_bits_tables(self.data, components, segments, self.store.layout.head_dim)

    def channel_scale(self, layer: int, heads: range) -> torch.Tensor:
        return self.codec.channel_scale(layer)[:, heads.start:heads.stop].contiguous().to(self.device)

    def rebuild(self, plan, scale, out_k, out_v, cos, sin, *, interleaved: bool, rotary_dim=None) -> None:
        launch_bits(plan, self.data, scale, out_k, out_v, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
