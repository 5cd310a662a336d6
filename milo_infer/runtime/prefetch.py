"""Stage the selected blocks' factors of each layer on the compute device, a bounded number of layers ahead.

One code path with the device as an argument. On CUDA, each layer's slices are copied from page-locked
host memory into a reusable device buffer on a side stream, and an event per layer lets the compute
stream wait for exactly that layer (FlexGen-style overlap of transfer with compute). On CPU the same
call concatenates the host views: there is nothing to transfer.

Why page-locked sources: a non-blocking copy from pageable memory is staged by the driver through its
own bounce buffer and the host blocks until the device has it, so the copy no longer overlaps anything.
The host tier is pinned at mount and the disk tiers read into pinned memory on CUDA machines
(`MiloStore`); a block that is still pageable (pinning failed) is copied into pinned memory here, once per
prefetcher, so once for each batch that reads it.

With a `DeviceTier`, blocks it holds are read from the device (a device-to-device copy into the layer's
buffer) and the others are copied, layer by layer, into device tensors of their own that join the tier
once the last layer holding any of their bytes has been handed out (so a later batch's side stream, which
waits for the compute stream, never reads a block before its copies finished). Layers after it hold no K/V
or state (Gemma 4's last layers attend earlier layers' K/V, NemotronH's last block is an MLP), and no
rebuild asks for them.

With ``reach`` (a model with sliding-window layers), each layer stages only the blocks some row's window reaches
there: the others' slices of that layer are neither copied nor concatenated, and a block no layer needs is not
read at all. A block joining the device tier is still copied whole, since a later query may place it where its
window layers reach it.

With MILO_REUSE_STAGED=1 in the environment (a test mode: the suite runs its hybrid checks under it) the CPU stages
layers as CUDA does, into ``depth + 1`` buffers that later layers' copies reuse (``_issue``), each filled with NaN
before it is written again: whatever still reads a layer handed out earlier than the current one reads what landed
there since, as on CUDA, and NaN where nothing did. Otherwise the CPU hands out a fresh concatenation of the host
views (or the one block's view), which nothing overwrites.
"""
import os
import time

import numpy as np
import torch

from .device_tier import DeviceTier
from milo_store.sources import ReadStats
from milo_store.store import MiloStore


class TransferPool:
    """A side stream and device buffers that successive prefetchers reuse (CUDA), instead of making
    their own per batch. One prefetcher at a time: a batch's copies are ordered after the compute
    stream's use of the previous batch's layers (every copy waits for the compute stream)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}

    def buffers(self, count: int, numel: int, dtype) -> list[torch.Tensor]:
        have = self._buffers.get(dtype, [])
        if len(have) < count or (have and have[0].numel() < numel):
            size = max(numel, have[0].numel() if have else 0)
            have = [torch.empty(size, dtype=dtype, device=self.device) for _ in range(max(count, len(have)))]
            self._buffers[dtype] = have
        return have[:count]


class LayerPrefetcher:
    """``layer(l)`` -> (flat factors of layer l for the selected blocks, start of each block in it), for l in
    ``layers`` (default: all), in that order. ``reach`` (default: every block at every layer): per layer, which of
    ``block_ids`` (indices into it) to stage; the others' starts are not to be read. ``read_stats``: what reading
    the blocks the device tier did not hold cost (remote bytes, GETs, seconds; cache hits). ``bytes_moved``: the
    factor bytes copied from the store's blocks toward the device; ``staged_bytes``: those the layers hand out."""

    def __init__(self, store: MiloStore, block_ids: list[int], device, depth: int = 2, tier: DeviceTier | None = None,
                 pool: TransferPool | None = None, layers: range | None = None,
                 reach: dict[int, list[int]] | None = None):
        self.store, self.block_ids, self.device = store, list(block_ids), torch.device(device)
        self.layers = layers if layers is not None else range(store.layout.num_layers)
        if tier is not None and len(self.layers) != store.layout.num_layers:
            raise ValueError("a device tier keeps whole blocks: stage every layer to fill it")
        L = store.layout.num_layers
        self.bounds = [store.block_layer_bounds(i) for i in self.block_ids]
        sizes = np.array([[b[l + 1] - b[l] for b in self.bounds] for l in range(L)], dtype=np.int64).reshape(L, -1)
        self.staged = None  # bool [L, blocks]: which blocks each layer stages (None: every one)
        wanted = self.block_ids
        if reach is not None:
            self.staged = np.zeros(sizes.shape, bool)
            for l in self.layers:
                self.staged[l, reach[l]] = True
            sizes = np.where(self.staged, sizes, 0)
            wanted = [i for i, needed in zip(self.block_ids, self.staged.any(axis=0)) if needed]
        self.tier, self._joining = tier, {}
        resident = {i: tier.get(store.block_key(i)) for i in wanted} if tier is not None else {}
        missing = [i for i in wanted if resident.get(i) is None]
        self.tier_hits = len(wanted) - len(missing) if tier is not None else 0
        self.read_stats = ReadStats()
        # views (host tier) or reads (disk tiers; remote: one batch)
        read = dict(zip(missing, store.blocks(missing, self.read_stats)))
        self.starts = np.concatenate((np.zeros((L, 1), np.int64), np.cumsum(sizes, axis=1)[:, :-1]), axis=1)
        self.layer_values = sizes.sum(axis=1)
        self.staged_bytes = int(self.layer_values[self.layers.start:self.layers.stop].sum()) * store.itemsize
        # bytes that cross from the store to the device: the blocks the device tier did not hold (whole when they
        # join it; else, with a reach, only the slices the layers stage)
        at = [self.block_ids.index(i) for i in missing]
        self.bytes_moved = (int(store.block_bytes(missing).sum()) if reach is None or tier is not None else
                            int(sizes[self.layers.start:self.layers.stop][:, at].sum()) * store.itemsize)
        self.depth = max(1, depth)
        self.cuda = self.device.type == "cuda"
        self.reuse = self.cuda or os.environ.get("MILO_REUSE_STAGED") == "1"  # staged into reused buffers
        # factor bytes staged for the rebuild at once: depth + 1 layer buffers reused, else one gathered layer (CPU)
        layers_held = self.depth + 1 if self.reuse else 1
        staged = self.layer_values[self.layers.start:self.layers.stop]
        self.buffer_bytes = layers_held * int(staged.max(initial=0)) * store.itemsize
        self._seconds, self._copies = 0.0, []  # CPU: wall time of layer(); CUDA: (start, end) events per copy
        if self.cuda:
            read = {i: b if b.is_pinned() else b.pin_memory() for i, b in read.items()}
        self._joins_at = None  # the layer whose handing out puts the joining blocks in the tier
        if tier is not None:  # missing blocks get a device tensor of their own, filled as layers are copied
            self._joining = {i: (read[i], torch.empty_like(read[i], device=self.device) if self.cuda else read[i])
                             for i in missing}
            self._at = {i: self.block_ids.index(i) for i in missing}
            self._joins_at = self.last_layer_holding(missing)
            resident.update({i: dev for i, (_, dev) in self._joining.items()})
        self.blocks = [resident[i] if i in resident else read.get(i) for i in self.block_ids]  # None: not needed
        if self.reuse:
            cap = int(staged.max(initial=0))
            if pool is not None:
                self.stream, self.buffers = pool.stream, pool.buffers(self.depth + 1, cap, store.torch_dtype)
            else:
                self.stream = torch.cuda.Stream(self.device) if self.cuda else None
                self.buffers = [torch.empty(cap, dtype=store.torch_dtype, device=self.device)
                                for _ in range(self.depth + 1)]
            for _, dev in self._joining.values() if self.cuda else ():
                dev.record_stream(self.stream)  # written on the side stream, like the buffers
            self.events = {}
            for l in self.layers[:self.depth]:
                self._issue(l)

    def _issue(self, l: int) -> None:
        buf = self.buffers[l % len(self.buffers)]
        if not self.cuda:  # the CPU's reuse mode: the same buffers, written at once
            t = time.perf_counter()
            buf.fill_(float("nan") if buf.is_floating_point() else -1)
            self._stage(l, buf)
            self.events[l] = None
            self._seconds += time.perf_counter() - t
            return
        compute = torch.cuda.current_stream(self.device)  # taken before the side stream becomes current
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            # the buffer is reused: wait until compute has finished with the layer it last held
            self.stream.wait_stream(compute)
            start.record(self.stream)
            for i, (host, dev) in self._joining.items():  # blocks joining the device tier: H2D into their own tensor
                lo, hi = self.bounds[self._at[i]][l:l + 2]
                dev[lo:hi].copy_(host[lo:hi], non_blocking=True)
            self._stage(l, buf)
            done.record(self.stream)
        # allocated on the compute stream, written on this one: if the prefetcher is dropped mid-forward,
        # the allocator must not hand the memory out again before these copies finish
        buf.record_stream(self.stream)
        self._copies.append((start, done))
        self.events[l] = done

    def _stage(self, l: int, buf: torch.Tensor) -> None:
        """Copy layer ``l``'s slice of each block it stages into ``buf`` at the block's start."""
        for j in self._chosen(l):
            block, b, start_at = self.blocks[j], self.bounds[j], self.starts[l, j]
            n = int(b[l + 1] - b[l])
            buf[start_at:start_at + n].copy_(block[b[l]:b[l + 1]], non_blocking=True)

    def layer(self, l: int) -> tuple[torch.Tensor, np.ndarray]:
        n = int(self.layer_values[l])
        if not self.reuse:
            t = time.perf_counter()
            parts = [self.blocks[j][self.bounds[j][l]:self.bounds[j][l + 1]] for j in self._chosen(l)]
            flat = (torch.cat(parts) if len(parts) != 1 else parts[0]) if parts else torch.empty(
                0, dtype=self.store.torch_dtype)
            self._seconds += time.perf_counter() - t
            out = flat.to(self.device), self.starts[l]
        else:
            if l not in self.events:
                self._issue(l)
            event = self.events.pop(l)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            if l + self.depth in self.layers:
                self._issue(l + self.depth)
            out = self.buffers[l % len(self.buffers)][:n], self.starts[l]
        if l == self._joins_at:  # every copy into the joining blocks is ordered before the compute stream now
            for i, (_, dev) in self._joining.items():
                self.tier.put(self.store.block_key(i), dev)
            self._joining = {}
        return out

    def last_layer_holding(self, blocks: list[int]) -> int:
        """The last of the staged layers holding bytes of any of ``blocks`` (the last layer else): the last one a
        rebuild asks for of them, since a layer after it keeps no K/V or state of its own (a shared layer, an MLP
        block) and is never asked for."""
        at = [self.block_ids.index(i) for i in blocks]
        held = [l for l in self.layers if any(self.bounds[j][l + 1] > self.bounds[j][l] for j in at)]
        return held[-1] if held else self.layers[-1]

    def _chosen(self, l: int):
        """The blocks (indices into ``block_ids``) layer ``l`` stages, in order."""
        return range(len(self.block_ids)) if self.staged is None else np.flatnonzero(self.staged[l]).tolist()

    def transfer_seconds(self) -> float:
        """Seconds spent moving factors so far: on CUDA the copies' own time on the side stream, so
        read it only once the device is idle (it synchronises on the last copy)."""
        if not self.cuda:
            return self._seconds
        if self._copies:
            self._copies[-1][1].synchronize()
        return sum(start.elapsed_time(done) for start, done in self._copies) / 1e3
