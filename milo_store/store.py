"""Mount a store: metadata through zarr, factor bytes straight from the chunk files into tensors.

The bytes come from the store's origin (``sources.py``): its local chunk files, or the chunk objects
of the store version a URL's manifest names (``remote.py``), pinned for the life of the mount. A
tier is the sources composed in front of it, once, at mount (``compose_source``):

- ``host``: the whole factor array read once into one tensor (page-locked with cudaHostRegister when
  CUDA is there, so its size is exact rather than rounded up by the caching host allocator); a block
  is a zero-copy view.
- ``disk``: every block read into a fresh tensor (page-locked when CUDA is there, so the prefetcher's
  copies to the device are truly asynchronous): a ``preadv`` of the chunk files, or for a store URL
  range GETs behind this machine's block cache (``blockcache.py``, sized by ``BlockCache``).
- ``cached``: ``disk`` behind an in-memory LRU of whole blocks of at most ``memory_cache_bytes``.

Reads bypass zarr's codec pipeline on purpose: the factor array is uncompressed with the default
chunk key encoding, so a block's bytes are plain byte ranges of at most a few files, and reading them
into place is about 30× faster than a zarr slice (docs/benchmarks.md, "Store: reading chunk files").
Integrity comes from the per-block CRC32C, checked on every read unless ``verify=False`` (always for bytes that crossed a
network, which are refetched when damaged). Every other array but the indexes (which carry their own)
is checked against the CRC32C of its values in the attributes (``fmt.ARRAY_CHECKSUMS``, format
version 3) whenever it is read: ranks, block tokens, checksums and block groups at mount, the anchor, token ids and demonstrations
when asked for. Older stores have none and are read with a warning.
"""
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch
import zarr

from . import format as fmt
from . import remote, text_index
from .blockcache import BlockCache
from .checksum import crc32c
from .chunks import EqualChunks, Extents
from .errors import FormatVersionError, NotAStoreError, StoreCorruptedError, StoreError
from .codecs import open_codec
from .layout import Layout
from .segments import Segment
from .sources import BlockCacheSource, ByteSource, ChunkFiles, MemoryCache, MemoryLRU, Origin, ReadStats
from .urls import is_url

TIERS = ("host", "disk", "cached")


class MiloStore:
    """A mounted store. Use ``MiloStore.open(path, tier=...)``."""

    def __init__(self, path, group, meta: dict, tier: str, verify: bool, memory_cache: MemoryCache | None,
                 memory_cache_bytes: int, pin: bool | None, make_origin, block_cache: BlockCache | None,
                 version: str | None = None):
        self.path, self.group, self.meta, self.tier, self.verify = path, group, meta, tier, verify
        # the version this mount pinned: a store URL's manifest version, a directory's attributes digest
        self.version = version if version is not None else fmt.attributes_version(meta)
        self.format_version = meta["format_version"]
        try:
            self.layout = Layout.from_record(meta["layout"], (meta.get("model") or {}).get("rope"))
        except (KeyError, TypeError, ValueError) as e:
            raise StoreCorruptedError(f"{path}: its layout record cannot be read ({type(e).__name__}: {e})") from e
        self.dtype = meta["factor_dtype"]
        self.torch_dtype = fmt.TORCH_DTYPES[self.dtype]
        self.itemsize = fmt.value_bytes(self.dtype)
        self._array_checksums = self._recorded_checksums()
        self._token_ids = None
        self._key_gains = None
        self.ranks = np.asarray(self._read_array(fmt.RANKS), dtype=np.int16)
        self.block_tokens = np.asarray(self._read_array(fmt.TOKENS), dtype=np.int64)
        self.checksums = np.asarray(self._read_array(fmt.CHECKSUMS), dtype=np.uint32)
        self.block_group = (np.asarray(self._read_array(fmt.BLOCK_GROUP), dtype=np.int64) if fmt.BLOCK_GROUP in group
                            else np.arange(len(self.block_tokens), dtype=np.int64))
        self._check_index()
        self._group_starts = np.searchsorted(self.block_group, np.arange(self.num_groups + 1))
        try:  # the codec reads its own arrays (checked); its stored form is what reads and checksums cover
            self.codec = open_codec(meta, self.layout, self.dtype, self.ranks, self.block_tokens, self._read_array)
        except (KeyError, ValueError) as e:
            raise StoreCorruptedError(f"{self.path}: codec {meta.get('codec')!r}: {e}") from e
        self.offsets = self.codec.stored_offsets  # in stored items (`stored_itemsize` bytes each; `itemsize` is the decoded factors')
        self.stored_itemsize = self.codec.stored_itemsize
        self.stored_torch_dtype = fmt.TORCH_DTYPES[self.codec.stored_dtype]
        self.chunk = None  # format ≤ 3: values per chunk of the factor array
        self.segment_table = np.zeros((0, 5), dtype=np.int64)  # format 4: (chunk, first block, blocks, demos, header CRC)
        self._segments: dict[int, Segment] = {}
        self._segments_lock = threading.Lock()
        prefix = "" if not is_url(path) else f"{remote.VERSIONS}/{self.version}/"
        self.placement = self._extents() if self.format_version >= fmt.FORMAT_VERSION else self._equal_chunks(prefix)
        self.origin: Origin | None = None
        self.source: ByteSource | None = None
        self._host, self._unpin = None, None
        self._pin = pin if pin is not None else torch.cuda.is_available()
        self._totals, self._totals_lock = ReadStats(), threading.Lock()
        try:  # a failed mount releases what it took (file descriptors, page-locked memory)
            self.origin = make_origin(self.placement, self.checksums)
            cache = None
            if block_cache is not None:  # a format-4 store's entries are named by chunk: one folder for all versions
                cache = (block_cache, remote.cache_key(str(path), None if self.format_version >= fmt.FORMAT_VERSION
                                                       else self.version))
            self.source = compose_source(tier, self.origin, self.placement, self.checksums, cache, memory_cache,
                                         memory_cache_bytes)
            if tier == "host":
                self._load_host()
        except BaseException:
            self.close()
            raise

    def _equal_chunks(self, prefix: str) -> EqualChunks:
        """Format ≤ 3: the factor array, cut in equal chunks."""
        factors = self.group[fmt.FACTORS]
        if factors.shape != (int(self.offsets[-1]),):
            raise StoreCorruptedError(f"{self.path}: factor array holds {factors.shape[0]} values, ranks describe "
                                      f"{self.offsets[-1]}")
        self.chunk = factors.chunks[0]
        total = factors.shape[0]
        return EqualChunks(prefix, self.chunk * self.stored_itemsize, -(-total // self.chunk) if total else 0,
                           np.diff(self.offsets) * self.stored_itemsize, (str(self.path), self.version))

    def _extents(self) -> Extents:
        """Format 4: the chunks this version references, each block's extent in them, and its text segments."""
        chunk_ids = [str(c) for c in self._read_array(fmt.CHUNK_IDS).tolist()]
        placement = Extents("", chunk_ids, self._read_array(fmt.CHUNK_SIZES), self._read_array(fmt.EXTENTS),
                            self.offsets * self.stored_itemsize, self.checksums, str(self.path))
        table = np.asarray(self._read_array(fmt.SEGMENTS), dtype=np.int64).reshape(-1, 5)
        ends = np.cumsum(table[:, 2])
        if len(table) and ((table[:, 0] < 0).any() or (table[:, 0] >= len(chunk_ids)).any() or (table[:, 2] < 1).any()
                           or (table[:, 3] < 0).any() or table[0, 1] != 0
                           or not np.array_equal(table[1:, 1], ends[:-1]) or ends[-1] != self.num_blocks):
            raise StoreCorruptedError(f"{self.path}: text segments do not cover the blocks in order, once each")
        self.segment_table = table
        return placement

    @classmethod
    def open(cls, path, tier: str = "host", *, verify: bool = True, memory_cache_bytes: int = 1 << 30,
             memory_cache: MemoryCache | None = None, pin: bool | None = None,
             block_cache: BlockCache | None = None, version: str | None = None) -> "MiloStore":
        """Mount the store at ``path`` (a directory, or a store URL: ``urls.py``).

        Raises a StoreError subclass naming what is wrong. ``memory_cache_bytes`` bounds the ``cached``
        tier's in-memory LRU, this mount's own; ``memory_cache`` is one to share instead (a server's
        mounts of successive versions of a store: a block they share is read once); ``block_cache`` is
        where a URL's blocks are kept on this machine's disk (default: ``BlockCache()``, under
        ~/.cache/milo/blocks, its own size limit). ``version``: at a URL, mount that version rather than the
        manifest's (`verify --absent` reads the others; gc compacts the current one).
        """
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
        if memory_cache_bytes < 0:
            raise ValueError(f"memory_cache_bytes must be at least 0; got {memory_cache_bytes}")
        if version is not None and not is_url(path):
            raise ValueError(f"{path}: a directory holds one version; only a store URL's may be named")
        if is_url(path):
            path, group, meta, make_origin, version = remote.mount(path, version)
            cache = block_cache if block_cache is not None else BlockCache()
        else:
            path, group, meta = cls._open_local(Path(path))
            make_origin = lambda placement, checksums: ChunkFiles(path, placement, checksums)  # noqa: E731
            cache, version = None, None
        if not isinstance(meta, dict):
            raise NotAStoreError(f"{path}: a zarr group but not a milo store (no '{fmt.ATTRS_KEY}' attributes)")
        if problem := fmt.version_problem(meta.get("format_version")):
            raise FormatVersionError(f"{path}: {problem}")
        try:
            return cls(path, group, meta, tier, verify, memory_cache, memory_cache_bytes, pin, make_origin, cache, version)
        except (KeyError, ValueError, FileNotFoundError) as e:
            raise StoreCorruptedError(f"{path}: broken store structure ({type(e).__name__}: {e})") from e

    @staticmethod
    def current_version(path) -> str:
        """The version a mount of ``path`` would pin now, read cheaply (one manifest GET for a URL, the
        attributes for a directory): a server polls it to notice an update."""
        if is_url(path):
            return remote.current_version(path)
        return fmt.attributes_version(MiloStore._open_local(Path(path))[2])

    @staticmethod
    def _open_local(path: Path):
        if not path.is_dir():
            raise NotAStoreError(f"{path}: no such store directory")
        if not (path / "zarr.json").is_file():
            raise NotAStoreError(f"{path}: not a milo store (no zarr.json)")
        try:
            group = zarr.open_group(str(path), mode="r")
            meta = group.attrs.get(fmt.ATTRS_KEY)
        except Exception as e:
            raise StoreCorruptedError(f"{path}: unreadable store metadata ({e})") from e
        return path, group, meta

    # -- structure -------------------------------------------------------------------------------
    def _recorded_checksums(self) -> dict | None:
        """The CRC32C of every metadata array (None for a store written before them, with a warning)."""
        if self.meta["format_version"] < fmt.CHECKED_VERSION:
            warnings.warn(f"{self.path}: format version {self.meta['format_version']} records no checksums of its "
                          "metadata arrays (anchor, demonstrations, ranks, ...): they are read unchecked; rebuild "
                          "the store to check them")
            return None
        recorded = self.meta.get(fmt.ARRAY_CHECKSUMS)
        if not isinstance(recorded, dict):
            raise StoreCorruptedError(f"{self.path}: attributes lack the checksums of its arrays ({fmt.ARRAY_CHECKSUMS})")
        return recorded

    def _read_array(self, name: str) -> np.ndarray:
        """A whole metadata array, checked against its recorded CRC32C: corrupted bytes are never returned."""
        try:
            data = np.asarray(self.group[name][...])
        except KeyError:  # no such array: the caller knows whether that is allowed
            raise
        except Exception as e:  # a damaged compressed chunk, or damaged array metadata
            raise StoreCorruptedError(f"{self.path}: array {name} is unreadable ({type(e).__name__}: {e})") from e
        if self._array_checksums is not None:
            if name not in self._array_checksums:
                raise StoreCorruptedError(f"{self.path}: array {name} has no recorded checksum")
            if fmt.array_checksum(data) != self._array_checksums[name]:
                raise StoreCorruptedError(f"{self.path}: array {name} fails its checksum (corrupted store metadata)")
        return data

    def _check_index(self):
        n = len(self.block_tokens)
        want = (n, self.layout.num_layers, 2, self.layout.num_kv_heads)
        if self.ranks.shape != want or self.checksums.shape != (n,):
            raise StoreCorruptedError(f"{self.path}: index shapes disagree: ranks {self.ranks.shape}, expected {want}; "
                                      f"checksums {self.checksums.shape}")
        if n and (self.block_tokens.min() < 1 or not self.layout.ranks_in_range(self.ranks)):
            raise StoreCorruptedError(f"{self.path}: index holds impossible token counts or ranks (a rank past its "
                                      "unit's width, or a unit its layer does not store)")
        if not self.layout.uniform and self.meta["format_version"] < fmt.LAYERS_VERSION:
            raise StoreCorruptedError(f"{self.path}: a version-{self.meta['format_version']} store cannot hold layers "
                                      "of different kinds or shapes")
        if fmt.store_version(self.ranks) > self.meta["format_version"]:
            raise StoreCorruptedError(f"{self.path}: a version-{self.meta['format_version']} store cannot hold raw units")
        if problem := fmt.check_block_group(self.block_group, n):
            raise StoreCorruptedError(f"{self.path}: {problem}")

    # -- reading ---------------------------------------------------------------------------------
    def _read(self, source: ByteSource, blocks: list[int], outs: list[torch.Tensor], check: bool,
              stats: ReadStats | None = None) -> None:
        """Fill ``outs`` (CPU, contiguous, one per block) with these blocks' bytes from ``source``; the
        call's costs go to ``stats`` and to the store's running totals."""
        call = ReadStats()
        try:
            source.read_blocks(blocks, [int(self.offsets[i]) * self.stored_itemsize for i in blocks],
                               [memoryview(o.view(torch.uint8).numpy()) for o in outs], check, call)
        finally:
            with self._totals_lock:
                self._totals.add(call)
            if stats is not None:
                stats.add(call)

    def read_range(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Values [start, stop) of the flat factor array into ``out`` (CPU, contiguous), straight from the
        origin, unchecked and past every cache: what `push` copies a store with, and the raw read path
        benchmarks time the tiers against. Blocks, checked, come from `blocks`."""
        size = self.stored_itemsize
        self.origin.read_range(start * size, memoryview(out.view(torch.uint8).numpy())[:(stop - start) * size])

    def _load_host(self):
        total = int(self.offsets[-1])
        self._host = torch.empty(total, dtype=self.stored_torch_dtype)
        if self._pin:
            try:
                # unregistered when the store closes or is collected without close()
                self._unpin = weakref.finalize(self, _unregister_pinned, _register_pinned(self._host))
            except RuntimeError as e:  # e.g. a low `ulimit -l`: still correct, only transfers are slower
                warnings.warn(f"{self.path}: host tier left pageable, page-locking failed ({e})")
        self._read(self.source, list(range(self.num_blocks)),
                   [self._host[self.offsets[i]:self.offsets[i + 1]] for i in range(self.num_blocks)], self.verify)

    def _fresh(self, i: int, pinned: bool = False) -> torch.Tensor:
        return torch.empty(int(self.offsets[i + 1] - self.offsets[i]), dtype=self.stored_torch_dtype, pin_memory=pinned)

    def block(self, i: int) -> torch.Tensor:
        """Block i's factors, flat, as the kernels read them (`codecs`: the low-rank codec's stored bytes, a view
        in the host tier and a fresh tensor from disk; another codec's decoded from its stored bytes)."""
        return self.blocks([i])[0]

    def blocks(self, ids: list[int], stats: ReadStats | None = None) -> list[torch.Tensor]:
        """Several blocks at once (one batch of merged, concurrent reads from a remote source).

        Safe to call from several threads. ``stats``, when given, gains this call's own costs (remote
        bytes, GETs and seconds; block cache and memory hits), whatever other calls overlap it.
        """
        return [self.codec.decode(i, t) for i, t in zip(ids, self.stored_blocks(ids, stats))]

    def stored_blocks(self, ids: list[int], stats: ReadStats | None = None) -> list[torch.Tensor]:
        """These blocks' stored bytes, checked, undecoded (what a copy of the store writes again; for the
        low-rank codec the same tensors as `blocks`)."""
        for i in ids:
            if not 0 <= i < self.num_blocks:
                raise IndexError(f"block {i} out of range: the store has {self.num_blocks} blocks")
        if self._host is not None:
            return [self._host[self.offsets[i]:self.offsets[i + 1]] for i in ids]
        unique = list(dict.fromkeys(ids))
        pinned = self._pin and torch.cuda.is_available()  # so the prefetcher's copies to the GPU are asynchronous
        fresh = [self._fresh(i, pinned) for i in unique]
        if unique:
            self._read(self.source, unique, fresh, self.verify, stats)
        out = dict(zip(unique, fresh))
        return [out[i] for i in ids]

    def remote_stats(self) -> dict | None:
        """Bytes, GETs and seconds fetched from the object store so far, over every caller (None for a
        local store). One call's own costs: ``blocks(ids, stats=ReadStats())``."""
        if not self.remote:
            return None
        with self._totals_lock:
            t = self._totals
            return {"bytes": t.remote_bytes, "gets": t.remote_gets, "seconds": t.remote_seconds}

    @property
    def remote(self) -> bool:
        """Whether the store is read from an object store (a store URL)."""
        return is_url(self.path)

    def block_bytes(self, ids) -> np.ndarray:
        """Bytes of each of these blocks' packed factors (int64, one per id): what reading them moves."""
        ids = np.asarray(ids, dtype=np.int64)
        return (self.offsets[ids + 1] - self.offsets[ids]) * self.stored_itemsize

    def block_layer_bounds(self, i: int) -> np.ndarray:
        """Offsets of each layer inside block i (int64 [L + 1]), relative to the block's start."""
        return self.layout.layer_offsets(self.ranks[i], int(self.block_tokens[i]))

    def verify_all(self, progress=None) -> list[str]:
        """Every problem found, one line each, naming the block or index (empty when the store is sound).
        ``progress(i)`` is called after each block."""
        problems = []
        for i in range(self.num_blocks):
            try:  # from the origin itself: no cache stands in for the store's own bytes
                self._read(self.origin, [i], [self._fresh(i)], True)
            except StoreError as e:
                problems.append(str(e))
            if progress:
                progress(i)
        for name in self.index_names():
            try:
                self.index_arrays(name, check=True)
            except StoreError as e:
                problems.append(str(e))
        for k in range(len(self.segment_table)):
            try:
                problems += self.segment(k).problems()
            except StoreError as e:
                problems.append(str(e))
        return problems + self._metadata_problems()

    def _metadata_problems(self) -> list[str]:
        """Every metadata array that is missing, unreadable or fails its recorded checksum."""
        names = list(self._array_checksums or ())
        names += [n for n in fmt.CHECKED_ARRAYS if n in self.group and n not in names]
        problems = []
        for name in names:
            try:
                self._read_array(name)
            except KeyError:
                problems.append(f"{self.path}: array {name} is missing")
            except StoreError as e:
                problems.append(str(e))
        return problems

    # -- metadata --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_tokens)

    @property
    def grouped(self) -> bool:
        """Whether the store keeps a block_group array (store blocks finer than retrieval groups)."""
        return fmt.BLOCK_GROUP in self.group

    @property
    def num_groups(self) -> int:
        """Retrieval groups; without a block_group array every block is its own group."""
        return int(self.block_group[-1]) + 1 if self.num_blocks else 0

    def blocks_of(self, groups: list[int]) -> list[int]:
        """The store blocks of these groups, group after group, each group's blocks in order."""
        return [b for g in groups for b in range(int(self._group_starts[g]), int(self._group_starts[g + 1]))]

    def group_tokens(self) -> np.ndarray:
        """Tokens per retrieval group, int64 [num_groups]."""
        return np.bincount(self.block_group, weights=self.block_tokens, minlength=self.num_groups).astype(np.int64)

    def anchor_kv(self) -> torch.Tensor | None:
        """The uncompressed anchor K/V on the layout's grid [L, 2, H, T_anchor, d] (pre-RoPE keys; a K = V layer's keys
        its values times its gain; zeros where a layer stores nothing), or None."""
        if fmt.ANCHOR not in self.group:
            return None
        anchor = fmt.from_numpy(self._read_array(fmt.ANCHOR), fmt.anchor_dtype(self.dtype))
        if self.layout.uniform:
            return anchor
        tokens = int(self.meta["anchor_tokens"])
        try:
            grid = self.layout.unpack_units(anchor, tokens)
        except ValueError as e:
            raise StoreCorruptedError(f"{self.path}: its anchor does not fit its layout ({e})") from e
        for l, spec in enumerate(self.layout.layers):
            if spec.keys_from_values:
                values = grid[l, 1, :spec.kv_heads, :, :spec.head_dim]
                grid[l, 0, :spec.kv_heads, :, :spec.head_dim] = (values.float() * self.key_gain(l)).to(grid.dtype)
        return grid

    def key_gain(self, layer: int) -> torch.Tensor:
        """A K = V layer's gain [d] (fp32): its keys are its values times it (docs/format.md, "Layers")."""
        spec = self.layout.layers[layer]
        if not spec.keys_from_values:
            raise ValueError(f"layer {layer} stores its own keys: it has no key gain")
        return self.key_gains()[layer, :spec.head_dim]

    def key_gains(self) -> torch.Tensor | None:
        """Every K = V layer's gain, fp32 [L, d] (zeros at other layers), read and checked once; None without such
        layers."""
        if not any(spec.keys_from_values for spec in self.layout.layers):
            return None
        if self._key_gains is None:
            gains = np.asarray(self._read_array(fmt.KEY_GAIN), dtype=np.float32)
            if gains.shape != (self.layout.num_layers, self.layout.head_dim):
                raise StoreCorruptedError(f"{self.path}: {fmt.KEY_GAIN} has shape {gains.shape}, expected "
                                          f"{(self.layout.num_layers, self.layout.head_dim)}")
            self._key_gains = torch.from_numpy(gains)
        return self._key_gains

    def anchor_states(self) -> dict[int, torch.Tensor] | None:
        """Each linear layer's state section over the anchor, fp32 values flat (`Layout.state_section` views them),
        or None where no layer is linear."""
        sizes = [spec.state_values for spec in self.layout.layers]
        if not any(sizes):
            return None
        values = torch.from_numpy(np.asarray(self._read_array(fmt.ANCHOR_STATE), dtype=np.float32))
        if values.shape != (sum(sizes),):
            raise StoreCorruptedError(f"{self.path}: {fmt.ANCHOR_STATE} has shape {tuple(values.shape)}, expected "
                                      f"({sum(sizes)},)")
        ends = np.cumsum(sizes)
        return {l: values[end - size:end] for l, (size, end) in enumerate(zip(sizes, ends)) if size}

    def token_ids(self, i: int) -> np.ndarray | None:
        """The token ids block i was encoded from, or None when the store does not keep them."""
        if self.segmented:
            if not len(self.segment_table):
                return None
            k = self._segment_of(i)
            seg = self.segment(k)
            if not seg.has("token_ids"):
                return None
            first = int(self.segment_table[k, 1])
            start = int(self.block_tokens[first:i].sum())
            ids = seg.array("token_ids")
            if len(ids) != int(self.block_tokens[first:first + self.segment_table[k, 2]].sum()):
                raise StoreCorruptedError(f"{self.path}: text segment {k} holds {len(ids)} token ids, its blocks "
                                          f"{int(self.block_tokens[first:first + self.segment_table[k, 2]].sum())} tokens")
            return ids[start:start + int(self.block_tokens[i])].copy()  # the caller's own
        if fmt.TOKEN_IDS not in self.group:
            return None
        if self._token_ids is None:  # read and checked whole once (its checksum covers the whole array)
            self._token_ids = self._read_array(fmt.TOKEN_IDS)
        start = int(self.block_tokens[:i].sum())
        return self._token_ids[start:start + int(self.block_tokens[i])].copy()  # the caller's own, as before

    def examples(self) -> dict:
        """Demonstrations: lists 'input', 'output', 'id' and 'block' (empty lists when none were stored)."""
        if not self.segmented and fmt.EXAMPLES not in self.group:
            return {"input": [], "output": [], "id": [], "block": []}
        return {k: self.example_array(k).tolist() for k in ("input", "output", "id", "block")}

    def example_array(self, name: str) -> np.ndarray:
        """One demonstrations array ('input', 'output', 'id' or 'block'), read whole and checked."""
        if not self.segmented:
            return self._read_array(f"{fmt.EXAMPLES}/{name}")
        if name == "block":
            parts = [first + np.repeat(np.arange(blocks), np.diff(self._block_starts(k)))
                     for k, (_, first, blocks, _, _) in enumerate(self.segment_table.tolist())]
            return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
        if name not in ("input", "output", "id"):
            raise KeyError(name)
        out = np.empty(self.num_examples(), dtype=object)
        at = 0
        for k in range(len(self.segment_table)):
            values = self.segment(k).strings(name)
            out[at:at + len(values)] = values
            at += len(values)
        return out

    def num_examples(self) -> int:
        """How many demonstrations the store keeps (from array metadata: no demonstration is read)."""
        if self.segmented:
            return int(self.segment_table[:, 3].sum())
        return self.group[f"{fmt.EXAMPLES}/id"].shape[0] if fmt.EXAMPLES in self.group else 0

    # -- format 4: text segments -----------------------------------------------------------------
    @property
    def segmented(self) -> bool:
        """Whether demonstrations, token ids and postings are in text segments (format 4)."""
        return self.format_version >= fmt.FORMAT_VERSION

    def _segment_of(self, block: int) -> int:
        return int(np.searchsorted(self.segment_table[:, 1], block, side="right")) - 1

    def segment(self, k: int) -> Segment:
        """Text segment k, its header checked (mapped from its chunk file, or fetched whole from a URL; once)."""
        with self._segments_lock:
            if k not in self._segments:
                chunk, _, _, demos, header_crc = self.segment_table[k].tolist()
                where = f"{self.path}: text segment {k} ({self.placement.names[chunk]})"
                seg = Segment(self.origin.chunk_data(chunk), header_crc, where)
                if seg.has("input_starts") and len(seg.array("input_starts", check=False)) != demos + 1:
                    raise StoreCorruptedError(f"{where} holds another number of demonstrations than the version's "
                                              f"table ({demos})")
                self._segments[k] = seg
            return self._segments[k]

    def _block_starts(self, k: int) -> np.ndarray:
        """Segment k's blocks' first demonstrations, relative to the segment, and its end ([blocks + 1])."""
        starts = self.segment(k).array("block_starts")
        blocks, demos = int(self.segment_table[k, 2]), int(self.segment_table[k, 3])
        if len(starts) != blocks + 1 or starts[0] != 0 or starts[-1] != demos or (np.diff(starts) < 0).any():
            raise StoreCorruptedError(f"{self.path}: text segment {k}'s block starts contradict the version's table")
        return starts

    def block_starts(self) -> np.ndarray:
        """Every block's first demonstration and the end (int64 [N + 1]), demonstrations in store order."""
        if not self.segmented:
            found = self.index_arrays(text_index.NAME, check=False)
            if found is not None and "block_starts" in found[1]:
                return np.asarray(found[1]["block_starts"], dtype=np.int64)
            block = np.asarray(self.examples()["block"], dtype=np.int64)
            return np.searchsorted(np.sort(block), np.arange(self.num_blocks + 1)).astype(np.int64)
        if not len(self.segment_table):
            return np.zeros(self.num_blocks + 1, dtype=np.int64)
        parts, first = [], 0
        for k in range(len(self.segment_table)):
            parts.append(self._block_starts(k)[:-1] + first)
            first += int(self.segment_table[k, 3])
        return np.concatenate(parts + [np.array([first])]).astype(np.int64)

    def segmented_index(self, check: bool | None = None) -> text_index.SegmentedTextIndex | None:
        """The BM25 index of a format-4 store: its vocabulary and each segment's postings, mapped (checked
        once when ``check``, default the store's ``verify``). None when the store has no demonstrations."""
        found = self.index_arrays(text_index.NAME, check)
        if found is None:
            return None
        attrs, vocabulary = found
        if attrs.get("version") != text_index.SEGMENTED_VERSION or any(
                attrs.get(k) != v for k, v in text_index.index_attrs().items() if k != "version"):
            raise StoreCorruptedError(f"{self.path}: index {text_index.NAME} records another build "
                                      f"({ {k: attrs.get(k) for k in text_index.index_attrs()} })")
        check = self.verify if check is None else check
        postings = [self.segment(k).postings(check) for k in range(len(self.segment_table))]
        try:
            return text_index.SegmentedTextIndex(vocabulary, attrs, postings, self.block_starts())
        except (ValueError, KeyError, TypeError) as e:
            raise StoreCorruptedError(f"{self.path}: broken BM25 index ({e})") from e

    def block_key(self, i: int) -> tuple:
        """What identifies block i's bytes to a cache: in a format-4 store its chunk, offset, length and
        CRC32C, the same in every version that keeps the block; in older stores the store, version and index."""
        return self.placement.identity(i)

    def index_names(self) -> list[str]:
        """The named indexes the store keeps (``indexes/<name>``, e.g. ``bm25``)."""
        return sorted(k for k, _ in self.group[fmt.INDEXES].groups()) if fmt.INDEXES in self.group else []

    def index_arrays(self, name: str, check: bool | None = None) -> tuple[dict, dict[str, np.ndarray]] | None:
        """A named index's attributes and arrays, memory-mapped read-only (None when the store has none).

        Each array is one uncompressed chunk, mapped straight from its chunk file; a store URL's arrays
        are read whole into memory instead (each mount; not kept in the block cache). With ``check`` (default: the store's
        ``verify``) every array's CRC32C is checked, which reads it whole once.
        """
        key = f"{fmt.INDEXES}/{name}"
        if fmt.INDEXES not in self.group or name not in self.group[fmt.INDEXES]:
            return None
        g = self.group[key]
        attrs = dict(g.attrs)
        checksums = attrs.get("checksums")
        if not isinstance(checksums, dict):
            raise StoreCorruptedError(f"{self.path}: index {name} has no checksums")
        arrays = {}
        for array, crc in checksums.items():
            if array not in g:
                raise StoreCorruptedError(f"{self.path}: index {name} lacks its array {array}")
            a = g[array]
            dtype = np.dtype(a.dtype).newbyteorder("<")  # zarr v3's default bytes codec: little-endian
            if a.ndim != 1 or a.compressors or a.chunks[0] < a.shape[0]:
                raise StoreCorruptedError(f"{self.path}: index {name}: {array} is not one uncompressed chunk")
            p = fmt.array_chunk_path(self.path, f"{key}/{array}") if not is_url(self.path) else None
            if p is None or a.shape[0] == 0:  # nothing to map (a URL's one chunk comes through zarr, into memory)
                data = np.asarray(a[...], dtype=dtype) if a.shape[0] else np.empty(0, dtype=dtype)
                data.setflags(write=False)
            elif not p.is_file() or p.stat().st_size != a.chunks[0] * dtype.itemsize:
                raise StoreCorruptedError(f"{self.path}: index {name}: {array}'s chunk file is missing or truncated")
            else:
                data = np.memmap(p, dtype=dtype, mode="r", shape=a.shape)
            if (self.verify if check is None else check) and crc32c(data) != crc:
                raise StoreCorruptedError(f"{self.path}: index {name}: {array} fails its checksum (corrupted index bytes)")
            arrays[array] = data
        return attrs, arrays

    def accounting(self) -> dict:
        """Planned and actual bytes: the accounted compressed set, and what the store takes on disk."""
        acc = self.codec.accounting(self.itemsize)
        if self.grouped:  # one more index entry per block, beyond what layout.index_bytes counts
            extra = fmt.GROUP_BYTES * self.num_blocks
            acc["index_bytes"] += extra
            acc["total_bytes"] += extra
            acc["ratio"] = acc["total_bytes"] / acc["full_fp16_bytes"] if acc["full_fp16_bytes"] else 0.0
        acc["disk_bytes"], acc["factor_file_bytes"] = self.origin.disk_bytes()
        acc["dead_bytes"] = self.placement.dead_bytes()
        acc["planned_ratio"] = self.meta.get("allocation", {}).get("ratio")
        return acc

    def close(self):
        if self.source is not None:  # closes the origin behind it
            self.source.close()
        elif self.origin is not None:  # a mount that failed between the two
            self.origin.close()
        if self._unpin is not None:
            self._unpin()
        self._host = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"MiloStore({str(self.path)!r}, tier={self.tier!r}, blocks={self.num_blocks})"


def compose_source(tier: str, origin: Origin, placement, checksums: np.ndarray,
                   block_cache: tuple[BlockCache, str] | None, memory_cache: MemoryCache | None,
                   memory_cache_bytes: int) -> ByteSource:
    """A tier's read path: the origin, behind this machine's block cache (a URL's, with its key), behind
    the ``cached`` tier's in-memory LRU (a shared `MemoryCache`, or one of this mount's own). Caches key
    blocks by the placement's names for them (``chunks.py``)."""
    source: ByteSource = origin
    if block_cache is not None:
        source = BlockCacheSource(source, *block_cache, placement, checksums)
    if tier == "cached":
        owned = memory_cache is None
        source = MemoryLRU(source, MemoryCache(memory_cache_bytes) if owned else memory_cache, placement, owned)
    return source


def _register_pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-lock an existing CPU allocation in place (exact size, unlike the caching host allocator)."""
    if t.numel():
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            cudart.cudaGetLastError()  # a failed call leaves a sticky error the next unrelated launch would report
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
    return t


def _unregister_pinned(t: torch.Tensor) -> None:
    """Undo `_register_pinned` once no copy from ``t`` can still be in flight. Holding ``t`` here keeps
    the memory alive until it is unregistered, even when the store is collected without close()."""
    if t.numel():
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
