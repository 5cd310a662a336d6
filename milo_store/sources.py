"""Where a mounted store's factor bytes come from: the ``ByteSource`` contract and its implementations.

A source fills caller-owned buffers with whole blocks, given as byte ranges of the flat factor array.
The origins hold the store's own bytes: ``ChunkFiles`` (local chunk files, ``preadv``) and
``ObjectChunks`` (chunk objects of one pinned store version, range GETs). Caches sit in front of a
source and are sources themselves: ``BlockCacheSource`` (this machine's directory of fetched blocks,
``blockcache.py``) and ``MemoryLRU`` (whole blocks in memory, the ``cached`` tier). ``MiloStore``
composes a tier from them once, at mount.

The factor array is uncompressed with zarr's default chunk key encoding, so a range is plain bytes of
at most a few chunk files (``factors/c/<i>``), and offsets come from the index alone (no zarr on the
hot path). Every source is safe for concurrent callers; what one call cost goes into the
``ReadStats`` it is given.
"""
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import obstore

from . import format as fmt
from .blockcache import BlockCache
from .checksum import crc32c
from .errors import StoreCorruptedError, StoreError

FETCH_ATTEMPTS = 3  # our fetches of a range whose body came back short, broken or failing its checksum
# (obstore itself retries requests that fail with 5xx, timeouts and resets)
COALESCE_GAP = 0  # obstore merges ranges at most this many bytes apart into one GET: 0 merges touching
# ranges only, so no byte outside the asked blocks crosses the link (docs/benchmarks.md measured wider gaps)


@dataclass
class ReadStats:
    """What reads cost: network bytes, GETs and seconds (a store URL's origin), and blocks found in this
    machine's block cache or the cached tier's memory. One ``MiloStore.blocks`` call fills its own, so
    overlapping callers never see each other's costs."""
    remote_bytes: int = 0
    remote_gets: int = 0
    remote_seconds: float = 0.0
    block_cache_hits: int = 0
    block_cache_misses: int = 0
    memory_hits: int = 0

    def add(self, other: "ReadStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@runtime_checkable
class ByteSource(Protocol):
    """What ``MiloStore`` reads factor bytes through.

    ``read_blocks`` fills ``outs[j]`` with block ``blocks[j]``'s bytes, which start at byte ``starts[j]``
    of the flat factor array. With ``check`` each block's CRC32C is checked and a failing one raises
    ``StoreCorruptedError`` (a source may always check, when it needs to, to refetch damage); a failed
    read raises a ``StoreError`` naming the store. Costs are added to ``stats``.
    """

    def read_blocks(self, blocks: list[int], starts: list[int], outs: list[memoryview], check: bool,
                    stats: ReadStats) -> None: ...

    def close(self) -> None: ...


class Origin(ByteSource, Protocol):
    """A source holding the store's own bytes (not a cache): also raw ranges and its size on disk."""

    chunk_bytes: int

    def read_range(self, start: int, out: memoryview) -> None:
        """Bytes [start, start + len(out)) of the flat factor array, unchecked: the raw read path."""

    def disk_bytes(self) -> tuple[int, int]:
        """(bytes of every file or object of the store, bytes of its factor chunks)."""


def chunk_pieces(start: int, stop: int, chunk_bytes: int):
    """(chunk, start within chunk, stop within chunk, offset in the range) covering bytes [start, stop)."""
    pos = start
    while pos < stop:
        c, within = divmod(pos, chunk_bytes)
        n = min(stop - pos, chunk_bytes - within)
        yield c, within, within + n, pos - start
        pos += n


def checked(crc: int, out: memoryview) -> bool:
    return crc32c(np.frombuffer(out, dtype=np.uint8)) == crc


class ChunkFiles:
    """The local chunk files, read with preadv."""

    def __init__(self, root: Path, chunk_bytes: int, num_chunks: int, checksums: np.ndarray):
        self.root, self.chunk_bytes, self.checksums, self.fds = root, chunk_bytes, checksums, []
        try:
            for c in range(num_chunks):
                p = fmt.factor_chunk_path(root, c)
                if not p.is_file():
                    raise StoreCorruptedError(f"{root}: factor chunk {p.name} is missing")
                if (size := p.stat().st_size) != chunk_bytes:
                    raise StoreCorruptedError(f"{root}: factor chunk {p.name} is {size} bytes, expected {chunk_bytes} (truncated?)")
                self.fds.append(os.open(p, os.O_RDONLY))
        except BaseException:
            self.close()
            raise

    def read_range(self, start: int, out: memoryview) -> None:
        for c, a, b, at in chunk_pieces(start, start + len(out), self.chunk_bytes):
            if os.preadv(self.fds[c], [out[at:at + b - a]], a) != b - a:
                raise StoreCorruptedError(f"{self.root}: short read in factor chunk {c}")

    def read_blocks(self, blocks, starts, outs, check, stats) -> None:
        for b, start, out in zip(blocks, starts, outs):
            self.read_range(start, out)
            if check and not checked(int(self.checksums[b]), out):
                raise StoreCorruptedError(f"{self.root}: block {b} fails its checksum (corrupted factor bytes)")

    def disk_bytes(self) -> tuple[int, int]:
        total = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        return total, sum(f.stat().st_size for f in (self.root / fmt.FACTORS).rglob("*") if f.is_file())

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def requests(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """The GETs obstore's ``get_ranges`` makes for these ranges: sorted, those at most ``gap`` bytes
    apart merged (how we count the bytes and GETs a fetch cost)."""
    out: list[list[int]] = []
    for a, z in sorted(ranges):
        if out and a - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], z)
        else:
            out.append([a, z])
    return [(a, z) for a, z in out]


class ObjectChunks:
    """Chunk objects of one pinned store version, read with obstore's merged range GETs, chunk objects
    in parallel.

    Every fetched block is checked against its CRC32C as soon as its last piece has arrived (while other
    GETs are still in flight); a failing one is fetched again, alone, then refused: wrong bytes are
    never returned, whatever ``check`` says.
    """

    def __init__(self, url: str, store, root: str, chunk_bytes: int, num_chunks: int, checksums: np.ndarray,
                 concurrency: int = 8):
        self.url, self.store, self.root, self.chunk_bytes, self.checksums = url, store, root, chunk_bytes, checksums
        self.pool = ThreadPoolExecutor(concurrency)
        prefix = f"{root}/{fmt.FACTORS}/c/"
        sizes = {o["path"]: o["size"] for batch in obstore.list(store, prefix=prefix) for o in batch}
        for c in range(num_chunks):
            size = sizes.get(prefix + str(c))
            if size is None:
                raise StoreCorruptedError(f"{url}: factor chunk object {c} is missing")
            if size != chunk_bytes:
                raise StoreCorruptedError(f"{url}: factor chunk object {c} is {size} bytes, expected {chunk_bytes} (truncated?)")

    def key(self, c: int) -> str:
        """The object key of factor chunk ``c``."""
        return f"{self.root}/{fmt.FACTORS}/c/{c}"

    def read_blocks(self, blocks, starts, outs, check, stats) -> None:
        bad = self._fetch(list(zip(blocks, starts, outs)), stats)
        for b, s, o in bad:
            for _ in range(FETCH_ATTEMPTS - 1):  # damaged in flight, maybe: again, alone
                if not self._fetch([(b, s, o)], stats):
                    break
            else:
                raise StoreCorruptedError(f"{self.url}: block {b} fails its checksum after {FETCH_ATTEMPTS} fetches "
                                          "(a corrupted object, or a link that keeps damaging it)")

    def read_range(self, start: int, out: memoryview) -> None:
        self._fetch([(None, start, out)], ReadStats())

    def _fetch(self, items: list[tuple], stats: ReadStats) -> list[tuple]:
        """Range GETs for these (block, start, out), each block checked once whole; the items that fail."""
        per_chunk: dict[int, list] = {}
        pending = []  # per item: its pieces not yet arrived
        for j, (_, start, out) in enumerate(items):
            pieces = list(chunk_pieces(start, start + len(out), self.chunk_bytes))
            for c, a, z, at in pieces:
                per_chunk.setdefault(c, []).append((a, z, out[at:at + z - a], j))
            pending.append(len(pieces))
        lock = threading.Lock()
        bad = [items[j] for j, n in enumerate(pending) if not n and not self._sound(items[j])]

        def arrived(j: int) -> None:
            with lock:
                pending[j] -= 1
                last = pending[j] == 0
            if last and not self._sound(items[j]):
                with lock:
                    bad.append(items[j])

        t0 = time.perf_counter()
        try:
            for n_bytes, n_gets in self.pool.map(lambda kv: self._fetch_chunk(*kv, items, arrived), per_chunk.items()):
                stats.remote_bytes += n_bytes
                stats.remote_gets += n_gets
        finally:
            stats.remote_seconds += time.perf_counter() - t0
        return bad

    def _sound(self, item: tuple) -> bool:
        b, _, out = item
        return b is None or checked(int(self.checksums[b]), out)

    def _fetch_chunk(self, c: int, pieces: list, items: list[tuple], arrived) -> tuple[int, int]:
        """One chunk object's pieces, as obstore's merged GETs; (bytes, GETs) fetched."""
        starts, ends = [p[0] for p in pieces], [p[1] for p in pieces]
        blocks = sorted({items[p[3]][0] for p in pieces if items[p[3]][0] is not None})
        for attempt in range(FETCH_ATTEMPTS):
            try:
                bufs = obstore.get_ranges(self.store, self.key(c), starts=starts, ends=ends, coalesce=COALESCE_GAP)
                if all(len(buf) == e - s for buf, s, e in zip(bufs, starts, ends)):
                    break
                problem = "a range came back short"
            except FileNotFoundError as e:
                raise StoreError(f"{self.url}: factor chunk object {c} (blocks {blocks}) is gone: {one_line(e)}") from None
            except Exception as e:  # network errors obstore already retried, or a body cut off
                problem = one_line(e)
            if attempt == FETCH_ATTEMPTS - 1:
                raise StoreError(f"{self.url}: cannot read blocks {blocks} (factor chunk object {c}) after "
                                 f"{FETCH_ATTEMPTS} attempts: {problem}")
        for (_, _, out, j), buf in zip(pieces, bufs):
            # buf: a zero-copy slice of the body of obstore's merged GET, copied once into place, by numpy
            # so the copy releases the GIL and overlaps the other chunk objects' GETs and checks
            np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(buf, np.uint8))
            arrived(j)
        fetched = requests(list(zip(starts, ends)), COALESCE_GAP)
        return sum(z - a for a, z in fetched), len(fetched)

    def disk_bytes(self) -> tuple[int, int]:
        sizes = [(o["path"], o["size"]) for batch in obstore.list(self.store, prefix=self.root + "/") for o in batch]
        factors = f"{self.root}/{fmt.FACTORS}/"
        return sum(s for _, s in sizes), sum(s for p, s in sizes if p.startswith(factors))

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class BlockCacheSource:
    """A source behind this machine's block cache: sound cached copies are used, the rest read from
    ``inner`` (always checked, so the cache only ever holds checked bytes) and cached."""

    def __init__(self, inner: ByteSource, cache: BlockCache, cache_key: str, checksums: np.ndarray):
        self.inner, self.cache, self.cache_key, self.checksums = inner, cache, cache_key, checksums

    def read_blocks(self, blocks, starts, outs, check, stats) -> None:
        todo = [(b, s, o) for b, s, o in zip(blocks, starts, outs)
                if not self.cache.read_into(self.cache_key, b, int(self.checksums[b]), o)]
        stats.block_cache_hits += len(blocks) - len(todo)
        stats.block_cache_misses += len(todo)
        if not todo:
            return
        self.inner.read_blocks(*map(list, zip(*todo)), True, stats)
        for b, _, o in todo:
            self.cache.put(self.cache_key, b, int(self.checksums[b]), o)
        self.cache.evict()

    def close(self) -> None:
        self.inner.close()


class MemoryLRU:
    """A source behind an in-memory LRU of whole blocks bounded in bytes (the ``cached`` tier). Blocks
    read from ``inner`` are copied in; a hit is copied out, so no caller can change what others read.
    One lock guards the entries and their byte count."""

    def __init__(self, inner: ByteSource, limit_bytes: int):
        self.inner, self.limit = inner, limit_bytes
        self.entries: OrderedDict[int, bytes] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def read_blocks(self, blocks, starts, outs, check, stats) -> None:
        misses, hits = [], []
        with self.lock:
            for b, s, o in zip(blocks, starts, outs):
                if (kept := self.entries.get(b)) is None:
                    misses.append((b, s, o))
                else:
                    self.entries.move_to_end(b)
                    hits.append((o, kept))
        for o, kept in hits:  # entries are immutable: copied out without holding the lock
            o[:] = kept
        stats.memory_hits += len(hits)
        if not misses:
            return
        self.inner.read_blocks(*map(list, zip(*misses)), check, stats)
        for b, _, o in misses:
            if len(o) <= self.limit:
                self._keep(b, bytes(o))

    def _keep(self, block: int, data: bytes) -> None:
        with self.lock:
            if block in self.entries:  # another caller kept it meanwhile
                return
            self.entries[block] = data
            self.bytes += len(data)
            while self.bytes > self.limit:
                _, old = self.entries.popitem(last=False)
                self.bytes -= len(old)

    def close(self) -> None:
        with self.lock:
            self.entries.clear()
            self.bytes = 0
        self.inner.close()


def one_line(e: BaseException) -> str:
    """An obstore error's first line (its messages carry a multi-line debug dump after it)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
