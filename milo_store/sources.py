"""Where a mounted store's factor bytes come from: local chunk files, or chunk objects in an object store.

Both read whole blocks, given as byte ranges of the flat factor array, into caller-owned buffers;
``MiloStore`` composes with either and checks each block's CRC32C itself. The factor array is
uncompressed with zarr's default chunk key encoding, so a range is plain bytes of at most a few
chunk files (``factors/c/<i>``), and offsets come from the index alone (no zarr on the hot path).
"""
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import obstore

from . import format as fmt
from .blockcache import BlockCache
from .checksum import crc32c
from .errors import StoreCorruptedError, StoreError

FETCH_ATTEMPTS = 3  # our fetches of a range whose body came back short, broken or failing its checksum
# (obstore itself retries requests that fail with 5xx, timeouts and resets)


def chunk_pieces(start: int, stop: int, chunk_bytes: int):
    """(chunk, start within chunk, stop within chunk, offset in the range) covering bytes [start, stop)."""
    pos = start
    while pos < stop:
        c, within = divmod(pos, chunk_bytes)
        n = min(stop - pos, chunk_bytes - within)
        yield c, within, within + n, pos - start
        pos += n


class ChunkFiles:
    """The local chunk files, read with preadv."""

    def __init__(self, root: Path, chunk_bytes: int, num_chunks: int):
        self.root, self.chunk_bytes, self.fds = root, chunk_bytes, []
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
        """Bytes [start, start + len(out)) of the flat factor array, unchecked."""
        for c, a, b, at in chunk_pieces(start, start + len(out), self.chunk_bytes):
            if os.preadv(self.fds[c], [out[at:at + b - a]], a) != b - a:
                raise StoreCorruptedError(f"{self.root}: short read in factor chunk {c}")

    def read_blocks(self, blocks: list[int], starts: list[int], outs: list[memoryview], use_cache: bool = True) -> None:
        for start, out in zip(starts, outs):
            self.read_range(start, out)

    def disk_bytes(self) -> tuple[int, int]:
        """(bytes of every file of the store, bytes of the factor chunk files)."""
        total = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        return total, sum(f.stat().st_size for f in (self.root / fmt.FACTORS).rglob("*") if f.is_file())

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class ObjectChunks:
    """Chunk objects of one pinned store version, read with merged, concurrent range GETs.

    Blocks found sound in the local ``BlockCache`` are not fetched; fetched blocks are checked
    against their CRC32C (a failing one is fetched again, then refused) before they are used or
    cached. ``stats`` counts what went over the network: bytes, GETs and seconds.
    """

    def __init__(self, url: str, store, root: str, chunk_bytes: int, num_chunks: int, checksums: np.ndarray,
                 cache: BlockCache | None, cache_key: str, concurrency: int = 8):
        self.url, self.store, self.root, self.chunk_bytes = url, store, root, chunk_bytes
        self.checksums, self.cache, self.cache_key = checksums, cache, cache_key
        self.pool = ThreadPoolExecutor(concurrency)
        self.stats = {"bytes": 0, "gets": 0, "seconds": 0.0}
        prefix = f"{root}/{fmt.FACTORS}/c/"
        sizes = {o["path"]: o["size"] for batch in obstore.list(store, prefix=prefix) for o in batch}
        for c in range(num_chunks):
            size = sizes.get(prefix + str(c))
            if size is None:
                raise StoreCorruptedError(f"{url}: factor chunk object {c} is missing")
            if size != chunk_bytes:
                raise StoreCorruptedError(f"{url}: factor chunk object {c} is {size} bytes, expected {chunk_bytes} (truncated?)")

    def _key(self, c: int) -> str:
        return f"{self.root}/{fmt.FACTORS}/c/{c}"

    def read_blocks(self, blocks: list[int], starts: list[int], outs: list[memoryview], use_cache: bool = True) -> None:
        cache = self.cache if use_cache else None
        todo = [(b, s, o) for b, s, o in zip(blocks, starts, outs)
                if cache is None or not cache.read_into(self.cache_key, b, int(self.checksums[b]), o)]
        if not todo:
            return
        self._fetch(todo)
        for b, s, o in todo:
            for attempt in range(FETCH_ATTEMPTS):
                if crc32c(np.frombuffer(o, dtype=np.uint8)) == int(self.checksums[b]):
                    break
                if attempt == FETCH_ATTEMPTS - 1:
                    raise StoreCorruptedError(f"{self.url}: block {b} fails its checksum after {FETCH_ATTEMPTS} fetches "
                                              "(a corrupted object, or a link that keeps damaging it)")
                self._fetch([(b, s, o)])  # damaged in flight, maybe: again, alone
            if cache is not None:
                cache.put(self.cache_key, b, int(self.checksums[b]), o)
        if cache is not None:
            cache.evict()

    def read_range(self, start: int, out: memoryview) -> None:
        """Bytes [start, start + len(out)) of the flat factor array: range GETs only, no cache, unchecked."""
        self._fetch([(None, start, out)])

    def _fetch(self, items) -> None:
        """Range GETs for these (block, start, out): per chunk object, adjacent ranges merged, objects in parallel."""
        per_chunk: dict[int, list] = {}
        for b, start, out in items:
            for c, a, z, at in chunk_pieces(start, start + len(out), self.chunk_bytes):
                per_chunk.setdefault(c, []).append((a, z, out[at:at + z - a], b))
        t0 = time.perf_counter()
        for n_bytes, n_gets in self.pool.map(lambda kv: self._fetch_chunk(*kv), per_chunk.items()):
            self.stats["bytes"] += n_bytes
            self.stats["gets"] += n_gets
        self.stats["seconds"] += time.perf_counter() - t0

    def _fetch_chunk(self, c: int, pieces: list) -> tuple[int, int]:
        pieces.sort(key=lambda p: p[0])
        merged = []  # [start, stop, [pieces]]
        for p in pieces:
            if merged and merged[-1][1] == p[0]:
                merged[-1][1] = p[1]
                merged[-1][2].append(p)
            else:
                merged.append([p[0], p[1], [p]])
        starts, ends = [m[0] for m in merged], [m[1] for m in merged]
        blocks = sorted({p[3] for p in pieces if p[3] is not None})
        for attempt in range(FETCH_ATTEMPTS):
            try:
                bufs = obstore.get_ranges(self.store, self._key(c), starts=starts, ends=ends, coalesce=0)
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
        for (s, _, members), buf in zip(merged, bufs):
            view = memoryview(buf)
            for a, z, out, _ in members:
                out[:] = view[a - s:z - s]
        return sum(e - s for s, e in zip(starts, ends)), len(merged)

    def disk_bytes(self) -> tuple[int, int]:
        sizes = [(o["path"], o["size"]) for batch in obstore.list(self.store, prefix=self.root + "/") for o in batch]
        factors = f"{self.root}/{fmt.FACTORS}/"
        return sum(s for _, s in sizes), sum(s for p, s in sizes if p.startswith(factors))

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def one_line(e: BaseException) -> str:
    """An obstore error's first line (its messages carry a multi-line debug dump after it)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
