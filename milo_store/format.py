"""The on-disk format: names, version, and the checks both writer and reader rely on (docs/format.md)."""
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from .checksum import crc32c

FACTORED_VERSION = 1  # every unit factored; metadata arrays unchecked
RAW_FORMAT_VERSION = 2  # may hold raw units (rank RAW_RANK), which a version-1 reader would misread
CHECKED_VERSION = 3  # may hold raw units; every array under a checksum (ARRAY_CHECKSUMS); one factor array
FORMAT_VERSION = 4  # every store written now: blocks and text in immutable chunks a version references (EXTENTS)
LAYERS_VERSION = 5  # format 4 whose layers are not all alike (per-layer shapes, K = V, shared layers): its layout
# names each layer (`milo_store.layers`), its anchor lies unit by unit, and K = V layers' gains are an array
READABLE_VERSIONS = (FACTORED_VERSION, RAW_FORMAT_VERSION, CHECKED_VERSION, FORMAT_VERSION, LAYERS_VERSION)
ATTRS_KEY = "milo"
ARRAY_CHECKSUMS = "array_checksums"  # attribute {array path: CRC32C of its values} for every array but factors and indexes
FACTORS, RANKS, TOKENS, CHECKSUMS, ANCHOR = "factors", "ranks", "block_tokens", "checksums", "anchor_kv"
TOKEN_IDS = "token_ids"  # int32, every block's tokens concatenated (optional)
EXAMPLES = "examples"  # group with arrays input, output, id (str) and block (int32)
BLOCK_GROUP = "block_group"  # int32 [N], optional: the retrieval group of each store block
INDEXES = "indexes"  # group of named indexes (e.g. indexes/bm25), each of 1-D single-chunk arrays (optional)
# Format 4: the chunks a version references, where each block lies in them, and its text segments.
CHUNK_IDS, CHUNK_SIZES = "chunk_ids", "chunk_sizes"  # str [C], int64 [C]
EXTENTS = "extents"  # int64 [N, 3]: block i is bytes [offset, offset + length) of chunk (chunk, offset, length)
SEGMENTS = "segments"  # int64 [S, 5]: (chunk, first block, blocks, demonstrations, header CRC32C) per text segment
CHUNKS = "chunks"  # a directory's (or a URL's root's) folder of chunk files, each named by its id
KEY_GAIN = "key_gain"  # format 5: float32 [L, d], a K = V layer's gain per channel (its keys = values × gain)
# format 5: float32, each linear layer's state section over the anchor (M, C, conv tail), layer after layer
ANCHOR_STATE = "anchor_state"
CHECKED_ARRAYS = (RANKS, TOKENS, CHECKSUMS, BLOCK_GROUP, ANCHOR, TOKEN_IDS, CHUNK_IDS, CHUNK_SIZES, EXTENTS, SEGMENTS,
                  KEY_GAIN, ANCHOR_STATE,
                  *(f"{EXAMPLES}/{k}" for k in ("input", "output", "id", "block")))  # under ARRAY_CHECKSUMS
GROUP_BYTES = 4  # index bytes per block that a block_group array adds
MAX_CHUNK_BYTES = 8 << 20  # format 4: a chunk holds whole blocks up to this (a larger block has one of its own)
# numpy cannot hold bfloat16: its bits go to disk as uint16 and are viewed back as torch.bfloat16.
# Quantized stores (int8, int4, int2) keep raw segment bytes (codes and their fp16 scales, codecs/quant.py)
# in a uint8 array.
QUANTIZED = ("int8", "int4", "int2")
NUMPY_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, **{q: np.uint8 for q in QUANTIZED}}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                **{q: torch.uint8 for q in QUANTIZED}}


def value_bytes(dtype: str) -> int:
    """Bytes per value of the factor array of a store in ``dtype`` (a quantized store's values are bytes)."""
    return np.dtype(NUMPY_DTYPES[dtype]).itemsize


def store_version(ranks: np.ndarray) -> int:
    """The lowest format version that may hold these ranks: 1 unless a unit is raw (rank < 0)."""
    return RAW_FORMAT_VERSION if np.asarray(ranks).min(initial=0) < 0 else FACTORED_VERSION


def array_checksum(data: np.ndarray) -> int:
    """CRC32C of an array's values, whatever its chunks and codecs: numbers as their little-endian
    bytes, strings as each one's UTF-8 bytes after their length (uint32, little-endian)."""
    a = np.asarray(data)
    if a.dtype.kind in "OTU":
        encoded = [s.encode() for s in a.reshape(-1).tolist()]
        joined = b"".join(len(e).to_bytes(4, "little") + e for e in encoded)
        return crc32c(np.frombuffer(joined, dtype=np.uint8))
    return crc32c(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")))


def version_problem(version) -> str | None:
    """Why a store of this format version cannot be read (None when it can)."""
    if version in READABLE_VERSIONS:
        return None
    return f"store format version {version!r}; this milo reads versions {', '.join(map(str, READABLE_VERSIONS))}"


def attributes_version(meta: dict) -> str:
    """A directory store's version: a digest of its attributes, which name every array's checksum, so two
    versions (an update, a rebuild) differ and a store left alone keeps its version."""
    canonical = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def anchor_dtype(factor_dtype: str) -> str:
    """The anchor is stored uncompressed: in the factor dtype, or fp16 for quantized stores."""
    return "float16" if factor_dtype in QUANTIZED else factor_dtype


def factor_chunk_path(store_path: Path, index: int) -> Path:
    """File of chunk ``index`` of the 1-D factor array of a format-3 store (zarr v3 default chunk key
    encoding, '/' separator)."""
    return Path(store_path) / FACTORS / "c" / str(index)


def chunk_key(chunk_id: str) -> str:
    """Where a format-4 chunk lies, relative to a store directory or a store URL's root."""
    return f"{CHUNKS}/{chunk_id}"


def array_chunk_path(store_path: Path, array: str) -> Path:
    """File of the only chunk of a 1-D single-chunk array (an index array) at ``array`` ('a/b/c') in the store."""
    return Path(store_path) / array / "c" / "0"


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array the store writes (bfloat16 as its uint16 bits)."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def check_block_group(block_group: np.ndarray, num_blocks: int) -> str | None:
    """What is wrong with a block_group array (None when sound): groups 0.. in order, each contiguous."""
    g = np.asarray(block_group)
    if g.shape != (num_blocks,):
        return f"block_group has shape {g.shape}, expected ({num_blocks},)"
    if num_blocks and (g[0] != 0 or not np.isin(np.diff(g), (0, 1)).all()):
        return "block_group must start at 0 and never decrease or skip a group (each group's blocks are contiguous)"
    return None
