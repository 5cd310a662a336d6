"""Where a mounted store's factor bytes come from: the ``ByteSource`` contract and its implementations.

A source fills caller-owned buffers with whole blocks, given as byte ranges of the logical factor array
(every block's bytes back to back, in block order, wherever the chunks hold them).
The origins hold the store's own bytes: ``ChunkFiles`` (local chunk files, ``preadv``) and
``ObjectChunks`` (chunk objects of one pinned store version, range GETs). Caches sit in front of a
source and are sources themselves: ``BlockCacheSource`` (this machine's directory of fetched blocks,
``blockcache.py``) and ``MemoryLRU`` (whole blocks in memory, the ``cached`` tier, in a `MemoryCache` that
mounts may share). ``MiloStore`` composes a tier from them once, at mount.

Chunks are plain uncompressed bytes, so a block is a byte range of one chunk (format 4) or of at most a
few (format ≤ 3's equal chunks), found from the index and the placement alone (``chunks.py``; no zarr on
the hot path). Every source is safe for concurrent callers; what one call cost goes into the
``ReadStats`` it is given.
"""
import mmap
import os
import resource
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import obstore

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

    placement: object  # where each block lies (chunks.py): EqualChunks or Extents

    def read_range(self, start: int, out: memoryview) -> None:
        """Bytes [start, start + len(out)) of the flat factor array, unchecked: the raw read path."""

    def disk_bytes(self) -> tuple[int, int]:
        """(bytes of every file or object of the store, bytes of its factor chunks)."""


def checked(crc: int, out: memoryview) -> bool:
    return crc32c(np.frombuffer(out, dtype=np.uint8)) == crc


class ChunkFiles:
    """The local chunk files of a placement (``chunks.py``), read with preadv.

    Every file is opened at mount and held open, so the mount keeps reading its own version after an
    update replaced the directory (the new version's files are other names, or hard links of these).
    """

    def __init__(self, root: Path, placement, checksums: np.ndarray):
        self.root, self.placement, self.checksums, self.fds = root, placement, checksums, []
        try:
            make_room_for_files(len(placement.names), root)
            for name, want in zip(placement.names, placement.sizes):
                p = root / name
                if not p.is_file():
                    raise StoreCorruptedError(f"{root}: factor chunk {name} is missing")
                if (size := p.stat().st_size) != want:
                    raise StoreCorruptedError(f"{root}: factor chunk {name} is {size} bytes, expected {want} (truncated?)")
                self.fds.append(os.open(p, os.O_RDONLY))
        except BaseException:
            self.close()
            raise

    def read_range(self, start: int, out: memoryview) -> None:
        for c, a, b, at in self.placement.pieces(start, start + len(out)):
            if os.preadv(self.fds[c], [out[at:at + b - a]], a) != b - a:
                raise StoreCorruptedError(f"{self.root}: short read in factor chunk {self.placement.names[c]}")

    def read_blocks(self, blocks, starts, outs, check, stats) -> None:
        for b, start, out in zip(blocks, starts, outs):
            self.read_range(start, out)
            if check and not checked(int(self.checksums[b]), out):
                raise StoreCorruptedError(f"{self.root}: block {b} fails its checksum (corrupted factor bytes)")

    def chunk_data(self, c: int) -> np.ndarray:
        """Chunk ``c`` whole, mapped read-only from the file this mount holds open (a text segment)."""
        if not self.placement.sizes[c]:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(mmap.mmap(self.fds[c], 0, access=mmap.ACCESS_READ), dtype=np.uint8)

    def disk_bytes(self) -> tuple[int, int]:
        total = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        return total, self.placement.factor_chunk_bytes()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def make_room_for_files(count: int, where) -> None:
    """Raise this process's soft limit of open files up to its hard limit when a mount needs ``count`` more
    than it leaves (a store of many chunks); refuse, naming the limit, where even the hard one is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    need = in_use + count + 64
    if need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise StoreError(f"{where}: mounting holds its {count} chunk files open, beyond this process's limit of "
                         f"{hard} open files (ulimit -n)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


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

    def __init__(self, url: str, store, root: str, placement, checksums: np.ndarray, concurrency: int = 8):
        """``root``: the version's prefix (its own objects); the placement names the chunk objects' keys."""
        self.url, self.store, self.root, self.placement, self.checksums = url, store, root, placement, checksums
        self.pool = ThreadPoolExecutor(concurrency)
        sizes = {}
        for prefix in sorted({n.rsplit("/", 1)[0] + "/" for n in placement.names}):
            sizes.update({o["path"]: o["size"] for batch in obstore.list(store, prefix=prefix) for o in batch})
        for key, want in zip(placement.names, placement.sizes):
            size = sizes.get(key)
            if size is None:
                raise StoreCorruptedError(f"{url}: factor chunk object {key} is missing")
            if size != want:
                raise StoreCorruptedError(f"{url}: factor chunk object {key} is {size} bytes, expected {want} (truncated?)")

    def key(self, c: int) -> str:
        """The object key of chunk ``c``."""
        return self.placement.names[c]

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

    def chunk_data(self, c: int) -> np.ndarray:
        """Chunk ``c`` whole, in memory (a text segment: read at mount, never cached on disk)."""
        for attempt in range(FETCH_ATTEMPTS):
            try:
                data = obstore.get(self.store, self.key(c)).bytes()
                if len(data) == self.placement.sizes[c]:
                    return np.frombuffer(data, dtype=np.uint8)
                problem = f"{len(data)} bytes came, {self.placement.sizes[c]} expected"
            except FileNotFoundError as e:
                raise self._gone(c, e, "") from None
            except Exception as e:  # network errors obstore already retried, or a body cut off
                problem = one_line(e)
        raise StoreError(f"{self.url}: cannot read chunk object {self.key(c)} after {FETCH_ATTEMPTS} attempts: {problem}")

    def _fetch(self, items: list[tuple], stats: ReadStats) -> list[tuple]:
        """Range GETs for these (block, start, out), each block checked once whole; the items that fail."""
        per_chunk: dict[int, list] = {}
        pending = []  # per item: its pieces not yet arrived
        for j, (_, start, out) in enumerate(items):
            pieces = list(self.placement.pieces(start, start + len(out)))
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

    def _gone(self, c: int, e: BaseException, what: str) -> StoreError:
        """A chunk object is missing: say so, and whether gc removed the version this mount pinned."""
        try:
            kept = obstore.head(self.store, f"{self.root}/zarr.json") is not None
        except FileNotFoundError:
            kept = False
        except Exception:  # cannot tell: name the chunk alone
            kept = True
        if not kept:
            return StoreError(f"{self.url}: version {self.root.rsplit('/', 1)[-1]}, which this mount pinned, was removed "
                              "(milo-store gc after a replace); open the store again")
        return StoreError(f"{self.url}: chunk object {self.key(c)}{what} is gone: {one_line(e)}")

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
                raise self._gone(c, e, f" (blocks {blocks})") from None
            except Exception as e:  # network errors obstore already retried, or a body cut off
                problem = one_line(e)
            if attempt == FETCH_ATTEMPTS - 1:
                raise StoreError(f"{self.url}: cannot read blocks {blocks} (factor chunk object {self.key(c)}) after "
                                 f"{FETCH_ATTEMPTS} attempts: {problem}")
        for (_, _, out, j), buf in zip(pieces, bufs):
            # buf: a zero-copy slice of the body of obstore's merged GET, copied once into place, by numpy
            # so the copy releases the GIL and overlaps the other chunk objects' GETs and checks
            np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(buf, np.uint8))
            arrived(j)
        fetched = requests(list(zip(starts, ends)), COALESCE_GAP)
        return sum(z - a for a, z in fetched), len(fetched)

    def disk_bytes(self) -> tuple[int, int]:
        own = {o["path"]: o["size"] for batch in obstore.list(self.store, prefix=self.root + "/") for o in batch}
        shared = {k: s for k, s in zip(self.placement.names, self.placement.sizes) if k not in own}
        return sum(own.values()) + sum(shared.values()), self.placement.factor_chunk_bytes()

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class BlockCacheSource:
    """A source behind this machine's block cache: sound cached copies are used, the rest read from
    ``inner`` (always checked, so the cache only ever holds checked bytes) and cached. Entries are named
    by the placement (``entry_name``): a format-4 block by its chunk and offset, so every version that
    keeps the block finds it."""

    def __init__(self, inner: ByteSource, cache: BlockCache, cache_key: str, placement, checksums: np.ndarray):
        self.inner, self.cache, self.cache_key, self.placement, self.checksums = inner, cache, cache_key, placement, checksums

    def read_blocks(self, blocks, starts, outs, check, stats) -> None:
        todo = [(b, s, o) for b, s, o in zip(blocks, starts, outs)
                if not self.cache.read_into(self.cache_key, self.placement.entry_name(b), int(self.checksums[b]), o)]
        stats.block_cache_hits += len(blocks) - len(todo)
        stats.block_cache_misses += len(todo)
        if not todo:
            return
        self.inner.read_blocks(*map(list, zip(*todo)), True, stats)
        for b, _, o in todo:
            self.cache.put(self.cache_key, self.placement.entry_name(b), int(self.checksums[b]), o)
        self.cache.evict()

    def close(self) -> None:
        self.inner.close()


class MemoryCache:
    """Whole blocks in memory, bounded in bytes, least recently used out first: the ``cached`` tier's store.
    Keyed by a block's identity (``chunks.py``), so mounts of several versions of a store (a server across a
    hot swap) can share one and a kept block stays in it. One lock guards the entries and their byte count."""

    def __init__(self, limit_bytes: int):
        if limit_bytes < 0:
            raise ValueError(f"memory_cache_bytes must be at least 0; got {limit_bytes}")
        self.limit = limit_bytes
        self.entries: OrderedDict[tuple, bytes] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, key: tuple) -> bytes | None:
        with self.lock:
            kept = self.entries.get(key)
            if kept is not None:
                self.entries.move_to_end(key)
            return kept

    def keep(self, key: tuple, data: bytes) -> None:
        if len(data) > self.limit:
            return
        with self.lock:
            if key in self.entries:  # another caller kept it meanwhile
                return
            self.entries[key] = data
            self.bytes += len(data)
            while self.bytes > self.limit:
                _, old = self.entries.popitem(last=False)
                self.bytes -= len(old)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.bytes = 0


class MemoryLRU:
    """A source behind a `MemoryCache` (the ``cached`` tier). Blocks read from ``inner`` are copied in; a hit
    is copied out, so no caller can change what others read. ``owned``: the cache is this mount's alone,
    emptied when it closes (a shared one outlives it)."""

    def __init__(self, inner: ByteSource, cache: MemoryCache, placement, owned: bool = False):
        self.inner, self.cache, self.placement, self.owned = inner, cache, placement, owned

    def read_blocks(self, blocks, starts, outs, check, stats) -> None:
        misses, hits = [], 0
        for b, s, o in zip(blocks, starts, outs):
            if (kept := self.cache.get(self.placement.identity(b))) is None:
                misses.append((b, s, o))
            else:  # entries are immutable: copied out without holding the lock
                o[:] = kept
                hits += 1
        stats.memory_hits += hits
        if not misses:
            return
        self.inner.read_blocks(*map(list, zip(*misses)), check, stats)
        for b, _, o in misses:
            self.cache.keep(self.placement.identity(b), bytes(o))

    def close(self) -> None:
        if self.owned:
            self.cache.clear()
        self.inner.close()


def one_line(e: BaseException) -> str:
    """An obstore error's first line (its messages carry a multi-line debug dump after it)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
