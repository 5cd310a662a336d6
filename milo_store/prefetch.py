"""Stage the selected blocks' factors of each layer on the compute device, a bounded number of layers ahead.

One code path with the device as an argument. On CUDA, each layer's slices are copied from page-locked
host memory into a reusable device buffer on a side stream, and an event per layer lets the compute
stream wait for exactly that layer (FlexGen-style overlap of transfer with compute). On CPU the same
call concatenates the host views: there is nothing to transfer.

Why page-locked sources: a non-blocking copy from pageable memory is staged by the driver through its
own bounce buffer and the host blocks until the device has it, so the copy no longer overlaps anything.
The host tier is pinned at mount and the disk tiers read into pinned memory on CUDA machines
(`MiloStore`); a block that is still pageable (pinning failed) is copied into pinned memory here, once per
prefetcher, so once for each query (or batch) that reads it.
"""
import time

import numpy as np
import torch

from .store import MiloStore


class LayerPrefetcher:
    """``layer(l)`` -> (flat factors of layer l for the selected blocks, start of each block in it)."""

    def __init__(self, store: MiloStore, block_ids: list[int], device, depth: int = 2):
        self.store, self.block_ids, self.device = store, list(block_ids), torch.device(device)
        self.blocks = store.blocks(self.block_ids)  # views (host tier) or reads (disk tiers; remote: one batch)
        self.bounds = [store.block_layer_bounds(i) for i in self.block_ids]
        L = store.layout.num_layers
        sizes = np.array([[b[l + 1] - b[l] for b in self.bounds] for l in range(L)], dtype=np.int64).reshape(L, -1)
        self.starts = np.concatenate((np.zeros((L, 1), np.int64), np.cumsum(sizes, axis=1)[:, :-1]), axis=1)
        self.layer_values = sizes.sum(axis=1)
        self.depth = max(1, depth)
        self.cuda = self.device.type == "cuda"
        self._seconds, self._copies = 0.0, []  # CPU: wall time of layer(); CUDA: (start, end) events per copy
        if self.cuda:
            self.blocks = [b if b.is_pinned() else b.pin_memory() for b in self.blocks]
            self.stream = torch.cuda.Stream(self.device)
            cap = int(self.layer_values.max(initial=0))
            self.buffers = [torch.empty(cap, dtype=store.torch_dtype, device=self.device) for _ in range(self.depth + 1)]
            self.events = {}
            for l in range(min(self.depth, L)):
                self._issue(l)

    def _issue(self, l: int) -> None:
        buf = self.buffers[l % len(self.buffers)]
        compute = torch.cuda.current_stream(self.device)  # taken before the side stream becomes current
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            # the buffer is reused: wait until compute has finished with the layer it last held
            self.stream.wait_stream(compute)
            start.record(self.stream)
            for block, b, start_at in zip(self.blocks, self.bounds, self.starts[l]):
                n = int(b[l + 1] - b[l])
                buf[start_at:start_at + n].copy_(block[b[l]:b[l + 1]], non_blocking=True)
            done.record(self.stream)
        # allocated on the compute stream, written on this one: if the prefetcher is dropped mid-forward,
        # the allocator must not hand the memory out again before these copies finish
        buf.record_stream(self.stream)
        self._copies.append((start, done))
        self.events[l] = done

    def layer(self, l: int) -> tuple[torch.Tensor, np.ndarray]:
        n = int(self.layer_values[l])
        if not self.cuda:
            t = time.perf_counter()
            parts = [blk[b[l]:b[l + 1]] for blk, b in zip(self.blocks, self.bounds)]
            flat = torch.cat(parts) if len(parts) != 1 else parts[0]
            self._seconds += time.perf_counter() - t
            return flat.to(self.device), self.starts[l]
        if l not in self.events:
            self._issue(l)
        torch.cuda.current_stream(self.device).wait_event(self.events.pop(l))
        if l + self.depth < len(self.layer_values):
            self._issue(l + self.depth)
        return self.buffers[l % len(self.buffers)][:n], self.starts[l]

    def transfer_seconds(self) -> float:
        """Seconds spent moving factors so far: on CUDA the copies' own time on the side stream, so
        read it only once the device is idle (it synchronises on the last copy)."""
        if not self.cuda:
            return self._seconds
        if self._copies:
            self._copies[-1][1].synchronize()
        return sum(start.elapsed_time(done) for start, done in self._copies) / 1e3
