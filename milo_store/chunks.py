"""Where a mounted version's block bytes lie: its chunk files (or objects), and each block's range in them.

Readers address a block by its bytes of the *logical* factor array (blocks back to back, the offsets
`Layout.block_offsets` gives); a placement turns such a range into pieces of chunks, and names each block
by an identity the caches key it by:

- ``EqualChunks`` (format ≤ 3): the logical array itself, cut in equal chunks ``factors/c/<i>`` of one
  version, so a block may span two, and a block is known only by its version and index.
- ``Extents`` (format 4): each block wholly inside one immutable chunk ``chunks/<id>`` at the offset the
  version's extent table gives. Versions share chunks, so a kept block's identity (chunk id, offset,
  length, CRC32C) is the same in every version that keeps it, and a cache filled by one version serves
  the next (docs/format.md, "Format 4").
"""
import secrets

import numpy as np

from . import format as fmt
from .errors import StoreCorruptedError


def new_chunk_id() -> str:
    """A chunk's name: 64 random bits, never used before, so no writer anywhere gives one name to other
    bytes, and gc never mistakes a chunk a writer is uploading now for one it collects (a name derived from
    the bytes could be an old chunk's, listed by gc just before a writer uploads it again)."""
    return secrets.token_hex(8)


def chunk_pieces(start: int, stop: int, chunk_bytes: int):
    """(chunk, start within chunk, stop within chunk, offset in the range) covering bytes [start, stop) of an
    array cut in equal chunks."""
    pos = start
    while pos < stop:
        c, within = divmod(pos, chunk_bytes)
        n = min(stop - pos, chunk_bytes - within)
        yield c, within, within + n, pos - start
        pos += n


class EqualChunks:
    """Format ≤ 3: the factor array of one version in equal chunks (the last one padded)."""

    def __init__(self, prefix: str, chunk_bytes: int, num_chunks: int, block_bytes: np.ndarray, scope: tuple):
        self.chunk_bytes, self.scope = chunk_bytes, scope  # scope: (location, version), what a block index is relative to
        self.names = [f"{prefix}{fmt.FACTORS}/c/{c}" for c in range(num_chunks)]
        self.sizes = [chunk_bytes] * num_chunks
        self.used = int(np.sum(block_bytes))

    def pieces(self, start: int, stop: int):
        return chunk_pieces(start, stop, self.chunk_bytes)

    def identity(self, block: int) -> tuple:
        return (*self.scope, block)

    def entry_name(self, block: int) -> str:
        return str(block)

    def dead_bytes(self) -> int:
        """Bytes of the chunks no block uses: the last chunk's padding."""
        return sum(self.sizes) - self.used

    def factor_chunk_bytes(self) -> int:
        return sum(self.sizes)


class Extents:
    """Format 4: block i is bytes [offset, offset + length) of chunk ``chunk_ids[chunk]`` (one extent row)."""

    def __init__(self, prefix: str, chunk_ids: list[str], chunk_sizes: np.ndarray, extents: np.ndarray,
                 offsets: np.ndarray, checksums: np.ndarray, where: str):
        """``offsets``: the logical start of each block in bytes, and the end ([N + 1]); ``where`` names the store."""
        ext = np.asarray(extents, dtype=np.int64)
        sizes = np.asarray(chunk_sizes, dtype=np.int64)
        n = len(offsets) - 1
        if ext.shape != (n, 3) or sizes.shape != (len(chunk_ids),):
            raise StoreCorruptedError(f"{where}: extent table of shape {ext.shape} and {sizes.shape} chunk sizes for "
                                      f"{n} blocks and {len(chunk_ids)} chunks")
        lengths = np.diff(offsets)
        if n and ((ext[:, 0] < 0).any() or (ext[:, 0] >= len(chunk_ids)).any() or (ext[:, 1] < 0).any()
                  or not np.array_equal(ext[:, 2], lengths) or (ext[:, 1] + ext[:, 2] > sizes[ext[:, 0]]).any()):
            raise StoreCorruptedError(f"{where}: extent table names chunks, offsets or lengths its index and chunk "
                                      "sizes contradict")
        self.ids, self.extents, self.offsets, self.checksums = list(chunk_ids), ext, offsets, checksums
        self.names = [prefix + fmt.chunk_key(c) for c in chunk_ids]
        self.sizes = sizes.tolist()

    def pieces(self, start: int, stop: int):
        """The pieces of the blocks that bytes [start, stop) of the logical array fall in."""
        b = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while b < len(self.extents) and self.offsets[b] < stop:
            lo, hi = max(start, int(self.offsets[b])), min(stop, int(self.offsets[b + 1]))
            if hi > lo:
                chunk, offset = int(self.extents[b, 0]), int(self.extents[b, 1]) - int(self.offsets[b])
                yield chunk, offset + lo, offset + hi, lo - start
            b += 1

    def identity(self, block: int) -> tuple:
        chunk, offset, length = self.extents[block].tolist()
        return ("chunk", self.ids[chunk], offset, length, int(self.checksums[block]))

    def entry_name(self, block: int) -> str:
        chunk, offset, _ = self.extents[block].tolist()
        return f"{self.ids[chunk]}-{offset}"

    def dead_bytes(self) -> int:
        """Bytes of the referenced factor chunks that no block of this version uses (an earlier encoding of a
        block that an update replaced while its chunk stayed)."""
        return sum(self.chunk_dead_bytes().values())

    def factor_chunk_bytes(self) -> int:
        """Bytes of the chunks holding this version's blocks (its text segments' chunks aside)."""
        return sum(self.sizes[c] for c in np.unique(self.extents[:, 0]).tolist())

    def chunk_dead_bytes(self) -> dict[int, int]:
        """Dead bytes of each factor chunk that has some, by its index in ``ids``."""
        used = np.bincount(self.extents[:, 0], weights=self.extents[:, 2], minlength=len(self.ids)).astype(np.int64)
        return {c: self.sizes[c] - int(used[c]) for c in np.unique(self.extents[:, 0]).tolist()
                if self.sizes[c] > used[c]}
