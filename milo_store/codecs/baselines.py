"""The MILO paper's two low-rank baselines, in milo's own store format and byte accounting.

Both are computed in pass two from the same staged full-rank SVD factors as ``svd`` (the model runs
once for all three), and both write ordinary segments ``A [T, r], Σ [r], B [d, r]``, so the reader,
the reconstruction kernel and the byte accounting are the ones MILO uses. What differs is the
granularity of the low-rank basis:

- ``global-proj`` (Palu's granularity): one projection per (layer, kind, head) fitted on the whole
  corpus. P [d, d] holds the eigenvectors of C = Σ_b X_bᵀ X_b, largest first; a block's segment at
  rank r stores A = X_b P_r, Σ = 1, B = P_r. Every segment carries its own copy of P_r, r(d + 1)
  values, which is what MILO pays for its per-block B: the two compare at equal bytes per rank unit.
- ``example-svd`` (ASVD's granularity): every demonstration is its own SVD unit. Its store blocks are
  the demonstrations, and ``block_group`` maps each to the retrieval group (the build's block of m
  demonstrations) it was encoded in, so retrieval and the assembled context match MILO's exactly.

Query-aware weighting (``CompressionConfig.query_aware``; ``example-asvd`` in `milo eval` is
example-svd with it, as ASVD is activation-aware, and ``milo-qaw`` is MILO's blocks with it). Each
(layer, kind, head) has channel weights s [d] > 0 (how much a channel's error costs the model: from
the queries for keys, from ``o_proj`` for values; `milo_infer.models.channel_scales`). X diag(s) is
SVD'd and the allocator sees its spectrum, so rank goes where the error costs most; B' = diag(1/s) B
undoes the weighting, and the segment A Σ B'ᵀ ≈ X is an ordinary one.

A *pass-two source* is what `planning` allocates and writes from: ``num_blocks`` store blocks,
``block_group`` (or None), ``spectrum(i)`` -> (tokens, singular values [L, 2, H, n]) for allocation,
and ``factors(i)`` -> the block's BlockFactors at n columns (n is also its full rank).
"""
from typing import Protocol

import numpy as np
import torch

from .lowrank import BlockFactors, factorize_block

BASELINES = ("global-proj", "example-svd")
SCALE_FLOOR = 1e-3  # smallest channel weight, relative to its kind's largest: bounds 1/s


class StagedFactors(Protocol):
    """Pass one's staged blocks as pass two reads them (`milo_store.staging.Staging`, in the storage room)."""

    def get(self, i: int) -> BlockFactors: ...

    def spectrum(self, i: int) -> tuple[int, torch.Tensor]: ...


def dense(f: BlockFactors) -> torch.Tensor:
    """X = A diag(Σ) Bᵀ of every segment of a block: [L, 2, H, T, d] in fp32."""
    return (f.A.float() * f.S.float().unsqueeze(-2)) @ f.B.float().transpose(-1, -2)


class GlobalProjection:
    """Pass-two source of ``global-proj``: staged blocks projected on per-(layer, kind, head) eigenbases.

    The allocator sees the corpus spectrum (square roots of C's eigenvalues) as every block's spectrum,
    so within a (layer, kind, head) group all blocks rank the same directions equally and their ranks
    rise together: the uniform rank of one shared projection, up to one step where a shorter block's
    cheaper increment still fits the budget.
    """

    block_group = None

    def __init__(self, staging: StagedFactors, num_blocks: int):
        self.staging, self.num_blocks = staging, num_blocks
        self.tokens = np.zeros(num_blocks, dtype=np.int64)
        cov = None
        for i in range(num_blocks):
            x = dense(staging.get(i)).double()
            self.tokens[i] = x.shape[-2]
            gram = x.transpose(-1, -2) @ x
            cov = gram if cov is None else cov + gram
        if cov is None:
            raise ValueError("global-proj needs at least one staged block")
        eigvals, eigvecs = torch.linalg.eigh(cov)  # ascending
        self.sigma = eigvals.flip(-1).clamp_min(0).sqrt().float()  # [L, 2, H, d]
        self.P = eigvecs.flip(-1).float().contiguous()  # [L, 2, H, d, d], columns largest first

    def spectrum(self, i: int) -> tuple[int, torch.Tensor]:
        return int(self.tokens[i]), self.sigma

    def factors(self, i: int) -> BlockFactors:
        A = dense(self.staging.get(i)) @ self.P
        return BlockFactors(A=A, S=torch.ones(self.sigma.shape), B=self.P)


class ExampleSplit:
    """Pass-two source of ``example-svd``: each demonstration's rows of its staged block, SVD'd alone.

    Demonstration e sits in staged block ``example_block[e]`` with ``example_tokens[e]`` tokens;
    store blocks follow group by group (``example_block`` afterwards maps each demonstration to its
    store block). The group's dense K/V is rebuilt once and kept while its demonstrations are asked
    for in order.

    With ``channel_scale`` [L, 2, H, d] (query-aware) the rows are weighted by it before the SVD and B
    is divided by it after (see `weights`, which ``present`` is for).
    """

    def __init__(self, staging: StagedFactors, example_block: list[int], example_tokens: list[int], num_groups: int,
                 channel_scale: torch.Tensor | None = None, present: np.ndarray | None = None):
        self.staging = staging
        per_group, self.example_block = split_examples(example_block, example_tokens, num_groups)
        if any(not t or min(t) < 1 for t in per_group):
            raise ValueError("example-svd: every block needs demonstrations of at least one token each")
        self.example_tokens = per_group
        self.block_group = np.repeat(np.arange(num_groups, dtype=np.int32), [len(t) for t in per_group])
        self.starts = [s for t in per_group for s in np.concatenate(([0], np.cumsum(t)[:-1])).tolist()]
        self.tokens = np.array([x for t in per_group for x in t], dtype=np.int64)
        self.num_blocks = len(self.tokens)
        self.scale = None if channel_scale is None else weights(channel_scale, present)
        self._group, self._x = None, None

    def _rows(self, j: int) -> torch.Tensor:
        """Demonstration j's rows [L, 2, H, T_j, d], weighted by the channel scale when there is one."""
        g = int(self.block_group[j])
        if self._group != g:
            x = dense(self.staging.get(g))
            if x.shape[-2] != sum(self.example_tokens[g]):
                raise ValueError(f"example-svd: staged block {g} holds {x.shape[-2]} tokens but its demonstrations "
                                 f"{sum(self.example_tokens[g])}")
            self._group, self._x = g, weigh(x, self.scale)
        start = int(self.starts[j])
        return self._x[..., start:start + int(self.tokens[j]), :]

    def spectrum(self, j: int) -> tuple[int, torch.Tensor]:
        return int(self.tokens[j]), torch.linalg.svdvals(self._rows(j))

    def factors(self, j: int) -> BlockFactors:
        x = self._rows(j)
        return unweigh(factorize_block(x[:, 0], x[:, 1], codec="svd"), self.scale)


class WeightedBlocks:
    """Pass-two source of query-aware ``svd``: each staged block's X diag(s), SVD'd, B divided by s.

    Pass two asks every block's spectrum, then every block's factors: the last block's weighted K/V
    is kept between the two calls for it. ``present``: the units the layout stores (see `weights`).
    """

    block_group = None

    def __init__(self, staging: StagedFactors, num_blocks: int, channel_scale: torch.Tensor,
                 present: np.ndarray | None = None):
        self.staging, self.num_blocks, self.scale = staging, num_blocks, weights(channel_scale, present)
        self._i, self._x, self._states = None, None, {}

    def _weighted(self, i: int) -> torch.Tensor:
        if self._i != i:
            staged = self.staging.get(i)
            self._i, self._x, self._states = i, weigh(dense(staged), self.scale), staged.states
        return self._x

    def spectrum(self, i: int) -> tuple[int, torch.Tensor]:
        x = self._weighted(i)
        return x.shape[-2], torch.linalg.svdvals(x)

    def factors(self, i: int) -> BlockFactors:
        """Block i's factors of X from those of X diag(s), and its linear layers' state sections as staged."""
        x = self._weighted(i)
        factors = unweigh(factorize_block(x[:, 0], x[:, 1], codec="svd"), self.scale)
        factors.states = self._states
        return factors


def weigh(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """X diag(s) for every segment of x [L, 2, H, T, d] (x itself without a scale)."""
    if scale is None:
        return x
    if scale.shape != x.shape[:3] + x.shape[-1:]:
        raise ValueError(f"query-aware: channel scale {tuple(scale.shape)} does not match the staged "
                         f"[L, 2, H, d] = {tuple(x.shape[:3] + x.shape[-1:])}")
    return x * scale.unsqueeze(-2)


def unweigh(f: BlockFactors, scale: torch.Tensor | None) -> BlockFactors:
    """Factors of X from factors of X diag(s): B' = diag(1/s) B."""
    if scale is not None:
        f.B = f.B / scale.unsqueeze(-1)
    return f


def weights(channel_scale: torch.Tensor, present: np.ndarray | None = None) -> torch.Tensor:
    """Query-aware channel weights [L, 2, H, d] from raw per-channel statistics.

    Each kind (K, V) is divided by its largest statistic and floored at SCALE_FLOOR. A common factor
    does not change the weighted minimiser; weights in [SCALE_FLOOR, 1] keep the weighted Σ at or
    under the unweighted one (no fp16 overflow example-svd would not have) and B' = diag(1/s) B within
    1/SCALE_FLOOR of an orthonormal B, while heads and layers keep their relative weights (which the
    layer and global allocation scopes compare).

    ``present`` [L, 2, H] (`Layout.present`; None: every unit) says which units the layout stores. A kind
    it stores in no layer (an MLA layout's values: its latent is stored as keys) has no statistics to weigh
    by: its scales may be all zero, and its weights are 1. A kind it stores needs some scale above zero.
    """
    s = torch.as_tensor(channel_scale, dtype=torch.float32)
    if s.dim() != 4 or s.shape[1] != 2:
        raise ValueError(f"query-aware: channel scale must be [layers, 2, kv_heads, head_dim]; got {tuple(s.shape)}")
    stored = (torch.ones(2, dtype=torch.bool) if present is None
              else torch.from_numpy(np.asarray(present, dtype=bool).any(axis=(0, 2))))
    top = s.amax(dim=(0, 2, 3), keepdim=True)
    if not torch.isfinite(s).all() or (s < 0).any() or not (top.flatten()[stored] > 0).all():
        raise ValueError("query-aware: channel scales must be finite, non-negative, and not all zero for a kind "
                         "the layout stores (keys or values)")
    return torch.where(top > 0, (s / top).clamp_min(SCALE_FLOOR), torch.ones(()))


def split_examples(example_block: list[int], example_tokens: list[int], num_groups: int) -> tuple[list[list[int]], list[int]]:
    """Per group, its demonstrations' token counts in listed order; and each demonstration's store block.

    Demonstrations are listed as the build laid them into their blocks (a block's tokens are its
    demonstrations' tokens in that order); store blocks follow group by group.
    """
    if len(example_block) != len(example_tokens):
        raise ValueError("example-svd needs one token count per demonstration")
    members = [[] for _ in range(num_groups)]
    for e, g in enumerate(example_block):
        if not 0 <= g < num_groups:
            raise ValueError(f"demonstration {e} names block {g}; the staging holds {num_groups}")
        members[g].append(e)
    store_block = [0] * len(example_block)
    for j, e in enumerate(e for m in members for e in m):
        store_block[e] = j
    return [[int(example_tokens[e]) for e in m] for m in members], store_block
