"""The low-rank codec behind the codec seam: a thin adapter over `milo_store.codec`, `quant` and `layout`.

Its stored bytes *are* the decoded form (segments the kernels read in place), so `decode` returns them
as they are and every store written before the seam mounts and answers byte for byte.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import format as fmt
from ..codec import pack_block
from ..layout import Layout, compressed_bytes


class LowRankCodec:
    name = "lowrank"
    segments_stored = True  # its stored bytes are the segments, layer after layer

    def __init__(self, layout: Layout, dtype: str, ranks, tokens):
        self.layout, self.dtype = layout, dtype
        self.ranks = np.asarray(ranks, dtype=np.int16)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.stored_dtype = dtype
        self.stored_offsets = layout.block_offsets(self.ranks, self.tokens)

    def encode(self, i: int, f) -> torch.Tensor:
        """Block i's packed segments at its ranks from its factors (`codec.pack_block`)."""
        return pack_block(f, self.ranks[i], self.dtype)

    def decode(self, i: int, stored: torch.Tensor) -> torch.Tensor:
        return stored

    def arrays(self) -> dict:
        return {}

    def attrs(self) -> dict:
        return {}

    def accounting(self, itemsize: int) -> dict:
        return compressed_bytes(self.layout, self.ranks, self.tokens, itemsize)

    def summary(self) -> dict:
        return {}

    def same_block(self, other, i: int, j: int) -> bool:
        """Whether block i of this codec and block j of ``other`` (a previous version's) are encoded alike."""
        return bool(np.array_equal(self.ranks[i], other.ranks[j]) and self.tokens[i] == other.tokens[j])

    @property
    def stored_itemsize(self) -> int:
        return fmt.value_bytes(self.stored_dtype)
