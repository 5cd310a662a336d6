"""A per-machine directory of whole blocks fetched from object stores, shared by every process on it.

Files are ``<dir>/<store key>/<entry>.<crc32c hex>``: for a format-4 store the key names the store URL
and the entry a block's chunk and offset (``<chunk id>-<offset>``), which every version keeping the block
shares; for older stores the key names the URL and its pinned version, the entry the block's index.
Chunks and versions are immutable, so an entry never goes stale, and the name carries the block's
checksum, so every file can be checked on its own. A marker file ``<dir>/.milo-block-cache``
says the directory is a cache (``clear`` removes entries only where it finds one, and only files
named like entries) and records the byte limit it was last filled under. Safety with several processes:

- a fill writes a temporary file in the same directory and ``os.replace``s it into place, so a
  reader sees no file or a whole one, never a torn one;
- a read opens the file and reads all of it, then checks its length and CRC32C; a file that fails
  (truncated, corrupted) is unlinked and reported as a miss, so the caller refetches it;
- eviction unlinks the least recently used files (mtime, touched on every hit) until the directory
  is within its byte limit. Unlinking a file another process has open is safe on POSIX: that
  process keeps reading the same inode to the end; a process that opens after the unlink gets
  ENOENT, which is a miss. Two evictors unlinking the same file is harmless (ENOENT ignored).

The cache is best effort: any other I/O error (a full or read-only disk, a directory cleared under
a running query) is a miss or a skipped fill, with one warning, never a failed query: the blocks
themselves come from the store and are checked there.
"""
import itertools
import json
import os
import re
import time
import warnings
from pathlib import Path

import numpy as np

from .checksum import crc32c
from .errors import NotACacheError
from .urls import cache_home

DEFAULT_LIMIT = 10 << 30
STALE_TEMP_SECONDS = 3600  # a temporary file this old belongs to a killed filler
MARKER = ".milo-block-cache"
_ENTRY_NAME = re.compile(r"[0-9a-f]+(-\d+)?\.[0-9a-f]{8}")  # <block>.<crc> or <chunk id>-<offset>.<crc>
_counter = itertools.count()


def default_cache_dir() -> Path:
    """``$MILO_CACHE/blocks`` or ``~/.cache/milo/blocks`` (beside the converted models)."""
    return cache_home() / "blocks"


def parse_size(text: str) -> int:
    """Bytes from '123', '512M', '10G' (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    try:
        n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise ValueError(f"cache size {text!r}: expected bytes, or a number with K, M, G or T") from None
    if n < 0:
        raise ValueError(f"cache size {text!r} is negative")
    return n


class BlockCache:
    def __init__(self, directory=None, limit_bytes: int | None = None):
        self.dir = Path(directory) if directory is not None else default_cache_dir()
        env = os.environ.get("MILO_CACHE_SIZE")
        self.limit = limit_bytes if limit_bytes is not None else parse_size(env) if env else DEFAULT_LIMIT
        self._limit_given = limit_bytes is not None
        self.hits = self.misses = self.dropped = 0
        self._warned = False
        self._added = 0  # bytes this process filled since it last evicted
        self._marked = False

    def _skip(self, error: OSError) -> None:
        """Carry on without the cache after an I/O error; say so once per cache object."""
        if not self._warned:
            warnings.warn(f"block cache {self.dir}: {error}; continuing without it where it fails")
            self._warned = True

    def _file(self, key: str, entry: str, crc: int) -> Path:
        return self.dir / key / f"{entry}.{crc:08x}"

    def read_into(self, key: str, entry: str, crc: int, out: memoryview) -> bool:
        """Fill ``out`` from the cache if a sound copy is there; a bad copy is dropped (False)."""
        path = self._file(key, entry, crc)
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(out)
                extra = f.read(1)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                self._skip(e)
            self.misses += 1
            return False
        if n != len(out) or extra or crc32c(np.frombuffer(out, dtype=np.uint8)) != crc:
            self._unlink(path)
            self.dropped += 1
            self.misses += 1
            return False
        try:
            os.utime(path)  # most recently used
        except FileNotFoundError:
            pass
        self.hits += 1
        return True

    def put(self, key: str, entry: str, crc: int, data: memoryview) -> None:
        """Store a block already checked against ``crc``: temporary file, then an atomic rename."""
        if len(data) > self.limit:
            return
        path = self._file(key, entry, crc)
        tmp = path.parent / f".tmp-{os.getpid()}-{next(_counter)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._mark()
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            self._added += len(data)
        except OSError as e:
            self._skip(e)
            self._unlink(tmp)

    def _mark(self) -> None:
        """Write the marker once per cache object: it makes the directory clearable and records the limit."""
        if self._marked:
            return
        tmp = self.dir / f".tmp-marker-{os.getpid()}-{next(_counter)}"
        tmp.write_text(json.dumps({"limit_bytes": self.limit}))
        os.replace(tmp, self.dir / MARKER)
        self._marked = True

    def recorded_limit(self) -> int | None:
        """The byte limit the cache was last filled under, or None if no marker records one."""
        try:
            return int(json.loads((self.dir / MARKER).read_text())["limit_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _entries(self):
        """(mtime, size, path) of every cache file, and stale temporary files removed on the way.
        Files not named like an entry are not the cache's and are left out."""
        out = []
        if not self.dir.is_dir():
            return out
        now = time.time()
        for sub in self._scan(self.dir):
            if not sub.is_dir():
                continue
            for e in self._scan(sub.path):
                try:
                    st = e.stat()
                except OSError:
                    continue
                if e.name.startswith(".tmp-"):
                    if now - st.st_mtime > STALE_TEMP_SECONDS:
                        self._unlink(Path(e.path))
                    continue
                if _ENTRY_NAME.fullmatch(e.name):
                    out.append((st.st_mtime, st.st_size, Path(e.path)))
        return out

    def _scan(self, directory) -> list:
        try:
            with os.scandir(directory) as it:
                return list(it)
        except FileNotFoundError:  # cleared by another process meanwhile
            return []
        except OSError as e:
            self._skip(e)
            return []

    def evict(self) -> int:
        """Unlink least recently used files until the directory holds at most ``limit`` bytes. Scans the
        directory only after this process added bytes (a query that hit the cache costs no scan)."""
        if not self._added:
            return 0
        self._added = 0
        entries = sorted(self._entries(), key=lambda x: x[0])
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, path in entries:
            if total <= self.limit:
                break
            self._unlink(path)
            total -= size
            removed += 1
        return removed

    def stat(self) -> dict:
        """What the cache holds, and its limit: the one given here, else the one it was last filled
        under, else the default (``limit_source`` says which)."""
        entries = self._entries()
        recorded = None if self._limit_given else self.recorded_limit()
        limit, source = (self.limit, "given" if self._limit_given else "default") if recorded is None else (recorded, "last used")
        return {"dir": str(self.dir), "limit_bytes": limit, "limit_source": source, "files": len(entries),
                "bytes": sum(size for _, size, _ in entries), "stores": len({p.parent.name for _, _, p in entries})}

    def check(self) -> list[str]:
        """Every cache file whose bytes do not match the checksum in its name."""
        bad = []
        for _, _, path in self._entries():
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            if crc32c(np.frombuffer(data, dtype=np.uint8)) != int(path.name.split(".")[-1], 16):
                bad.append(str(path))
        return bad

    def clear(self) -> tuple[int, int]:
        """Unlink every entry (and empty store-key directories); returns the files and bytes removed.
        Refuses a directory without the marker: it is not a cache, and its files are someone's."""
        if not self.dir.exists():
            return 0, 0
        if not (self.dir / MARKER).is_file():
            raise NotACacheError(f"{self.dir} is not a milo block cache (no {MARKER} marker); refusing to clear it")
        files = removed_bytes = 0
        for _, size, path in self._entries():
            try:
                path.unlink()
            except FileNotFoundError:  # evicted by another process meanwhile: not ours to count
                continue
            files += 1
            removed_bytes += size
        for sub in self._scan(self.dir):
            if sub.is_dir():
                try:
                    os.rmdir(sub.path)
                except OSError:  # not empty: holds a filler's temporary file or a file that is not ours
                    pass
        return files, removed_bytes

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:  # already gone (another evictor), or not ours to remove: a miss either way
            pass
