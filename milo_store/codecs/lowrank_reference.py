"""The low-rank codec's decode in plain PyTorch: the definition the kernels (`milo_kernels`) must agree with.

A floating block is its segments one after another, A [T, r], Σ [r], B [d, r] per (layer, kind, head)
in `milo_store.layout`'s order; each rebuilds as X = A diag(Σ) Bᵀ. Quantized segments are read by
`milo_kernels` alone.
"""
import numpy as np
import torch

from ..layout import RAW_RANK, Layout


def unpack_block(flat: torch.Tensor, layout: Layout, ranks: np.ndarray, tokens: int):
    """Inverse of pack_block for floating factors: yields ((layer, kind, head), A, S, B) views into ``flat``."""
    if layout.quantized:
        raise ValueError("unpack_block reads floating factors; quantized segments are read by milo_kernels")
    d, pos = layout.head_dim, 0
    for idx in np.ndindex(*np.asarray(ranks).shape):
        r = int(ranks[idx])
        if r == RAW_RANK:
            raise ValueError("unpack_block reads factored segments; this block has a raw unit")
        A = flat[pos:pos + tokens * r].view(tokens, r)
        S = flat[pos + tokens * r:pos + tokens * r + r]
        B = flat[pos + tokens * r + r:pos + r * (tokens + d + 1)].view(d, r)
        pos += r * (tokens + d + 1)
        yield idx, A, S, B
    if pos != flat.numel():
        raise ValueError(f"packed block holds {flat.numel()} values but its ranks describe {pos}")


def reconstruct(A: torch.Tensor, S: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A diag(Σ) Bᵀ in fp32: the one-segment definition the kernels must agree with."""
    return (A.float() * S.float()) @ B.float().transpose(-1, -2)
