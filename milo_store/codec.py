"""Block-wise low-rank codec: SVD of a block's pre-RoPE K and V per (layer, kind, head), packing at given ranks.

A block's keys and values [L, H, T, d] are stacked to [L, 2, H, T, d] and factorised in one batched
fp32 SVD: X = A diag(Σ) Bᵀ with A [T, n], Σ [n], B [d, n], n = min(T, d). Packing keeps the first
r columns of each segment in the order of ``layout.py``.
"""
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from . import quant
from .format import TORCH_DTYPES
from .layout import RAW_RANK, Layout

CODECS = ("svd", "identity")


@dataclass
class BlockFactors:
    """Factors of one block, at most max_rank columns each: A [L,2,H,T,n], S [L,2,H,n], B [L,2,H,d,n]."""
    A: torch.Tensor
    S: torch.Tensor
    B: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.A.shape[-2]


def factorize_block(keys: torch.Tensor, values: torch.Tensor, codec: str = "svd",
                    max_rank: int | None = None) -> BlockFactors:
    """Factor one block's K and V, each [L, H, T, d], in fp32.

    ``identity`` stores X itself as A with Σ = 1 and B = I: exact, and the same layout and kernel as
    ``svd``, at (T + d + 1) / T times the bytes of the raw tensor.
    """
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"keys and values must both be [layers, kv_heads, tokens, head_dim]; "
                         f"got {tuple(keys.shape)} and {tuple(values.shape)}")
    x = torch.stack((keys, values), dim=1).float()
    if not torch.isfinite(x).all():
        raise ValueError("block K/V contains NaN or Inf")
    if codec == "identity":
        d = x.shape[-1]
        eye = torch.eye(d).expand(*x.shape[:-2], d, d)
        return BlockFactors(A=x, S=torch.ones(*x.shape[:-2], d), B=eye.contiguous())
    if codec != "svd":
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    U, S, Vh = torch.linalg.svd(x, full_matrices=False)
    r = S.shape[-1] if max_rank is None else min(max_rank, S.shape[-1])
    return BlockFactors(A=U[..., :r].contiguous(), S=S[..., :r].contiguous(),
                        B=Vh[..., :r, :].transpose(-1, -2).contiguous())


def pack_block(f: BlockFactors, ranks: np.ndarray, dtype: str = "float16") -> torch.Tensor:
    """Concatenate each segment's first r columns (ranks [L, 2, H]) into one flat tensor of ``dtype``.

    ``int8``, ``int4`` and ``int2`` pack each segment's bytes as quant.py lays them out (a uint8 tensor).
    A unit at ``RAW_RANK`` is packed raw: X = A diag(Σ) Bᵀ itself (exact given full-rank factors).
    """
    tdtype = TORCH_DTYPES[dtype]
    ranks = np.asarray(ranks)
    if ranks.shape != tuple(f.S.shape[:3]):
        raise ValueError(f"ranks shape {ranks.shape} does not match factors {tuple(f.S.shape[:3])}")
    if ranks.max(initial=0) > f.S.shape[-1]:
        raise ValueError(f"rank {ranks.max()} exceeds the {f.S.shape[-1]} factor columns available")
    if ranks.min(initial=0) < RAW_RANK:
        raise ValueError(f"rank {ranks.min()} is neither a rank nor RAW_RANK ({RAW_RANK})")
    if (ranks == RAW_RANK).any() and f.S.shape[-1] < min(f.tokens, f.B.shape[-2]):
        raise ValueError("a raw unit needs the block's full-rank factors")
    if tdtype in (torch.float16, torch.uint8) and f.S.numel() and float(f.S.max()) > torch.finfo(torch.float16).max:
        raise ValueError(f"a singular value ({float(f.S.max()):.3g}) overflows float16; store bfloat16 or float32")
    parts = []
    for idx in np.ndindex(*ranks.shape):
        r = int(ranks[idx])
        if r == RAW_RANK:  # the unit's K or V itself (docs/format.md, raw segments)
            x = reconstruct(f.A[idx], f.S[idx], f.B[idx])
            parts.append(quant.pack_raw_segment(x, dtype, idx[1]) if tdtype == torch.uint8 else x.reshape(-1))
        elif tdtype == torch.uint8:
            parts.append(quant.pack_segment(f.A[idx][:, :r], f.S[idx][:r], f.B[idx][:, :r], dtype, kind=idx[1]))
        else:
            parts += [f.A[idx][:, :r].reshape(-1), f.S[idx][:r], f.B[idx][:, :r].reshape(-1)]
    return torch.cat(parts).to(tdtype) if parts else torch.empty(0, dtype=tdtype)


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


def measured_losses(f: BlockFactors, dtype: str,
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What storing a block in ``dtype`` loses, for the allocator's frontier policy (allocation.py).

    ``f``: the block's full-rank factors, A's and (diag(s) B)'s columns orthonormal (``scale`` s
    [L, 2, H, d]: the query-aware weights, or None). Returns the share of each direction's σ² its
    quantized A and B columns lose, [L, 2, H, n] (first order: ||ΔA||² + ||diag(s) ΔB||²; B is INT8 per
    column in quantized stores), and the squared error of each unit's raw form ||(X̂ - X) diag(s)||²,
    [L, 2, H], both measured by quantizing as the writer does (exactly, except that a value's INT4/INT2
    per-token groups are taken over all n columns, not the r kept).
    """
    b_dtype = "int8" if dtype in quant.QUANT_BITS else dtype
    loss, raw_error = torch.zeros(f.S.shape), torch.zeros(f.S.shape[:3])
    for l, k, h in itertools.product(*map(range, f.S.shape[:3])):
        a, b = f.A[l, k, h].float(), f.B[l, k, h].float()
        w = torch.ones(b.shape[0]) if scale is None else scale[l, k, h].float()
        da = quant.roundtrip(a, dtype, k) - a
        db = (quant.roundtrip(b, b_dtype, 0) - b) * w[:, None]
        loss[l, k, h] = da.pow(2).sum(0) + db.pow(2).sum(0)
        x = reconstruct(a, f.S[l, k, h], b)
        raw_error[l, k, h] = ((quant.roundtrip(x, dtype, k) - x) * w).pow(2).sum()
    return loss, raw_error
