"""Seconds per stage of one answer, each stage timed where it runs.

Host stages (retrieval, store reads) use the wall clock. Device stages record CUDA events on the
stream that runs them and are read only after the answer's final synchronisation, so asynchronous
work is timed when it executes, not when it is enqueued (a host timer around a CUDA launch measures
the enqueue). On CPU, device stages are wall time too. Work timed by someone else (the prefetcher's
copies on its side stream) joins through ``defer``, read at the same point.
"""
import contextlib
import time
from collections import defaultdict
from typing import Callable

import torch


class StageClock:
    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host = defaultdict(float)
        self._events = defaultdict(list)
        self._deferred: list[tuple[str, Callable[[], float]]] = []

    @contextlib.contextmanager
    def host(self, stage: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._host[stage] += time.perf_counter() - t

    @contextlib.contextmanager
    def device_stage(self, stage: str):
        """Time the work enqueued inside on the current stream (wall time on CPU)."""
        if not self.cuda:
            with self.host(stage):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events[stage].append((start, end))

    def defer(self, stage: str, read: Callable[[], float]) -> None:
        """Add ``read()`` seconds to ``stage`` when the clock is read (after the device is idle)."""
        self._deferred.append((stage, read))

    def read(self) -> dict[str, float]:
        """Every stage's seconds; synchronises the device first, so call it once, at the end."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out = defaultdict(float, self._host)
        for stage, pairs in self._events.items():
            out[stage] += sum(start.elapsed_time(end) for start, end in pairs) / 1e3
        for stage, read in self._deferred:
            out[stage] += read()
        return dict(out)
