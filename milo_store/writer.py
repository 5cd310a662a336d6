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

A version's blocks and text segments are in immutable chunk files (``chunks/<id>``, format 4). An update
(``previous``: the store version at the path that the new one replaces) writes new chunks for what it
encodes and references the previous version's for what it keeps (`keep_block`, `keep_segment`): in a
directory, hard links of its chunk files into the new version; at a URL, the same chunk objects, which
live outside every version. Bytes that stay are neither read nor written again.
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
from . import segments
from .checksum import crc32c
from .codecs import LowRankCodec
from .chunks import new_chunk_id
from .errors import LostRaceError, StoreError, StoreLockedError
from .layout import RAW_RANK, Layout
from .remote import RemoteTarget, read_manifest
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
    """Write one store version: blocks in order, its text segments, the anchor, then ``commit``.

    ``ranks`` [N, L, 2, H] and ``block_tokens`` [N] fix every block's size up front. Blocks go into new
    chunk files of at most ``max_chunk_bytes`` (whole blocks; a larger block has a chunk of its own), each
    sized to what it holds. ``block_group`` [N] (optional) makes store blocks finer than retrieval groups:
    group g is the contiguous run of blocks labelled g (docs/format.md).

    ``previous`` makes the writer an update of that store version, which must still be the one at ``path``
    (a URL's manifest must still name it): `keep_block` and `keep_segment` reference its chunks instead
    of writing their bytes (a directory links them into the new version at commit). ``purge``: the
    previous version's blocks whose bytes must leave with this version (K/V computed from a removed
    demonstration): no chunk holding one of them is referenced, and, where there is any, neither is a chunk
    holding dead bytes (they may be an earlier encoding of such a block); their other blocks are written
    again, `can_keep` says which.
    """

    def __init__(self, path, layout: Layout, ranks: np.ndarray, block_tokens: np.ndarray, *,
                 dtype: str = "float16", attrs: dict | None = None, force: bool = False,
                 max_chunk_bytes: int | None = None, lock: StoreLock | None = None,
                 block_group: np.ndarray | None = None, previous: MiloStore | None = None, purge=(), codec=None):
        self.remote, self.previous = None, previous
        self.path = check_url(path) if is_url(path) else Path(path)
        self.max_chunk_bytes = max_chunk_bytes if max_chunk_bytes is not None else fmt.MAX_CHUNK_BYTES
        self.layout, self.dtype = layout, dtype
        self.ranks = np.asarray(ranks, dtype=np.int16)
        self.block_tokens = np.asarray(block_tokens, dtype=np.int32)
        if self.ranks.shape != (len(self.block_tokens), layout.num_layers, 2, layout.num_kv_heads):
            raise ValueError(f"ranks shape {self.ranks.shape} does not match {len(self.block_tokens)} blocks of {layout}")
        if not layout.ranks_in_range(self.ranks):
            raise ValueError(f"ranks must be {RAW_RANK} (raw) or in [0, head_dim={layout.head_dim}] (a unit's own "
                             f"width), and 0 where a layer stores no such unit; got "
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
        # what lays out the blocks' bytes (`codecs`): the low-rank segments of ``ranks`` unless one is given
        self.codec = codec if codec is not None else LowRankCodec(layout, dtype, self.ranks, self.block_tokens)
        if not np.array_equal(self.codec.ranks, self.ranks):
            raise ValueError("the codec's ranks are not the ranks the writer was given")
        self.itemsize = self.codec.stored_itemsize
        self.offsets = self.codec.stored_offsets
        self.dropped = self._dropped_chunks(previous, purge)
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
            (self.tmp / fmt.CHUNKS).mkdir()
        except BaseException:
            self.close()
            raise
        self.chunk_ids: list[str] = []  # every chunk the version references, in order of first reference
        self.chunk_sizes: list[int] = []
        self.chunk_index: dict[str, int] = {}
        self.written: set[str] = set()  # the chunks this writer wrote (the others are the previous version's)
        self.open_chunk = None  # (index, file) of the chunk blocks are being appended to
        self.extents = np.zeros((len(self.block_tokens), 3), dtype=np.int64)
        self.segments: list[list[int]] = []
        self.next_block = 0
        self.checksums = np.zeros(len(self.block_tokens), dtype=np.uint32)
        self.array_checksums = {}  # every array but indexes (they carry their own)
        self.bytes_written = 0  # bytes of the chunks this writer wrote

    @staticmethod
    def _dropped_chunks(previous: MiloStore | None, purge) -> set[str]:
        """The previous version's chunks this version may not reference: those holding a purged block, and
        when anything is purged those holding dead bytes (whose blocks the store cannot name)."""
        if previous is None or not previous.segmented:
            return set()
        purge = list(purge)
        ext = previous.placement
        dropped = {ext.ids[int(ext.extents[j, 0])] for j in purge}
        if purge:
            dropped |= {ext.ids[c] for c in ext.chunk_dead_bytes()}
        return dropped

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

    def _reference(self, chunk_id: str, size: int) -> int:
        """The index of a chunk in the version's list (added at its first reference)."""
        if chunk_id not in self.chunk_index:
            self.chunk_index[chunk_id] = len(self.chunk_ids)
            self.chunk_ids.append(chunk_id)
            self.chunk_sizes.append(size)
        return self.chunk_index[chunk_id]

    def _new_chunk(self, size: int = 0) -> tuple[int, str]:
        """A fresh chunk of this writer's: (its index, its id)."""
        chunk_id = new_chunk_id()
        self.written.add(chunk_id)
        return self._reference(chunk_id, size), chunk_id

    def _close_chunk(self) -> None:
        if self.open_chunk is not None:
            self.open_chunk[1].close()
            self.open_chunk = None

    def can_keep(self, j: int) -> bool:
        """Whether `keep_block` may reference the previous version's block ``j`` where it lies."""
        prev = self.previous
        return (prev is not None and prev.segmented
                and prev.placement.ids[int(prev.placement.extents[j, 0])] not in self.dropped)

    def keep_block(self, j: int) -> None:
        """The next block is the previous version's block ``j``, unchanged: referenced in its chunk, not written."""
        i, prev = self.next_block, self.previous
        if i >= len(self.block_tokens):
            raise StoreError(f"all {len(self.block_tokens)} blocks are written already")
        if not self.can_keep(j):
            raise StoreError(f"block {j} of the previous version cannot be kept where it lies; write its bytes")
        if not self.codec.same_block(prev.codec, i, j):
            raise ValueError(f"block {i} is not the previous version's block {j} (its encoding or token count differs)")
        chunk, offset, length = prev.placement.extents[j].tolist()
        self.extents[i] = (self._reference(prev.placement.ids[chunk], prev.placement.sizes[chunk]), offset, length)
        self.checksums[i] = prev.checksums[j]
        self.next_block += 1

    def write_block(self, packed: torch.Tensor) -> None:
        """Append the next block's packed factors (flat, as the codec's ``encode`` returns them) to a new chunk."""
        i = self.next_block
        if i >= len(self.block_tokens):
            raise StoreError(f"all {len(self.block_tokens)} blocks are written already")
        want = int(self.offsets[i + 1] - self.offsets[i])
        stored = self.codec.stored_dtype
        if packed.dim() != 1 or packed.numel() != want or packed.dtype != fmt.TORCH_DTYPES[stored]:
            raise ValueError(f"block {i}: expected {want} values of {stored}, got {tuple(packed.shape)} {packed.dtype}")
        data = fmt.to_numpy(packed)
        self.checksums[i] = crc32c(data)
        nbytes = data.nbytes
        if self.open_chunk is not None and self.chunk_sizes[self.open_chunk[0]] + nbytes > self.max_chunk_bytes:
            self._close_chunk()
        if self.open_chunk is None:
            index, chunk_id = self._new_chunk()
            self.open_chunk = (index, open(self.tmp / fmt.chunk_key(chunk_id), "wb"))
        index, f = self.open_chunk
        f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
        self.extents[i] = (index, self.chunk_sizes[index], nbytes)
        self.chunk_sizes[index] += nbytes
        self.bytes_written += nbytes
        self.next_block += 1

    def write_segment(self, blocks: int, arrays: dict) -> None:
        """The next ``blocks`` blocks' text segment (`segments.segment_arrays`), as a new chunk."""
        data, header_crc = segments.pack(arrays)
        index, chunk_id = self._new_chunk(len(data))
        (self.tmp / fmt.chunk_key(chunk_id)).write_bytes(data)
        self.bytes_written += len(data)
        self._add_segment(index, blocks, int(arrays["block_starts"][-1]), header_crc)

    def keep_segment(self, k: int) -> None:
        """The next blocks' text is the previous version's segment ``k``, unchanged: referenced, not written."""
        chunk, _, blocks, demos, header_crc = self.previous.segment_table[k].tolist()
        chunk_id = self.previous.placement.ids[chunk]
        self._add_segment(self._reference(chunk_id, self.previous.placement.sizes[chunk]), blocks, demos, header_crc)

    def _add_segment(self, chunk: int, blocks: int, demos: int, header_crc: int) -> None:
        first = sum(row[2] for row in self.segments)
        if blocks < 1 or first + blocks > len(self.block_tokens):
            raise ValueError(f"a text segment of {blocks} blocks from block {first} of {len(self.block_tokens)}")
        self.segments.append([chunk, first, blocks, demos, header_crc])

    def _create_checked(self, name: str, data: np.ndarray, **kwargs) -> None:
        """Write a whole metadata array and record the CRC32C of its values (fmt.ARRAY_CHECKSUMS)."""
        self.group.create_array(name, data=data, **kwargs)
        self.array_checksums[name] = fmt.array_checksum(data)

    def write_anchor(self, anchor_kv: torch.Tensor, key_gain: torch.Tensor | None = None,
                     states: dict[int, torch.Tensor] | None = None) -> None:
        """The anchor (instruction prefix) K/V, uncompressed, on the layout's grid [L, 2, H, T_anchor, d], pre-RoPE
        keys: kept whole where every layer is alike, else unit by unit (`Layout.pack_units`: nothing where a layer
        stores nothing). ``key_gain`` [L, d]: each K = V layer's gain (zeros elsewhere), which such a layout needs;
        ``states``: each linear layer's state section over the anchor, its values flat (as `BlockFactors.states`)."""
        if any(spec.keys_from_values for spec in self.layout.layers):
            if key_gain is None:
                raise ValueError("a layout with K = V layers keeps their key gain beside the anchor")
            self._write_key_gain(key_gain)
        if self.layout.state_sizes.any():
            self._write_anchor_states(states or {})
        want = (self.layout.num_layers, 2, self.layout.num_kv_heads)
        if tuple(anchor_kv.shape[:3]) != want or anchor_kv.shape[-1] != self.layout.head_dim:
            raise ValueError(f"anchor K/V must be [L, 2, H, T, d] with L, H, d = {want[0]}, {want[2]}, "
                             f"{self.layout.head_dim}; got {tuple(anchor_kv.shape)}")
        anchor = anchor_kv.to(fmt.TORCH_DTYPES[fmt.anchor_dtype(self.dtype)])
        if not self.layout.uniform:
            self.attrs["anchor_tokens"] = int(anchor.shape[3])
            anchor = self.layout.pack_units(anchor)
        self._create_checked(fmt.ANCHOR, fmt.to_numpy(anchor), compressors=None)

    def _write_key_gain(self, gain: torch.Tensor) -> None:
        """Each K = V layer's gain per channel, fp32 [L, d] (zeros at other layers): its keys are its values times it."""
        want = (self.layout.num_layers, self.layout.head_dim)
        if tuple(gain.shape) != want:
            raise ValueError(f"key gain must be [L, d] = {want}; got {tuple(gain.shape)}")
        self._create_checked(fmt.KEY_GAIN, gain.detach().float().cpu().numpy())

    def _write_anchor_states(self, states: dict[int, torch.Tensor]) -> None:
        """Each linear layer's anchor state, fp32, layer after layer (`MiloStore.anchor_states`)."""
        linear = [l for l, spec in enumerate(self.layout.layers) if spec.state_values]
        if sorted(states) != linear:
            raise ValueError(f"a layout with linear layers {linear} keeps each one's anchor state; got {sorted(states)}")
        for l in linear:
            if states[l].shape != (self.layout.layers[l].state_values,):
                raise ValueError(f"layer {l}'s anchor state has {tuple(states[l].shape)} values; its section holds "
                                 f"{self.layout.layers[l].state_values}")
        values = torch.cat([states[l].detach().float().cpu() for l in linear])
        if not torch.isfinite(values).all():
            raise ValueError("the anchor's linear-layer state is not finite")
        self._create_checked(fmt.ANCHOR_STATE, values.numpy())

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

    def commit(self) -> Path | str:
        """Write the index, chunk table and attributes, fsync, and move the version into place (for a URL:
        upload its new chunks and itself, then publish the manifest); returns the path or URL."""
        if self.next_block != len(self.block_tokens):
            raise StoreError(f"commit after {self.next_block} of {len(self.block_tokens)} blocks")
        if self.segments and sum(row[2] for row in self.segments) != len(self.block_tokens):
            raise StoreError(f"text segments cover {sum(row[2] for row in self.segments)} of "
                             f"{len(self.block_tokens)} blocks")
        try:
            self._close_chunk()
            self._create_checked(fmt.RANKS, self.ranks)
            self._create_checked(fmt.TOKENS, self.block_tokens)
            self._create_checked(fmt.CHECKSUMS, self.checksums)
            if self.block_group is not None:
                self._create_checked(fmt.BLOCK_GROUP, self.block_group)
            ids = np.array(self.chunk_ids, dtype=object)
            self.group.create_array(fmt.CHUNK_IDS, shape=ids.shape, dtype=str)[:] = ids
            self.array_checksums[fmt.CHUNK_IDS] = fmt.array_checksum(ids)
            self._create_checked(fmt.CHUNK_SIZES, np.asarray(self.chunk_sizes, dtype=np.int64))
            self._create_checked(fmt.EXTENTS, self.extents)
            self._create_checked(fmt.SEGMENTS, np.asarray(self.segments, dtype=np.int64).reshape(-1, 5))
            for name, data in self.codec.arrays().items():
                self._create_checked(name, data)
            if any(spec.keys_from_values for spec in self.layout.layers) and fmt.KEY_GAIN not in self.array_checksums:
                raise StoreError("a store with K = V layers keeps their key gain (write_anchor's key_gain)")
            if self.layout.state_sizes.any() and fmt.ANCHOR_STATE not in self.array_checksums:
                raise StoreError("a store with linear layers keeps their anchor state (write_anchor's states)")
            version = fmt.FORMAT_VERSION if self.layout.uniform else fmt.LAYERS_VERSION
            self.group.attrs[fmt.ATTRS_KEY] = {
                **self.attrs, **self.codec.attrs(), "format_version": version, "factor_dtype": self.dtype,
                fmt.ARRAY_CHECKSUMS: self.array_checksums, "layout": self.layout.record()}
            if self.remote is not None:
                url = self.remote.publish(self.tmp, version)
                shutil.rmtree(self.tmp, ignore_errors=True)
                return url
            for chunk_id in self.chunk_ids:
                if chunk_id not in self.written:  # the previous version's: the same file, never written again
                    _link_or_copy(Path(self.previous.path) / fmt.chunk_key(chunk_id), self.tmp / fmt.chunk_key(chunk_id))
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
        self._close_chunk()
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
