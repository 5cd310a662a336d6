"""Rate–distortion pieces for codecs past 4×: per-column quantization at any width, bit allocation by
measured distortion, a corpus transform (mean + PCA basis), fixed-width packing and its entropy coding.

The issue 45 study (`milo_infer.evaluation.rd_study`) compares today's low-rank codec with these; a
store codec built on them would reuse them unchanged. Everything here is plain tensor math on one
*unit* axis U (a (layer, kind, head) triple, or a (block, layer, kind, head) one), no model, no store.

A column c [T] of coefficients stored at ``bits`` b > 0 keeps one fp16 minimum and scale
(`SCALE_BYTES`) and T codes of b bits, packed column by column (`pack_columns`); at b = 0 it is
dropped (read back as zeros). Allocation picks one width per column under a byte budget so as to
minimise the summed squared error measured at every width (`allocate_bits`): reverse water-filling
with measured distortion instead of the Gaussian log-variance rule. The error may be measured plainly
(`column_errors`) or as attention sees it (`attended_column_errors`), which for values is what counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

WIDTHS = (0, 1, 2, 3, 4, 5, 6, 8)  # code widths a column may take; 0 drops it
SCALE_BYTES = 4  # fp16 minimum and scale of a stored column


def quantize_columns(c: torch.Tensor, bits) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8 < 2**b), fp16 scale and fp16 minimum of each column of c [..., T, n] at widths
    ``bits`` [..., n] (or an int); a column at width 0 gets code 0, scale 0 and minimum 0."""
    c = c.float()
    bits = torch.as_tensor(bits, dtype=torch.int64).expand(c.shape[:-2] + c.shape[-1:])
    top = (2 ** bits - 1).clamp_min(1).float()
    low = c.amin(dim=-2).half()
    scale = ((c.amax(dim=-2) - low.float()) / top).clamp_min(torch.finfo(torch.float16).tiny).half()
    codes = torch.round((c - low.float().unsqueeze(-2)) / scale.float().unsqueeze(-2))
    codes = torch.minimum(codes.clamp_min(0), top.unsqueeze(-2)).to(torch.uint8)
    dropped = bits == 0
    codes = codes.masked_fill(dropped.unsqueeze(-2), 0)
    return codes, scale.masked_fill(dropped, 0), low.masked_fill(dropped, 0)


def dequantize_columns(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """codes * scale + minimum per column, fp32 (a dropped column reads back as zeros)."""
    return codes.float() * scale.float().unsqueeze(-2) + low.float().unsqueeze(-2)


def roundtrip_columns(c: torch.Tensor, bits) -> torch.Tensor:
    """c [..., T, n] as read back after storing its columns at ``bits``."""
    return dequantize_columns(*quantize_columns(c, bits))


def column_errors(c: torch.Tensor, widths=WIDTHS) -> torch.Tensor:
    """Squared error of each column of c [..., T, n] stored at each width: [..., n, len(widths)], fp64."""
    c = c.float()
    return torch.stack([(roundtrip_columns(c, w) - c).double().pow(2).sum(-2) for w in widths], dim=-1)


def attended_column_errors(c: torch.Tensor, probs: torch.Tensor, widths=WIDTHS) -> torch.Tensor:
    """Squared error of each column of c [..., T, n] at each width as attention weights ``probs``
    [..., M, T] see it, ‖P (ĉ_j - c_j)‖²: [..., n, len(widths)], fp64.

    For values in an orthonormal (weighted) basis this is exactly the weighted attention output's error,
    column by column: rounding noise that attention averages away costs little, a dropped column's
    structured error (the content attention picks out) its full size. With P = I it is `column_errors`.
    """
    c = c.float()
    p = probs.float()
    return torch.stack([(p @ (roundtrip_columns(c, w) - c)).double().pow(2).sum(-2) for w in widths], dim=-1)


@dataclass
class ContextAttention:
    """Calibration queries' attention in one layer over a block placed in the context the model answers
    from (the anchor and several blocks): ``probs`` [H, M, T] on the block's tokens, ``output`` [H, M, d]
    the whole context's attention output (values unweighted), ``score_gradient(directions [H, n, d])``
    [H, M, T, n]: how each query's score on each token moves per unit of a pre-RoPE key direction."""
    probs: torch.Tensor
    output: torch.Tensor
    score_gradient: Callable[[torch.Tensor], torch.Tensor]


def attended_key_errors(c: torch.Tensor, grad: torch.Tensor, probs: torch.Tensor, values: torch.Tensor,
                        output: torch.Tensor, widths=WIDTHS) -> torch.Tensor:
    """Squared error of the attention output ``output`` [..., M, e] when key coefficients c [..., T, n] are
    stored at each width (``widths[0]`` = 0: dropped): [..., n, len(widths)], fp64, in the units of
    `attended_column_errors` over ``values`` [..., T, e] (so keys and values can share one budget).

    A score error Δs moves the output, to first order, by Σₜ Pₜ (Δsₜ - Σ P Δs) vₜ = Σₜ Pₜ Δsₜ (vₜ - O);
    column j's coefficient error δc moves query m's score on token t by δcₜ ``grad`` [m, t, j] (∂score/∂cⱼ
    at token t, RoPE included). A dropped column's error (δc = -c, structured) is summed exactly; rounding
    noise, nearly independent across tokens, by its expectation Σₜ δcₜ² Σₘ (Pₘₜ gₘₜⱼ)² ‖vₜ - Oₘ‖².
    """
    if widths[0] != 0:
        raise ValueError("the first width must be 0 (a dropped column)")
    c, p, values, output = c.float(), probs.float(), values.float(), output.float()
    a = p.unsqueeze(-1) * grad.float()  # [..., M, T, n]
    x = a * c.unsqueeze(-3)
    moved = torch.einsum("...mtn,...te->...mne", x, values) - x.sum(-2).unsqueeze(-1) * output.unsqueeze(-2)
    dropped = moved.double().pow(2).sum((-3, -1))  # [..., n]
    spread = (values.unsqueeze(-3) - output.unsqueeze(-2)).pow(2).sum(-1)  # [..., M, T]
    weight = torch.einsum("...mtn,...mt->...tn", a.pow(2), spread).double()
    rounded = [(weight * (roundtrip_columns(c, w) - c).double().pow(2)).sum(-2) for w in widths[1:]]
    return torch.stack([dropped, *rounded], dim=-1)


def column_bytes(tokens, bits):
    """Bytes of a column of ``tokens`` coefficients at width ``bits`` (0 when dropped): packed codes
    plus its minimum and scale. Works elementwise on ints and numpy arrays."""
    bits = np.asarray(bits, dtype=np.int64)
    return np.where(bits > 0, -(-np.asarray(tokens, dtype=np.int64) * bits // 8) + SCALE_BYTES, 0)


def allocate_bits(errors, costs, budget: float) -> np.ndarray:
    """One width index per ladder, minimising the summed error under ``budget`` bytes.

    ``errors`` and ``costs`` [M, W]: each of M independent choices (a column) at each of W options,
    option 0 the cheapest (cost 0 for a dropped column). Each ladder's options are reduced to its
    lower convex hull (cost up, error strictly down); the hull steps of every ladder are taken in order
    of error removed per byte for as long as the running total fits. Taking a prefix of one fixed order
    makes the error never rise with the budget; the spend never exceeds it (the cheapest options
    must fit: else ValueError). Returns int64 [M].
    """
    errors, costs = np.asarray(errors, dtype=np.float64), np.asarray(costs, dtype=np.float64)
    if errors.shape != costs.shape or errors.ndim != 2:
        raise ValueError(f"errors {errors.shape} and costs {costs.shape} must both be [choices, options]")
    M, W = errors.shape
    base = costs[:, 0].sum()
    if base > budget:
        raise ValueError(f"a budget of {budget:.0f} bytes cannot hold even the cheapest options ({base:.0f})")
    current = np.zeros(M, dtype=np.int64)
    rows = np.arange(M)
    steps_from, steps_to, rates = [], [], []
    live = np.ones(M, dtype=bool)
    for _ in range(W - 1):  # each hull step moves to a strictly costlier option
        c0, e0 = costs[rows, current], errors[rows, current]
        dc, de = costs - c0[:, None], errors - e0[:, None]
        slope = np.where(dc > 0, de / np.where(dc > 0, dc, 1.0), np.inf)
        nxt = slope.argmin(1)
        best = slope[rows, nxt]
        live &= best < 0
        if not live.any():
            break
        steps_from.append(np.where(live, current, -1))
        steps_to.append(np.where(live, nxt, -1))
        rates.append(np.where(live, -best, 0.0))
        current = np.where(live, nxt, current)
    choice = np.zeros(M, dtype=np.int64)
    if not steps_to:
        return choice
    to = np.stack(steps_to, 1)  # [M, S]
    rate = np.stack(rates, 1)
    frm = np.stack(steps_from, 1)
    ladder, step = np.nonzero(to >= 0)
    step_cost = costs[ladder, to[ladder, step]] - costs[ladder, frm[ladder, step]]
    order = np.lexsort((step, ladder, -rate[ladder, step]))  # a ladder's hull rates fall: its steps stay in order
    spent = base + np.cumsum(step_cost[order])
    take = int(np.searchsorted(spent, budget, side="right"))
    taken = order[:take]
    np.maximum.at(choice, ladder[taken], to[ladder[taken], step[taken]])
    return choice


@dataclass
class Transform:
    """Per unit u: a mean [U, d] and an orthonormal basis [U, d, d] (columns, largest variance first) of
    the weighted, centred rows (X - mean) diag(weight); ``variance`` [U, d] along each column."""
    mean: torch.Tensor
    basis: torch.Tensor
    weight: torch.Tensor
    variance: torch.Tensor

    def stored_bytes(self) -> int:
        """What a store keeps of it, in fp16: the mean and the decoding matrix basisᵀ diag(1/weight)."""
        U, d = self.mean.shape
        return 2 * U * d * (d + 1)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Coefficients [U, T, d] of rows x [U, T, d]."""
        return ((x.float() - self.mean.unsqueeze(-2)) * self.weight.unsqueeze(-2)) @ self.basis

    def reconstruct(self, coefficients: torch.Tensor) -> torch.Tensor:
        """Rows [U, T, d] back from coefficients [U, T, d] (a dropped column's zeros give the mean)."""
        return (coefficients.float() @ self.basis.transpose(-1, -2)) / self.weight.unsqueeze(-2) + self.mean.unsqueeze(-2)


def fit_transform(samples: list[torch.Tensor], weight: torch.Tensor | None = None) -> Transform:
    """The mean and PCA basis of every unit's rows, from blocks ``samples`` (each [U, T_i, d]) pooled;
    ``weight`` [U, d] > 0 (default ones) weighs each channel's error (the query-aware weights)."""
    if not samples:
        raise ValueError("fitting a transform needs at least one block of rows")
    rows = torch.cat([s.double() for s in samples], dim=-2)
    U, T, d = rows.shape
    w = torch.ones(U, d, dtype=torch.float64) if weight is None else weight.double()
    if w.shape != (U, d) or not (w > 0).all():
        raise ValueError(f"weights must be positive and [units, d] = [{U}, {d}]; got {tuple(w.shape)}")
    mean = rows.mean(dim=-2)
    centred = (rows - mean.unsqueeze(-2)) * w.unsqueeze(-2)
    variance, vectors = torch.linalg.eigh(centred.transpose(-1, -2) @ centred / T)
    return Transform(mean=mean.float(), basis=vectors.flip(-1).float().contiguous(), weight=w.float(),
                     variance=variance.flip(-1).clamp_min(0).float())


def pack_columns(codes: torch.Tensor, bits) -> bytes:
    """Fixed-width packing of codes [..., T, n] at widths ``bits`` [..., n]: each stored column's T codes,
    LSB first, padded to a whole byte, columns in order (what a decoder reads at a known offset)."""
    codes = codes.reshape(-1, *codes.shape[-2:])
    bits = torch.as_tensor(bits, dtype=torch.int64).expand(codes.shape[0], codes.shape[-1])
    out = []
    for u in range(codes.shape[0]):
        for j in range(codes.shape[-1]):
            b = int(bits[u, j])
            if b:
                c = codes[u, :, j].numpy().astype(np.uint8)
                bit_rows = np.unpackbits(c[:, None], axis=1, bitorder="little")[:, :b]
                out.append(np.packbits(bit_rows.reshape(-1), bitorder="little").tobytes())
    return b"".join(out)


def unpack_columns(data: bytes, tokens: int, bits) -> torch.Tensor:
    """Inverse of `pack_columns` for one unit's widths ``bits`` [n]: codes uint8 [tokens, n]."""
    bits = [int(b) for b in bits]
    codes = np.zeros((tokens, len(bits)), dtype=np.uint8)
    buf, pos = np.frombuffer(data, dtype=np.uint8), 0
    for j, b in enumerate(bits):
        if b:
            size = -(-tokens * b // 8)
            bit_rows = np.unpackbits(buf[pos:pos + size], bitorder="little")[:tokens * b].reshape(tokens, b)
            codes[:, j] = np.packbits(np.pad(bit_rows, ((0, 0), (0, 8 - b))), axis=1, bitorder="little")[:, 0]
            pos += size
    if pos != len(buf):
        raise ValueError(f"packed columns hold {len(buf)} bytes but widths {bits} over {tokens} tokens describe {pos}")
    return torch.from_numpy(codes)


def zstd_bytes(data: bytes, level: int = 19) -> int:
    """Size of ``data`` after Zstandard at ``level`` (numcodecs' binding): what entropy coding at rest buys."""
    from numcodecs import Zstd
    return len(Zstd(level=level).encode(data))
