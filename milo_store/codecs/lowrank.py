"""The low-rank codec: SVD of a block's pre-RoPE K and V per (layer, kind, head), packing at given ranks.

A block's keys and values [L, H, T, d] are stacked to [L, 2, H, T, d] and factorised in one batched
fp32 SVD: X = A diag(Σ) Bᵀ with A [T, n], Σ [n], B [d, n], n = min(T, d). Packing keeps the first
r columns of each segment in the order of `milo_store.layout` (every store written before issue 45:
svd, identity, raw and the baselines). `LowRankCodec` is the store codec behind the codec seam; its
stored bytes *are* the decoded form (segments the kernels read in place), so `decode` returns them as
they are. Reference decode: `lowrank_reference.py`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import format as fmt
from ..format import TORCH_DTYPES
from ..layout import RAW_RANK, Layout, compressed_bytes
from . import quant
from .lowrank_reference import reconstruct

CODECS = ("svd", "identity")


@dataclass
class BlockFactors:
    """Factors of one block, at most max_rank columns each: A [L,2,H,T,n], S [L,2,H,n], B [L,2,H,d,n]; and each
    linear layer's state section, its values flat in fp32 (``states``: layer -> [LayerSpec.state_values]), which
    no codec factors."""
    A: torch.Tensor
    S: torch.Tensor
    B: torch.Tensor
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.A.shape[-2]


def factorize_block(keys: torch.Tensor, values: torch.Tensor, codec: str = "svd",
                    max_rank: int | None = None, layout: Layout | None = None) -> BlockFactors:
    """Factor one block's K and V, each [L, H, T, d] on a layout's grid, in fp32.

    ``identity`` stores X itself as A with Σ = 1 and B = I: exact, and the same layout and kernel as
    ``svd``, at (T + d + 1) / T times the bytes of the raw tensor. With a ``layout`` whose layers are not all
    alike, only the units it stores are factored, each over its own width (its factors zero past it, and an
    absent unit's zero throughout).
    """
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"keys and values must both be [layers, kv_heads, tokens, head_dim]; "
                         f"got {tuple(keys.shape)} and {tuple(values.shape)}")
    x = torch.stack((keys, values), dim=1).float()
    if not torch.isfinite(x).all():
        raise ValueError("block K/V contains NaN or Inf")
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if layout is None or layout.uniform:
        return BlockFactors(*_factors(x, codec, max_rank))
    T, d = x.shape[-2:]  # only the units the layout stores, one batched call per width, into zero-padded factors
    n = min(T, d) if codec == "svd" else d
    n = n if max_rank is None else min(max_rank, n)
    A, S, B = x.new_zeros(*x.shape[:-1], n), x.new_zeros(*x.shape[:-2], n), x.new_zeros(*x.shape[:-2], d, n)
    width = np.broadcast_to(layout.widths, layout.present.shape)
    for w in np.unique(width[layout.present]).tolist():
        units = torch.from_numpy(layout.present & (width == w))
        a, s, b = _factors(x[units][..., :w], codec, max_rank)
        A[units, :, :a.shape[-1]], S[units, :s.shape[-1]], B[units, :w, :b.shape[-1]] = a, s, b
    return BlockFactors(A=A, S=S, B=B)


def _factors(x: torch.Tensor, codec: str, max_rank: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, Σ, B) of every [T, d] matrix of ``x`` [..., T, d]: its SVD (at most ``max_rank`` columns), or ``identity``'s
    X, ones and I."""
    if codec == "identity":
        d = x.shape[-1]
        return x, torch.ones(*x.shape[:-2], d), torch.eye(d).expand(*x.shape[:-2], d, d).contiguous()
    U, S, Vh = torch.linalg.svd(x, full_matrices=False)
    r = S.shape[-1] if max_rank is None else min(max_rank, S.shape[-1])
    return U[..., :r].contiguous(), S[..., :r].contiguous(), Vh[..., :r, :].transpose(-1, -2).contiguous()


def pack_block(f: BlockFactors, ranks: np.ndarray, dtype: str = "float16", layout: Layout | None = None) -> torch.Tensor:
    """Concatenate each segment's first r columns (ranks [L, 2, H]) into one flat tensor of ``dtype``.

    ``int8``, ``int4`` and ``int2`` pack each segment's bytes as `quant` lays them out (a uint8 tensor).
    A unit at ``RAW_RANK`` is packed raw: X = A diag(Σ) Bᵀ itself (exact given full-rank factors). A ``layout``
    whose units differ in width packs each unit's B (and raw X) over its own width only, and each linear layer's
    state section after its layer's units (`Layout.state_sizes`: float16 bytes in a quantized store).
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
    widths = None if layout is None or layout.uniform else layout.widths
    stateful = [] if layout is None else np.flatnonzero(layout.state_sizes).tolist()
    if sorted(f.states) != stateful:
        raise ValueError(f"the block has states for layers {sorted(f.states)}; its layout's linear layers are {stateful}")
    parts = []
    for layer in range(len(ranks)):
        for kind, head in np.ndindex(*ranks.shape[1:]):
            idx = layer, kind, head
            r = int(ranks[idx])
            b = f.B[idx] if widths is None else f.B[idx][:widths[layer, kind, 0]]
            if r == RAW_RANK:  # the unit's K or V itself (docs/format.md, raw segments)
                x = reconstruct(f.A[idx], f.S[idx], b)
                parts.append(quant.pack_raw_segment(x, dtype, kind) if tdtype == torch.uint8 else x.reshape(-1))
            elif tdtype == torch.uint8:
                parts.append(quant.pack_segment(f.A[idx][:, :r], f.S[idx][:r], b[:, :r], dtype, kind=kind))
            else:
                parts += [f.A[idx][:, :r].reshape(-1), f.S[idx][:r], b[:, :r].reshape(-1)]
        if layer in f.states:
            parts.append(_state_section(f.states[layer], layout, layer, tdtype))
    return torch.cat([p.to(tdtype) for p in parts]) if parts else torch.empty(0, dtype=tdtype)


def _state_section(values: torch.Tensor, layout: Layout, layer: int, tdtype: torch.dtype) -> torch.Tensor:
    """A linear layer's state values as its section's stored elements: the factor dtype, or float16's bytes."""
    spec = layout.layers[layer]
    if values.shape != (spec.state_values,):
        raise ValueError(f"layer {layer}'s state has {tuple(values.shape)} values; its section holds "
                         f"{spec.state_values}")
    stored = values.to(torch.float16 if tdtype == torch.uint8 else tdtype)
    if not torch.isfinite(stored).all():
        raise ValueError(f"layer {layer}'s state is not finite in {stored.dtype} (NaN, Inf or overflow)")
    return stored.view(torch.uint8) if tdtype == torch.uint8 else stored


def measured_losses(f: BlockFactors, dtype: str, scale: torch.Tensor | None = None,
                    layout: Layout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What storing a block in ``dtype`` loses, for the allocator's frontier policy (`allocation`).

    ``f``: the block's full-rank factors, A's and (diag(s) B)'s columns orthonormal (``scale`` s
    [L, 2, H, d]: the query-aware weights, or None). Returns the share of each direction's σ² its
    quantized A and B columns lose, [L, 2, H, n] (first order: ||ΔA||² + ||diag(s) ΔB||²; B is INT8 per
    column in quantized stores), and the squared error of each unit's raw form ||(X̂ - X) diag(s)||²,
    [L, 2, H], both measured by quantizing as the writer does (exactly, except that a value's INT4/INT2
    per-token groups are taken over all n columns, not the r kept). A ``layout``'s absent units lose nothing, and
    each unit is measured over its own width.
    """
    b_dtype = "int8" if dtype in quant.QUANT_BITS else dtype
    loss, raw_error = torch.zeros(f.S.shape), torch.zeros(f.S.shape[:3])
    for l, k, h in itertools.product(*map(range, f.S.shape[:3])):
        if layout is not None and not layout.present[l, k, h]:
            continue
        width = f.B.shape[-2] if layout is None else int(layout.widths[l, k, 0])
        a, b = f.A[l, k, h].float(), f.B[l, k, h, :width].float()
        w = torch.ones(b.shape[0]) if scale is None else scale[l, k, h, :width].float()
        da = quant.roundtrip(a, dtype, k) - a
        db = (quant.roundtrip(b, b_dtype, 0) - b) * w[:, None]
        loss[l, k, h] = da.pow(2).sum(0) + db.pow(2).sum(0)
        x = reconstruct(a, f.S[l, k, h], b)
        raw_error[l, k, h] = ((quant.roundtrip(x, dtype, k) - x) * w).pow(2).sum()
    return loss, raw_error


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
        """Block i's packed segments at its ranks from its factors (`pack_block`)."""
        return pack_block(f, self.ranks[i], self.dtype, self.layout)

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
