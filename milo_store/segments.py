"""Text segments of a format-4 store: each a run of blocks' demonstrations, token ids and BM25 postings in
one immutable chunk, so an update writes only the segments whose blocks changed and references the rest.

A segment's file is an 8-byte little-endian header length, the header (JSON: each array's dtype, offset,
count and CRC32C), then the arrays at 8-byte-aligned offsets, so a local reader maps it and views its
arrays in place. The version's ``segments`` table records the header's CRC32C, so every byte of a segment
is under a checksum that the version's attributes vouch for (docs/format.md, "Text segments").

Arrays: ``input``, ``output``, ``id`` (each demonstration's UTF-8 bytes, ``<name>_bytes`` uint8, and
their starts, ``<name>_starts`` int64 [n + 1]); ``block_starts`` int64 [blocks + 1] (the segment's
blocks' first demonstrations; demonstrations are in block order); ``token_ids`` int32 (its blocks'
token ids, concatenated; absent when the store keeps none); and the postings of `text_index.segment_postings`.
"""
import json
import math

import numpy as np

from . import text_index
from .checksum import crc32c
from .errors import StoreCorruptedError

STRINGS = ("input", "output", "id")
MIN_SEGMENT_DEMOS = 256  # a removal rewrites its segment: small enough to be cheap beside a block's K/V
TARGET_SEGMENTS = 32  # a query looks each term up in every segment: larger segments in larger corpora
ALIGN = 8


def segment_demos(num_demos: int) -> int:
    """How many demonstrations a segment holds at most (whole blocks; a block larger than this is one segment)."""
    return max(MIN_SEGMENT_DEMOS, math.ceil(num_demos / TARGET_SEGMENTS))


def segment_arrays(inputs: list[str], outputs: list[str], ids: list[str], block_starts, token_ids) -> dict:
    """The arrays of a segment holding these demonstrations (in block order; ``block_starts`` relative to the
    segment) and its blocks' ``token_ids`` (None: the store keeps none)."""
    arrays = {}
    for name, values in zip(STRINGS, (inputs, outputs, ids)):
        encoded = [v.encode() for v in values]
        arrays[f"{name}_bytes"] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        arrays[f"{name}_starts"] = np.concatenate(([0], np.cumsum([len(e) for e in encoded]))).astype(np.int64)
    arrays["block_starts"] = np.asarray(block_starts, dtype=np.int64)
    if token_ids is not None:
        arrays["token_ids"] = np.asarray(token_ids, dtype=np.int32)
    arrays.update(text_index.segment_postings(inputs))
    return arrays


def pack(arrays: dict[str, np.ndarray]) -> tuple[bytes, int]:
    """(the segment file's bytes, its header's CRC32C). Offsets in the header count from the end of the
    header (padded to 8 bytes), where the arrays start."""
    layout, offset, parts = {}, 0, []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        layout[name] = {"dtype": a.dtype.str, "offset": offset, "count": int(a.size), "crc32c": crc32c(a)}
        data = a.tobytes()
        parts.append(data + b"\0" * (-len(data) % ALIGN))
        offset += len(parts[-1])
    header = json.dumps({"arrays": layout}, sort_keys=True).encode()
    header += b" " * (-len(header) % ALIGN)
    return len(header).to_bytes(8, "little") + header + b"".join(parts), crc32c(np.frombuffer(header, dtype=np.uint8))


class Segment:
    """One segment's arrays, viewed in ``data`` (a mapped chunk file, or an object's bytes): the header is
    checked against ``header_crc`` at once, each array against its own CRC32C when asked for checked."""

    def __init__(self, data: np.ndarray, header_crc: int, where: str):
        self.data, self.where = data, where
        if len(data) < 8:
            raise StoreCorruptedError(f"{where}: text segment of {len(data)} bytes has no header")
        size = int.from_bytes(data[:8].tobytes(), "little")
        if size > len(data) - 8 or crc32c(data[8:8 + size]) != header_crc:
            raise StoreCorruptedError(f"{where}: text segment header fails its checksum")
        self.base = 8 + size
        try:
            self.layout = json.loads(data[8:8 + size].tobytes())["arrays"]
            for entry in self.layout.values():
                if self.base + entry["offset"] + entry["count"] * np.dtype(entry["dtype"]).itemsize > len(data):
                    raise ValueError("an array runs past the end of the file")
        except (ValueError, KeyError, TypeError) as e:
            raise StoreCorruptedError(f"{where}: unreadable text segment header ({e})") from None
        self._checked: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.layout

    def array(self, name: str, check: bool = True) -> np.ndarray:
        """The array ``name`` (read-only view), checked against its CRC32C once when ``check``."""
        entry = self.layout.get(name)
        if entry is None:
            raise StoreCorruptedError(f"{self.where}: text segment lacks its array {name}")
        dtype = np.dtype(entry["dtype"])
        start = self.base + entry["offset"]
        a = self.data[start:start + entry["count"] * dtype.itemsize].view(dtype)
        a.flags.writeable = False
        if check and name not in self._checked:
            if crc32c(a) != entry["crc32c"]:
                raise StoreCorruptedError(f"{self.where}: {name} fails its checksum (corrupted text segment)")
            self._checked.add(name)
        return a

    def strings(self, name: str) -> list[str]:
        """The demonstrations' ``name`` (input, output or id), checked."""
        data, starts = self.array(f"{name}_bytes").tobytes(), self.array(f"{name}_starts").tolist()
        try:
            return [data[a:z].decode() for a, z in zip(starts, starts[1:])]
        except (UnicodeDecodeError, IndexError) as e:
            raise StoreCorruptedError(f"{self.where}: {name} is not UTF-8 text ({e})") from None

    def postings(self, check: bool) -> dict[str, np.ndarray]:
        return {name: self.array(name, check) for name in text_index.SEGMENT_ARRAYS}

    def problems(self) -> list[str]:
        """Every array failing its checksum (what `verify` reports)."""
        found = []
        for name in self.layout:
            try:
                self.array(name)
            except StoreCorruptedError as e:
                found.append(str(e))
        return found


class VersionText:
    """A version's demonstrations in block order (``example_block``: each one's block, in any order), its
    blocks' ``token_ids`` (concatenated; None: the store keeps none), and what a segment of its blocks holds."""

    def __init__(self, examples: dict, example_block, token_ids, block_tokens):
        order = np.argsort(np.asarray(example_block, dtype=np.int64), kind="stable")
        self.demos = {k: [examples[k][e] for e in order.tolist()] for k in STRINGS}
        blocks = np.asarray(example_block, dtype=np.int64)[order]
        self.block_starts = np.searchsorted(blocks, np.arange(len(block_tokens) + 1))
        self.token_starts = np.concatenate(([0], np.cumsum(block_tokens))).astype(np.int64)
        if token_ids is not None and len(token_ids) != self.token_starts[-1]:
            raise ValueError(f"expected {int(self.token_starts[-1])} token ids, got {len(token_ids)}")
        self.token_ids = token_ids

    def _slices(self, first: int, count: int):
        a, z = int(self.block_starts[first]), int(self.block_starts[first + count])
        tokens = None if self.token_ids is None else np.asarray(
            self.token_ids[self.token_starts[first]:self.token_starts[first + count]])
        return [self.demos[k][a:z] for k in STRINGS], self.block_starts[first:first + count + 1] - a, tokens

    def segment_arrays(self, first: int, count: int) -> dict:
        """The arrays of a segment of blocks [first, first + count)."""
        strings, starts, tokens = self._slices(first, count)
        return segment_arrays(*strings, starts, tokens)

    def holds(self, seg: "Segment", first: int, count: int) -> bool:
        """Whether ``seg`` holds exactly the text of blocks [first, first + count): its demonstrations, blocks
        and token ids (a kept segment must)."""
        strings, starts, tokens = self._slices(first, count)
        if seg.has("token_ids") != (tokens is not None) or (tokens is not None and
                                                              not np.array_equal(seg.array("token_ids"), tokens)):
            return False
        return np.array_equal(seg.array("block_starts"), starts) and [seg.strings(k) for k in STRINGS] == strings


def plan(previous_blocks: list[int], kept_at, demos_per_block: list[int]) -> list[tuple]:
    """The new version's segments, as ``("keep", k)`` (the previous version's segment k, whose blocks are
    all unchanged) and ``("new", first block, blocks)``, in block order.

    ``previous_blocks``: how many blocks each previous segment holds; ``kept_at(k)``: the new block at which
    segment k's blocks all reappear unchanged and in order (demonstrations and token ids), or None. Blocks
    no kept segment covers form new segments of at most `segment_demos` demonstrations; a kept segment of
    under half that size just before such a run joins it (rewritten), so appends leave no trail of small
    segments.
    """
    limit = segment_demos(sum(demos_per_block))
    starts = {}
    for k, count in enumerate(previous_blocks):
        at = kept_at(k)
        if at is not None:
            starts[at] = (k, count)
    out, b, n = [], 0, len(demos_per_block)
    while b < n:
        if b in starts:
            k, count = starts[b]
            out.append(("keep", k, b, count))
            b += count
            continue
        run_start = b
        while b < n and b not in starts:
            b += 1
        if out and out[-1][0] == "keep" and sum(demos_per_block[out[-1][2]:run_start]) < limit // 2:
            run_start = out.pop()[2]
        out += [("new", a, z - a) for a, z in split(demos_per_block, run_start, b, limit)]
    return [item[:2] if item[0] == "keep" else item for item in out]


def split(demos_per_block: list[int], start: int, stop: int, limit: int) -> list[tuple[int, int]]:
    """Blocks [start, stop) cut into runs of whole blocks holding at most ``limit`` demonstrations each."""
    runs, a, held = [], start, 0
    for b in range(start, stop):
        if b > a and held + demos_per_block[b] > limit:
            runs.append((a, b))
            a, held = b, 0
        held += demos_per_block[b]
    if stop > a:
        runs.append((a, stop))
    return runs
