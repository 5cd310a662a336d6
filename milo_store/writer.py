"""Atomic store writer: a store appears at its path only once it is complete.

Everything is written under ``<path>.tmp-<pid>-<n>``; commit writes the group attributes (the last
piece the reader needs), fsyncs, and renames the directory into place (over a store already there:
an atomic exchange of the two directories where the file system has one, so the path holds a whole
store at every instant). A writer killed at any point leaves at most a temporary directory that never
opens as a store, or holds the replaced store, and that the next writer removes.
An exclusive ``flock`` on ``<path>.lock`` refuses a second concurrent writer; the kernel drops the
lock when the holder dies, so a killed build never blocks the next one, and the holder removes the
file when it releases the lock (``StoreLock``).

For a store URL (``urls.py``) there is no rename: the writer builds the same directory locally (in a
temporary directory), and commit hands it to ``remote.RemoteTarget``, which uploads it as a new
version and publishes the manifest with a conditional write. The lock is then a file under the
local cache directory, keyed by the URL: it orders the writers of one machine; the conditional
write orders writers across machines.

An update (``previous``: the store version at the path that the new one replaces) keeps the previous
version's chunk size, and its leading factor chunks whose bytes do not change are the previous
version's own: hard links of its chunk files, or server-side copies of its chunk objects
(``reuse_leading``), so bytes that stay are neither read nor written again.
"""
import ctypes
import errno
import fcntl
import itertools
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import zarr

from . import format as fmt
from .checksum import crc32c
from .errors import LostRaceError, StoreError, StoreLockedError
from .layout import RAW_RANK, Layout
from .remote import REMOTE_CHUNK_BYTES, RemoteTarget, read_manifest
from .store import MiloStore
from .urls import check_url, is_url, local_sidecar, open_object_store

_counter = itertools.count()


def is_store(path: Path) -> bool:
    try:
        return fmt.ATTRS_KEY in zarr.open_group(str(path), mode="r").attrs
    except Exception:
        return False


class StoreLock:
    """Exclusive, non-blocking writer lock on ``<path>.lock`` (released by the kernel if we die).

    The holder removes the file as it releases the lock, still holding it, so no file stays beside
    a finished store. A writer that opened the file just before the removal may win the lock on the
    removed file: it checks, once locked, that the file it holds is still the one at the path, and
    otherwise starts over on the file now there, so two writers never both hold "the" lock.
    """

    def __init__(self, path):
        self.lock_path = local_sidecar(path, "lock")
        self.name = str(path)
        self.fd = None

    def __enter__(self):
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StoreLockedError(f"{self.name}: another writer is building this store") from None
            if self._holds_current_file(fd):
                self.fd = fd
                return self
            os.close(fd)  # its holder removed it on release: lock the file at the path now

    def _holds_current_file(self, fd: int) -> bool:
        try:
            at_path = os.stat(self.lock_path)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)

    def __exit__(self, *exc):
        try:
            os.unlink(self.lock_path)  # before unlocking: only the holder ever removes the file
        except FileNotFoundError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def check_writable(path: Path) -> None:
    """Refuse a location where no store can be written (``/proc/x``, a read-only or missing mount): a
    writer creates ``<path>.lock`` and ``<path>.tmp-*`` beside it, making the missing parents first,
    so a file must be creatable in the nearest directory that exists above it."""
    existing = path.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise StoreError(f"{path}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise StoreError(f"{path}: cannot write a store there ({existing}: {e.strerror or e})") from None


def check_target(path, force: bool) -> None:
    """Refuse to overwrite what is not ours (any non-store), and a store unless forced."""
    if is_url(path):
        if not force and read_manifest(path, open_object_store(check_url(path))) is not None:
            raise StoreError(f"{path} already holds a store; pass force=True (--force) to replace it")
        return
    path = Path(path)
    check_writable(path)
    if not path.exists():
        return
    if path.is_dir() and not any(path.iterdir()):
        return
    if not is_store(path):
        raise StoreError(f"{path} exists and is not a milo store; refusing to overwrite it")
    if not force:
        raise StoreError(f"{path} already holds a store; pass force=True (--force) to replace it")


class StoreWriter:
    """Write one store: blocks in order, then examples and anchor, then ``commit``.

    ``ranks`` [N, L, 2, H] and ``block_tokens`` [N] fix the layout up front, so the factor array is
    created at its exact size and filled chunk by chunk without padding between blocks.
    ``block_group`` [N] (optional) makes store blocks finer than retrieval groups: group g is the
    contiguous run of blocks labelled g (docs/format.md).
    ``previous`` makes the writer an update of that store version, which must still be the one at
    ``path`` (a URL's manifest must still name it): the new version keeps its chunk size and may share
    its leading chunks (``reuse_leading``, ``keep_block``).
    """

    def __init__(self, path, layout: Layout, ranks: np.ndarray, block_tokens: np.ndarray, *,
                 dtype: str = "float16", attrs: dict | None = None, force: bool = False,
                 max_chunk_bytes: int | None = None, lock: StoreLock | None = None,
                 block_group: np.ndarray | None = None, previous: MiloStore | None = None):
        self.remote, self.previous, self.reused_chunks = None, previous, 0
        self.path = check_url(path) if is_url(path) else Path(path)
        if max_chunk_bytes is None:
            max_chunk_bytes = REMOTE_CHUNK_BYTES if is_url(path) else fmt.MAX_CHUNK_BYTES
        self.layout, self.dtype = layout, dtype
        self.ranks = np.asarray(ranks, dtype=np.int16)
        self.block_tokens = np.asarray(block_tokens, dtype=np.int32)
        if self.ranks.shape != (len(self.block_tokens), layout.num_layers, 2, layout.num_kv_heads):
            raise ValueError(f"ranks shape {self.ranks.shape} does not match {len(self.block_tokens)} blocks of {layout}")
        if not layout.ranks_in_range(self.ranks):
            raise ValueError(f"ranks must be {RAW_RANK} (raw) or in [0, head_dim={layout.head_dim}]; got "
                             f"{int(self.ranks.min())}..{int(self.ranks.max())}")
        if dtype not in fmt.NUMPY_DTYPES:
            raise ValueError(f"unknown factor dtype {dtype!r}; expected one of {tuple(fmt.NUMPY_DTYPES)}")
        if layout.quant != (dtype if dtype in fmt.QUANTIZED else None):
            raise ValueError(f"factor dtype {dtype} does not match a layout with quant={layout.quant}")
        if block_group is not None and (problem := fmt.check_block_group(block_group, len(self.block_tokens))):
            raise ValueError(problem)
        if previous is not None and (previous.dtype, previous.layout) != (dtype, layout):
            raise ValueError(f"an update keeps the store's factors: {dtype} {layout} differs from the previous "
                             f"version's {previous.dtype} {previous.layout}")
        self.block_group = None if block_group is None else np.asarray(block_group, dtype=np.int32)
        self.attrs = dict(attrs or {})
        self.offsets = layout.block_offsets(self.ranks, self.block_tokens)
        # A caller that holds the lock already (a build, across both passes) hands it in and keeps it.
        self.owns_lock = lock is None
        self.lock = StoreLock(self.path).__enter__() if lock is None else lock
        try:
            if is_url(path):
                self.remote = RemoteTarget(self.path, force or previous is not None,
                                           replaces=previous.version if previous is not None else None)
                self.tmp = fresh_upload_dir(self.path)
            else:
                self._remove_stale_temps()
                check_target(self.path, force or previous is not None)
                if previous is not None:
                    self._check_replaces(previous)
                self.tmp = Path(f"{self.path}.tmp-{os.getpid()}-{next(_counter)}")
            self.group = zarr.open_group(str(self.tmp), mode="w")
            total = int(self.offsets[-1])
            self.chunk = (previous.chunk if previous is not None else
                          fmt.chunk_values(total, fmt.value_bytes(dtype), max_chunk_bytes))
            self.factors = self.group.create_array(
                fmt.FACTORS, shape=(total,), dtype=fmt.NUMPY_DTYPES[dtype], chunks=(self.chunk,),
                compressors=None, fill_value=0, config={"write_empty_chunks": True})
        except BaseException:
            self.close()
            raise
        self.buffer = np.zeros(self.chunk, dtype=fmt.NUMPY_DTYPES[dtype])
        self.buffer_start = 0  # flat offset of buffer[0]
        self.next_block = 0
        self.checksums = np.zeros(len(self.block_tokens), dtype=np.uint32)
        self.array_checksums = {}  # every array but factors (per-block CRC32C) and indexes (their own)
        self.extra = {}

    def _remove_stale_temps(self):
        """Clean what killed writers left: temporary stores, and the old store of a replace killed
        between its two renames (put back if the path is empty, else removed)."""
        for stale in self.path.parent.glob(self.path.name + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for old in sorted(self.path.parent.glob(self.path.name + ".old-*")):
            if not self.path.exists() and is_store(old):
                os.rename(old, self.path)
            else:
                shutil.rmtree(old, ignore_errors=True)

    def _check_replaces(self, previous: MiloStore) -> None:
        """The store at the path must be the version the update read (its attributes name every array's
        checksum, so another store's differ)."""
        if Path(previous.path).resolve() != self.path.resolve():
            raise ValueError(f"an update of {self.path} was given the store at {previous.path} as its previous version")
        try:
            now = zarr.open_group(str(self.path), mode="r").attrs.get(fmt.ATTRS_KEY)
        except Exception:
            now = None
        if now != previous.meta:
            raise LostRaceError(f"{self.path}: the store changed since it was read; nothing was written, "
                                "run the update again")

    def reuse_leading(self, blocks: int) -> int:
        """The first ``blocks`` blocks are the previous version's, unchanged and at the same offsets: share
        the factor chunks they fill whole. Returns how many chunks the new version takes as they are."""
        prev = self.previous
        if prev is None or self.next_block:
            raise StoreError("reuse_leading: only an update, before its first block, shares chunks")
        if blocks > prev.num_blocks or not (np.array_equal(self.ranks[:blocks], prev.ranks[:blocks])
                                            and np.array_equal(self.block_tokens[:blocks], prev.block_tokens[:blocks])):
            raise ValueError(f"the first {blocks} blocks are not the previous version's (ranks or token counts differ)")
        self.reused_chunks = int(self.offsets[blocks]) // self.chunk
        self.buffer_start = self.reused_chunks * self.chunk
        return self.reused_chunks

    def keep_block(self) -> None:
        """The next block is the previous version's block of the same index (within `reuse_leading`'s blocks):
        its checksum is the previous one's, and only what it has outside the shared chunks is written."""
        i = self.next_block
        if self.previous is None or i >= self.previous.num_blocks or self.offsets[i] != self.previous.offsets[i]:
            raise StoreError(f"block {i} is not a block `reuse_leading` shared")
        if self.offsets[i + 1] <= self.buffer_start:  # wholly in shared chunks: nothing to read or write
            self.checksums[i] = self.previous.checksums[i]
            self.next_block += 1
        else:
            self.write_block(self.previous.block(i))

    def _create_checked(self, name: str, data: np.ndarray, **kwargs) -> None:
        """Write a whole metadata array and record the CRC32C of its values (fmt.ARRAY_CHECKSUMS)."""
        self.group.create_array(name, data=data, **kwargs)
        self.array_checksums[name] = fmt.array_checksum(data)

    def write_block(self, packed: torch.Tensor) -> None:
        """Append the next block's packed factors (flat, as codec.pack_block returns them)."""
        i = self.next_block
        if i >= len(self.block_tokens):
            raise StoreError(f"all {len(self.block_tokens)} blocks are written already")
        want = int(self.offsets[i + 1] - self.offsets[i])
        if packed.dim() != 1 or packed.numel() != want or packed.dtype != fmt.TORCH_DTYPES[self.dtype]:
            raise ValueError(f"block {i}: expected {want} values of {self.dtype}, got {tuple(packed.shape)} {packed.dtype}")
        data = fmt.to_numpy(packed)
        self.checksums[i] = crc32c(data)
        pos = int(self.offsets[i])
        if pos < self.buffer_start:  # its start lies in chunks shared with the previous version
            if self.checksums[i] != self.previous.checksums[i]:
                raise ValueError(f"block {i} overlaps the chunks shared with the previous version but its bytes differ")
            data, pos = data[self.buffer_start - pos:], self.buffer_start
        while len(data):
            at = pos - self.buffer_start
            n = min(len(data), self.chunk - at)
            self.buffer[at:at + n] = data[:n]
            data, pos = data[n:], pos + n
            if pos - self.buffer_start == self.chunk:
                self._flush()
        self.next_block += 1

    def _flush(self):
        end = min(self.buffer_start + self.chunk, self.factors.shape[0])
        if end > self.buffer_start:
            self.factors[self.buffer_start:end] = self.buffer[:end - self.buffer_start]
        self.buffer_start += self.chunk

    def write_anchor(self, anchor_kv: torch.Tensor) -> None:
        """The anchor (instruction prefix) K/V, uncompressed: [L, 2, H, T_anchor, d], pre-RoPE keys."""
        want = (self.layout.num_layers, 2, self.layout.num_kv_heads)
        if tuple(anchor_kv.shape[:3]) != want or anchor_kv.shape[-1] != self.layout.head_dim:
            raise ValueError(f"anchor K/V must be [L, 2, H, T, d] with L, H, d = {want[0]}, {want[2]}, "
                             f"{self.layout.head_dim}; got {tuple(anchor_kv.shape)}")
        data = fmt.to_numpy(anchor_kv.to(fmt.TORCH_DTYPES[fmt.anchor_dtype(self.dtype)]))
        self._create_checked(fmt.ANCHOR, data, compressors=None)

    def write_examples(self, inputs: list[str], outputs: list[str], ids: list[str], blocks: list[int]) -> None:
        """The demonstrations' text and the block each belongs to (what retrieval indexes)."""
        if not len(inputs) == len(outputs) == len(ids) == len(blocks):
            raise ValueError("inputs, outputs, ids and blocks must have one entry per demonstration")
        g = self.group.create_group(fmt.EXAMPLES)
        for name, values in (("input", inputs), ("output", outputs), ("id", ids)):
            g.create_array(name, shape=(len(values),), dtype=str)[:] = np.array(values, dtype=object)
            self.array_checksums[f"{fmt.EXAMPLES}/{name}"] = fmt.array_checksum(np.array(values, dtype=object))
        self._create_checked(f"{fmt.EXAMPLES}/block", np.asarray(blocks, dtype=np.int32))

    def write_index(self, name: str, arrays: dict, attrs: dict) -> None:
        """A named index under ``indexes/<name>``: 1-D arrays, each one uncompressed chunk so a reader can
        map it in place, their CRC32C recorded in the index's attributes beside ``attrs``."""
        g = self.group.require_group(fmt.INDEXES).create_group(name)
        checksums = {}
        for key, data in arrays.items():
            data = np.ascontiguousarray(data)
            if data.ndim != 1:
                raise ValueError(f"index {name}: array {key} must be 1-D, got shape {data.shape}")
            a = g.create_array(key, shape=data.shape, dtype=data.dtype, chunks=(max(1, len(data)),),
                               compressors=None, fill_value=0, config={"write_empty_chunks": True})
            if len(data):
                a[:] = data
            checksums[key] = crc32c(data)
        g.attrs.update({**attrs, "checksums": checksums})

    def write_token_ids(self, token_ids: np.ndarray) -> None:
        """Every block's token ids, concatenated in block order (int32, one per stored token)."""
        token_ids = np.asarray(token_ids, dtype=np.int32)
        if token_ids.shape != (int(self.block_tokens.sum()),):
            raise ValueError(f"expected {int(self.block_tokens.sum())} token ids, got {token_ids.shape}")
        self._create_checked(fmt.TOKEN_IDS, token_ids)

    def commit(self) -> Path | str:
        """Finish the factor array, write index and attributes, fsync, and move the store into place
        (for a URL: upload it as a new version and publish the manifest); returns the path or URL."""
        if self.next_block != len(self.block_tokens):
            raise StoreError(f"commit after {self.next_block} of {len(self.block_tokens)} blocks")
        try:
            if self.buffer_start < self.factors.shape[0]:
                self._flush()
            self._create_checked(fmt.RANKS, self.ranks)
            self._create_checked(fmt.TOKENS, self.block_tokens)
            self._create_checked(fmt.CHECKSUMS, self.checksums)
            if self.block_group is not None:
                self._create_checked(fmt.BLOCK_GROUP, self.block_group)
            version = fmt.FORMAT_VERSION
            self.group.attrs[fmt.ATTRS_KEY] = {
                **self.attrs, "format_version": version, "factor_dtype": self.dtype,
                fmt.ARRAY_CHECKSUMS: self.array_checksums,
                "layout": {"num_layers": self.layout.num_layers, "num_kv_heads": self.layout.num_kv_heads,
                           "head_dim": self.layout.head_dim, "quant": self.layout.quant,
                           "quantized": self.layout.quant == "int8"}}  # what readers before INT4 look for
            shared = [fmt.factor_chunk_path(Path(), c).as_posix() for c in range(self.reused_chunks)]
            if self.remote is not None:
                url = self.remote.publish(self.tmp, version, copies=shared)
                shutil.rmtree(self.tmp, ignore_errors=True)
                return url
            for name in shared:
                _link_or_copy(self.path / name, self.tmp / name)
            _fsync_tree(self.tmp)
            if self.path.exists() and _exchange(self.tmp, self.path):  # the tmp name now holds the old store
                _fsync_dir(self.path.parent)
                shutil.rmtree(self.tmp)
                return self.path
            old = None
            if self.path.exists():
                old = Path(f"{self.path}.old-{os.getpid()}")
                os.rename(self.path, old)
            os.rename(self.tmp, self.path)
            _fsync_dir(self.path.parent)
            if old is not None:
                shutil.rmtree(old)
            return self.path
        finally:
            self.close()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.close()

    def close(self):
        if self.lock is not None and self.owns_lock:
            self.lock.__exit__()
        self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None or self.lock is not None:
            self.abort()


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link of a chunk file the new version shares (the same bytes, never written again), or a
    copy where the file system has no links to give."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE): readers of ``b`` see the old
    or the new store, never no store. False where the system or file system cannot (then two renames)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path):
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def fresh_upload_dir(url: str) -> Path:
    """Where a store for ``url`` is assembled before it is uploaded: beside the machine's other milo files
    (a store can be many GB; /tmp is often small), emptied first. Call it holding the URL's StoreLock:
    whatever is there then was left by a killed writer."""
    uploads = local_sidecar(url, "upload")
    shutil.rmtree(uploads, ignore_errors=True)
    uploads.mkdir(parents=True)
    return uploads / "store"
