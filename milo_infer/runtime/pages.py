"""KV memory in pages: how many pages the budget holds, and which pages a row gets.

A page is ``PAGE_TOKENS`` consecutive columns of every layer's K/V pool (`milo_infer.runtime.cache`). The pools are
allocated once, at the budget, when a batch seats its first row, and never move: a page is handed out and taken
back, nothing is copied. A row's need is known when it is planned (its prompt tokens plus its answer budget), so it
is given every page it will ever write when it is seated and keeps them until it leaves: a running row never runs
out, and nothing is preempted. Rows that do not fit wait, oldest first.

The budget is bytes, or a share of the memory free on the device once the weights are loaded and the device cache
(``--device-cache``) is counted; by default ``DEFAULT_SHARE`` of it. A model with sliding-window layers splits it
between two page groups (`split_budget`). A pool's pages are zeroed when first handed out (``reached``): on a CPU
memory never touched is not resident, so what a process holds follows the most pages its rows reached, within the
budget; on CUDA the whole budget is held from the first row on.
"""
from __future__ import annotations

import bisect
import os

import torch

PAGE_TOKENS = 128  # columns a page; FlexAttention's KV block, so a page is one block of its block mask
DEFAULT_SHARE = {"cuda": 0.9, "cpu": 0.5}  # of the free memory: a CPU's is shared with the host tier and more


def pages_for(columns: int) -> int:
    return -(-columns // PAGE_TOKENS)


def parse_kv_memory(text: str) -> int | float:
    """``--kv-cache-memory``: bytes ('8G', '512M', '1073741824') or a share of the free memory ('0.5')."""
    from milo_store.blockcache import parse_size

    try:
        share = float(text)
    except ValueError:
        share = None
    if share is not None and 0 < share <= 1:
        return share
    if share is not None and share <= 0:
        raise ValueError(f"KV cache memory {text!r}: expected bytes (8G) or a share of free memory in (0, 1]")
    return parse_size(text)


def free_memory_bytes(device: torch.device | None = None) -> int:
    """Memory that can be had now without swapping: the CUDA device's free memory, or (no device, or a CPU)
    the host's MemAvailable, else its free pages."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_bytes(spec: int | float | None, device: torch.device, reserved: int = 0) -> int:
    """The KV budget ``spec`` names: bytes (an int), a share of the memory free now less ``reserved`` (a float in
    (0, 1]), or None for the device's default share."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ValueError(f"kv_cache_memory must be at least 1 byte, got {spec}")
        return spec
    share = DEFAULT_SHARE.get(device.type, DEFAULT_SHARE["cpu"]) if spec is None else float(spec)
    if not 0 < share <= 1:
        raise ValueError(f"kv_cache_memory as a share of free memory must be in (0, 1], got {spec}")
    return int(share * max(0, free_memory_bytes(device) - reserved))


class PageAllocator:
    """Which of a pool's ``capacity`` pages rows hold. ``take`` gives a run of consecutive pages where a free run is
    long enough (the rebuild then writes a row's prefix in place, and the per-row attention reads a view), else the
    lowest free pages; ``reached`` is one past the highest page ever handed out (the pages below it were zeroed)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: list[int] = list(range(capacity))  # sorted
        self.reached = 0

    @property
    def in_use(self) -> int:
        return self.capacity - len(self.free)

    def fits(self, n: int) -> bool:
        return self.in_use + n <= self.capacity

    def take(self, n: int) -> list[int]:
        if not self.fits(n):
            raise ValueError(f"{n} pages do not fit: {self.in_use} of {self.capacity} are in use")
        start = next((i for i in range(len(self.free) - n + 1) if self.free[i + n - 1] - self.free[i] == n - 1), None)
        taken = self.free[start:start + n] if start is not None else self.free[:n]
        self.free = self.free[:start] + self.free[start + n:] if start is not None else self.free[n:]
        if taken:
            self.reached = max(self.reached, taken[-1] + 1)
        return taken

    def give(self, pages: list[int]) -> None:
        for p in pages:
            bisect.insort(self.free, p)


FULL, WINDOW = False, True  # the page groups, keyed as `cache.PagedCache.zeroed`: whether a group's layers slide


def split_budget(page_bytes: dict, budget: int, row: dict) -> dict:
    """Each page group's pages of a budget of bytes, fixed for the pools' life (``page_bytes``: as `PageGroups`'s).
    One group takes all the budget holds; with a window group the two share it as a typical ``row`` (its pages of
    each group) takes them, so as many such rows fit in each, the window group's never fewer than the pages of the
    longest row the whole budget holds (``budget // (bytes a page of both)``: what `Engine.check_fits` admits fits
    alone). A row's window pages are never more than its full ones, so neither is the full group's. A group of no
    bytes (every layer slides, or holds none) is counted a byte a page: its pages cost nothing, and there are plenty."""
    full = max(1, page_bytes[FULL])
    if WINDOW not in page_bytes:
        return {FULL: budget // full}
    window = max(1, page_bytes[WINDOW])
    longest = budget // (full + window)
    rows = budget / max(1, row[FULL] * full + row[WINDOW] * window)
    window_pages = max(longest, int(rows * row[WINDOW]))
    return {FULL: (budget - window_pages * window) // full, WINDOW: window_pages}


class PageGroups:
    """The pages of each page group, ``capacities`` of them (`split_budget`). A group is the layers whose pools share
    page tables: the full layers, and a model's sliding-window layers, which hold pages of their own (`window_table`).
    ``page_bytes``: each group's bytes a page, K and V of its every layer (`Engine.group_page_bytes`; the window group
    only where there are window layers)."""

    def __init__(self, page_bytes: dict, capacities: dict):
        self.page_bytes = dict(page_bytes)
        self.groups = {group: PageAllocator(capacities[group]) for group in self.page_bytes}

    def __getitem__(self, group) -> PageAllocator:
        return self.groups[group]

    @property
    def windowed(self) -> bool:
        """The window layers hold pages of their own."""
        return WINDOW in self.groups

    def bytes_of(self, pages: dict) -> int:
        """Bytes of ``pages`` pages of each group (columns, when the caller divides by `PAGE_TOKENS`)."""
        return sum(n * self.page_bytes[group] for group, n in pages.items())

    def row_pages(self, pages: int, skip: int) -> dict:
        """Each group's pages a row of ``pages`` pages takes, its window layers' from page ``skip`` on."""
        return {FULL: pages, **({WINDOW: window_pages_needed(pages, skip)} if self.windowed else {})}

    def row_columns(self, columns: int, skip: int) -> dict:
        """Each group's columns a row of ``columns`` columns holds, its window layers' from page ``skip`` on (and
        their spill page's)."""
        window = columns - skip * PAGE_TOKENS + (PAGE_TOKENS if skip else 0)
        return {FULL: columns, **({WINDOW: window} if self.windowed else {})}

    def fits(self, more: dict, now: bool = True) -> bool:
        """``more`` pages of each group fit beside those in use (``now`` False: in an empty batch)."""
        return all((alloc.in_use if now else 0) + more.get(group, 0) <= alloc.capacity
                   for group, alloc in self.groups.items())

    def take(self, group, n: int) -> list[int]:
        return self.groups[group].take(n)

    def take_window(self, pages: int, skip: int) -> list[int] | None:
        """The window layers' page table of a row of ``pages`` pages (None: no window layers of their own)."""
        if not self.windowed:
            return None
        return window_table(self.take(WINDOW, window_pages_needed(pages, skip)), skip)

    def give(self, group, table: list[int] | None) -> None:
        """A page table's pages back to ``group``, each once (a table may map several columns' pages to one)."""
        if table:
            self.groups[group].give(list(dict.fromkeys(table)))

    def in_use_bytes(self) -> int:
        return self.bytes_of({group: alloc.in_use for group, alloc in self.groups.items()})

    def reached(self) -> dict:
        """Each group's pages up to the highest ever handed out (`PageAllocator.reached`)."""
        return {group: alloc.reached for group, alloc in self.groups.items()}

    def capacities(self) -> dict:
        return {group: alloc.capacity for group, alloc in self.groups.items()}


def window_skip(first_position: int, window: int) -> int:
    """Pages before the first one a window of ``window`` positions reaches from ``first_position`` (a row's first
    fed token): a window layer's columns there are never attended."""
    return max(0, first_position - window + 1) // PAGE_TOKENS


def window_pages_needed(pages: int, skip: int) -> int:
    """Pages a window layer's table takes for a row of ``pages`` pages: those from ``skip`` on, and one spill page
    for the columns before them when there are any."""
    return pages - skip + (1 if skip else 0)


def window_table(taken: list[int], skip: int) -> list[int]:
    """A window layer's page table from the pages taken for it (`window_pages_needed`): its first ``skip`` pages all
    map to the spill page (the first taken), which the rebuild may write and no token reads; the rest are its
    own."""
    return [taken[0]] * skip + taken[1:] if skip else list(taken)


def run_start(pages: list[int]) -> int | None:
    """The first page when ``pages`` are consecutive (their columns one range of the pool), else None."""
    return pages[0] if pages and pages[-1] - pages[0] == len(pages) - 1 else None
