"""The bits codec (issue 45): each block's query-weighted SVD, one code width per component.

Per block and unit (layer, kind, head), X diag(s) = U Σ Vᵀ with s the store's query-aware channel
weights. Component j keeps its coefficients cⱼ = Σⱼ Uⱼ [T] at a width wⱼ ∈ `WIDTHS` (0 drops it) with
one fp16 scale and minimum, and its basis column Vⱼ [d] in INT8 with one fp16 scale and minimum.
Widths are chosen for the whole store at once under the one byte budget (`plan`): every component of
every block at every width is a choice with its measured error and its bytes, `allocate_bits` takes
the cheapest error per byte first, keys and values on their own shares. A value component's error is
measured through attention when the build hands calibration attention (``value_attention``), which
the issue 45 study found to be what the attention output takes (docs/results.md).

The decoded form is fp16 low-rank segments (A = dequantized coefficients, Σ = 1, B = diag(1/s) V̂),
ranks = stored components, so every front end rebuilds it with the kernels it already has.
Block format: docs/format.md, "Bits stores"; reference decode: `bits_reference.py`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..layout import Layout, full_kv_bytes, index_bytes
from .allocation import BudgetError
from .lowrank import BlockFactors
from .quant import quantize
from .rate_distortion import (WIDTHS, ContextAttention, allocate_bits, attended_column_errors, attended_key_errors,
                               column_errors, quantize_columns)
from .bits_reference import decode_unit_reference

WIDTHS_ARRAY, WEIGHTS_ARRAY = "widths", "channel_weights"  # uint8 [N, L, 2, H, d]; float32 [L, 2, H, d]
PARAM_BYTES = 8  # fp16 coefficient scale and minimum, basis scale and minimum, per stored component


def component_bytes(tokens, widths, d: int):
    """Bytes of a stored component over ``tokens`` tokens at ``widths`` (0: none): its packed codes, its
    INT8 basis column and its four fp16 parameters. Elementwise over numpy arrays."""
    w = np.asarray(widths, dtype=np.int64)
    return np.where(w > 0, -(-np.asarray(tokens, dtype=np.int64) * w // 8) + d + PARAM_BYTES, 0)


class BitsCodec:
    name = "bits"
    stored_dtype = "int8"  # a uint8 array of bytes (fmt.TORCH_DTYPES["int8"] is uint8)
    stored_itemsize = 1
    segments_stored = False  # a block's bytes are its parts over every layer: no layer or head has a range of its own

    def __init__(self, layout: Layout, widths: np.ndarray, weights: torch.Tensor, tokens):
        if layout.quantized:
            raise ValueError("the bits codec decodes to floating factors: give it an unquantized layout")
        self.layout, self.dtype = layout, "float16"
        self.widths = np.asarray(widths, dtype=np.uint8)
        self.weights = torch.as_tensor(weights, dtype=torch.float32)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        L, H, d = layout.num_layers, layout.num_kv_heads, layout.head_dim
        if self.widths.shape != (len(self.tokens), L, 2, H, d) or self.weights.shape != (L, 2, H, d):
            raise ValueError(f"widths {self.widths.shape} and weights {tuple(self.weights.shape)} must be "
                             f"[{len(self.tokens)}, {L}, 2, {H}, {d}] and [{L}, 2, {H}, {d}]")
        if not np.isin(self.widths, WIDTHS).all():
            raise ValueError(f"code widths must be in {WIDTHS}")
        if not (torch.isfinite(self.weights).all() and (self.weights > 0).all()):
            raise ValueError("channel weights must be finite and positive")
        self.ranks = (self.widths > 0).sum(-1).astype(np.int16)
        sizes = component_bytes(self.tokens[:, None, None, None, None], self.widths, d).reshape(len(self.tokens), -1)
        self.stored_offsets = np.concatenate(([0], np.cumsum(sizes.sum(1)))).astype(np.int64)

    # -- the store's metadata ------------------------------------------------------------------------
    @classmethod
    def open(cls, meta: dict, layout: Layout, ranks, tokens, read_array) -> "BitsCodec":
        codec = cls(layout, read_array(WIDTHS_ARRAY), torch.from_numpy(np.asarray(read_array(WEIGHTS_ARRAY))), tokens)
        if not np.array_equal(codec.ranks, ranks):
            raise ValueError("the ranks array does not count the stored components of the widths array")
        return codec

    def arrays(self) -> dict:
        return {WIDTHS_ARRAY: self.widths, WEIGHTS_ARRAY: self.weights.numpy()}

    def attrs(self) -> dict:
        return {"bits": {"widths": list(WIDTHS), "mean_width": round(float(self.widths.mean()), 4) if self.widths.size else 0.0}}

    def accounting(self, itemsize: int) -> dict:
        """Every byte counted: the blocks, the channel weights, and the index (ranks, tokens, checksums, widths)."""
        blocks = int(self.stored_offsets[-1]) + self.weights.numel() * 4
        index = index_bytes(self.layout, len(self.tokens)) + self.widths.size
        full = full_kv_bytes(self.layout, self.tokens)
        return {"factor_bytes": blocks, "index_bytes": index, "total_bytes": blocks + index, "full_fp16_bytes": full,
                "ratio": (blocks + index) / full if full else 0.0}

    def summary(self) -> dict:
        """For people (`milo-store stat`): the mean code width of the stored components per layer, K and V."""
        w = self.widths.astype(np.float64)
        stored = np.maximum((w > 0).sum(axis=(0, 3, 4)), 1)  # [L, 2]
        mean = w.sum(axis=(0, 3, 4)) / stored
        return {"mean_stored_width_per_layer": {kind: [round(float(x), 2) for x in mean[:, k]]
                                                for k, kind in enumerate(("key", "value"))}}

    def same_block(self, other, i: int, j: int) -> bool:
        return bool(np.array_equal(self.widths[i], getattr(other, "widths", None)[j]) and self.tokens[i] == other.tokens[j]
                    and torch.equal(self.weights, other.weights)) if isinstance(other, BitsCodec) else False

    # -- planning ------------------------------------------------------------------------------------
    @staticmethod
    def fixed_bytes(layout: Layout, tokens, ratio: float) -> int:
        """Bytes a store of blocks of ``tokens`` tokens takes before any component: its index (widths
        included) and channel weights; BudgetError when ``ratio`` cannot hold them (checked before encoding)."""
        n = len(tokens)
        fixed = index_bytes(layout, n) + n * layout.units_per_block * layout.head_dim + layout.units_per_block * layout.head_dim * 4
        full = full_kv_bytes(layout, np.asarray(tokens, dtype=np.int64))
        if ratio * full < fixed:
            raise BudgetError(f"ratio {ratio} gives {ratio * full:.0f} bytes, but a bits store's index and channel "
                              f"weights alone need {fixed} ({fixed / full:.4f} of the fp16 K/V)")
        return fixed

    @staticmethod
    def plan_widths(factors: Callable[[int], BlockFactors], blocks: list[int], layout: Layout, weights: torch.Tensor,
                    ratio: float, key_share: float | None = 0.5,
                    value_attention: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                    read: Callable[[int], None] = lambda done: None, in_context: bool = False
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(widths uint8 [N, L, 2, H, d], tokens [N]) for ``blocks`` (N of them) so that their bytes, the
        weights' and their index's included, take at most ``ratio`` of their fp16 full K/V (an update plans
        its new blocks alone: the kept ones keep their widths). ``factors(i)``: block i's factors of
        X diag(s), B divided by s (`baselines.WeightedBlocks`). ``value_attention(i, keys)``: attention
        probabilities [L, H, M, T] of calibration queries over block i's pre-RoPE keys [L, H, T, d] (None:
        values' errors are their weighted squared errors, as keys' always are). ``in_context``: every
        component's error is the attention output's over the assembled context (``value_attention.in_context``,
        `ContextAttention`; keys through their scores, `attended_key_errors`), which ``key_share`` None (keys
        and values in one pool) needs."""
        in_context = in_context or key_share is None
        if in_context and getattr(value_attention, "in_context", None) is None:
            raise ValueError("errors measured in context (one pool for keys and values measures so) need "
                             "calibration attention in context (value_attention.in_context)")
        L, H, d = layout.num_layers, layout.num_kv_heads, layout.head_dim
        U, num_blocks = L * 2 * H, len(blocks)
        errors = np.zeros((num_blocks, L, 2, H, d, len(WIDTHS)))
        costs = np.zeros_like(errors)
        tokens = np.zeros(num_blocks, dtype=np.int64)
        for i, block in enumerate(blocks):
            c, V = _weighted_parts(factors(block), weights)
            T, n = c.shape[-2], c.shape[-1]
            tokens[i] = T
            e = column_errors(c.reshape(U, T, n)).reshape(L, 2, H, n, -1)
            if in_context:
                e = _output_errors(block, c, V, weights, value_attention.in_context)
            elif value_attention is not None:
                keys = (c[:, 0] @ V[:, 0].transpose(-1, -2)) / weights[:, 0].unsqueeze(-2)
                e[:, 1] = attended_column_errors(c[:, 1], value_attention(block, keys))
            errors[i, ..., :n, :] = e.numpy()
            costs[i, ..., :n, :] = component_bytes(T, np.array(WIDTHS), d)
            costs[i, ..., n:, 1:] = np.inf  # a block of T < d tokens has only T components
            read(i + 1)
        budget = ratio * full_kv_bytes(layout, tokens) - BitsCodec.fixed_bytes(layout, tokens, ratio)
        choice = np.zeros(errors.shape[:-1], dtype=np.int64)
        if key_share is None:  # one pool: keys' and values' errors are both the attention output's
            finite = np.where(np.isfinite(costs), costs, 1e30).reshape(-1, len(WIDTHS))
            choice[:] = allocate_bits(errors.reshape(-1, len(WIDTHS)), finite, budget).reshape(choice.shape)
            return np.array(WIDTHS, dtype=np.uint8)[choice], tokens
        for kind, share in ((0, key_share), (1, 1 - key_share)):
            e = errors[:, :, kind].reshape(-1, len(WIDTHS))
            k = costs[:, :, kind].reshape(-1, len(WIDTHS))
            finite = np.where(np.isfinite(k), k, 1e30)  # never affordable: allocate_bits leaves it dropped
            choice[:, :, kind] = allocate_bits(e, finite, budget * share).reshape(choice[:, :, kind].shape)
        return np.array(WIDTHS, dtype=np.uint8)[choice], tokens

    # -- blocks --------------------------------------------------------------------------------------
    def encode(self, i: int, f: BlockFactors) -> torch.Tensor:
        """Block i's bytes (uint8, flat) from its factors of X diag(s), B divided by s."""
        c, V = _weighted_parts(f, self.weights)
        L, _, H, T, n = c.shape
        d = self.layout.head_dim
        if T != self.tokens[i]:
            raise ValueError(f"block {i} has {T} tokens; the codec planned {self.tokens[i]}")
        w = torch.from_numpy(self.widths[i].astype(np.int64))  # [L, 2, H, d]
        if (w[..., n:] > 0).any():
            raise ValueError(f"block {i}: a width is set for a component past its {n} components")
        params, bases, codes = [], [], []
        for idx in np.ndindex(L, 2, H):
            keep = torch.nonzero(w[idx][:n]).flatten()
            if not len(keep):
                continue
            q, scale, low = quantize_columns(c[idx][:, keep], w[idx][keep])
            b, b_scale, b_low = quantize(V[idx][:, keep].float(), 0, 8)
            params.append(torch.stack((scale, low, b_scale, b_low), dim=-1))
            bases.append(b.T)
            codes.append(_pack(q.T.contiguous(), w[idx][keep]))
        if not params:
            return torch.empty(0, dtype=torch.uint8)
        head = torch.cat(params)
        if not torch.isfinite(head).all():
            raise ValueError(f"block {i}: a coefficient range overflows float16")
        out = torch.cat((head.reshape(-1).view(torch.uint8), torch.cat(bases).reshape(-1), torch.cat(codes)))
        want = int(self.stored_offsets[i + 1] - self.stored_offsets[i])
        if out.numel() != want:
            raise AssertionError(f"block {i}: encoded {out.numel()} bytes, the format says {want}")
        return out

    def parse(self, i: int, stored: torch.Tensor):
        """Block i's parts: per stored component (units then components in order) its unit index, fp16
        parameters [C, 4], basis codes [C, d] and coefficient codes [C, T]."""
        T, d = int(self.tokens[i]), self.layout.head_dim
        w = self.widths[i].reshape(-1, d)
        unit, comp = np.nonzero(w)
        cw = w[unit, comp].astype(np.int64)
        C = len(cw)
        buf = stored.numpy() if stored.dtype == torch.uint8 else stored.view(torch.uint8).numpy()
        if len(buf) != int(self.stored_offsets[i + 1] - self.stored_offsets[i]):
            raise ValueError(f"block {i}: {len(buf)} bytes, its widths describe {self.stored_offsets[i + 1] - self.stored_offsets[i]}")
        params = buf[:PARAM_BYTES * C].copy().view(np.float16).reshape(C, 4)
        basis = buf[PARAM_BYTES * C:(PARAM_BYTES + d) * C].reshape(C, d)
        sizes = -(-T * cw // 8)
        starts = (PARAM_BYTES + d) * C + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        codes = np.zeros((C, T), dtype=np.uint8)
        for b in np.unique(cw):  # every column of one width at once: its bytes, then its bits
            cols = np.nonzero(cw == b)[0]
            held = buf[starts[cols, None] + np.arange(-(-T * b // 8))]
            bits = np.unpackbits(held, axis=1, bitorder="little")[:, :T * b].reshape(len(cols), T, b)
            out = bits[..., 0].copy()
            for k in range(1, b):
                out |= bits[..., k] << k
            codes[cols] = out
        return unit, torch.from_numpy(params), torch.from_numpy(basis.copy()), torch.from_numpy(codes)

    def decode(self, i: int, stored: torch.Tensor) -> torch.Tensor:
        """Block i as fp16 low-rank segments (layout.py's order; A [T, r], Σ = 1 [r], B [d, r] per unit)."""
        T, d = int(self.tokens[i]), self.layout.head_dim
        unit, params, basis, codes = self.parse(i, stored)
        p = params.float()
        coefficients = codes.float() * p[:, :1] + p[:, 1:2]  # [C, T]
        columns = (basis.float() * p[:, 2:3] + p[:, 3:4]) / self.weights.reshape(-1, d)[torch.from_numpy(unit)]
        counts = np.bincount(unit, minlength=self.weights.numel() // d)
        parts, at = [], 0
        for r in counts:
            if r:
                parts += [coefficients[at:at + r].T.reshape(-1), torch.ones(r), columns[at:at + r].T.reshape(-1)]
                at += r
        return torch.cat(parts).half() if parts else torch.empty(0, dtype=torch.float16)

    def kernel_tables(self, i: int, layer: int, dst_row: int, base: int = 0, first: int = 0):
        """Block i's layer ``layer`` as `milo_kernels.bits` tables, so a kernel rebuilds it from the stored
        bytes with no host decode: components int64 [C, 4] (byte offsets counted from ``base``, where block
        i's stored bytes begin in the caller's buffer) and segments int64 [2 H, 6] (their component rows
        counted from ``first``, so several blocks' tables concatenate; output rows from ``dst_row``; a unit
        with no stored component is a segment of none, rebuilt as zeros as `decode` has it)."""
        T, d, H = int(self.tokens[i]), self.layout.head_dim, self.layout.num_kv_heads
        w = self.widths[i].reshape(-1, d)
        unit, comp = np.nonzero(w)
        cw = w[unit, comp].astype(np.int64)
        C, k = len(cw), np.arange(len(cw), dtype=np.int64)
        codes_at = (PARAM_BYTES + d) * C + np.concatenate(([0], np.cumsum(-(-T * cw // 8))[:-1])).astype(np.int64)
        table = np.stack((base + PARAM_BYTES * k, base + PARAM_BYTES * C + d * k, base + codes_at, cw), axis=1)
        units = layer * 2 * H
        mine = (unit >= units) & (unit < units + 2 * H)
        counts = np.bincount(unit[mine] - units, minlength=2 * H).astype(np.int64)
        starts = first + np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        segments = np.stack((starts, counts, np.full(2 * H, T), np.full(2 * H, dst_row),
                             np.tile(np.arange(H), 2), np.repeat([0, 1], H)), axis=1)
        return torch.from_numpy(table[mine].reshape(-1, 4)), torch.from_numpy(segments.astype(np.int64))

    def channel_scale(self, layer: int) -> torch.Tensor:
        """fp32 [2, H, d]: what the kernel multiplies a rebuilt unit's channels by (1 / the channel weights)."""
        return (1.0 / self.weights[layer]).contiguous()

    def decode_dense(self, i: int, stored: torch.Tensor) -> torch.Tensor:
        """Block i's pre-RoPE K/V [L, 2, H, T, d] in fp32 by the plain reference (tests hold `decode` to it)."""
        L, H, d = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        T = int(self.tokens[i])
        unit, params, basis, codes = self.parse(i, stored)
        out = torch.zeros(L * 2 * H, T, d)
        w = self.weights.reshape(-1, d)
        for u in range(L * 2 * H):
            mine = torch.from_numpy(unit == u)
            out[u] = decode_unit_reference(codes[mine], params[mine], basis[mine], w[u])
        return out.reshape(L, 2, H, T, d)


def _output_errors(block: int, c: torch.Tensor, V: torch.Tensor, weights: torch.Tensor,
                   in_context: Callable[[int, int, torch.Tensor, torch.Tensor], ContextAttention]) -> torch.Tensor:
    """Errors [L, 2, H, n, len(WIDTHS)] of every component at every width as the attention output over the
    assembled context takes them, layer by layer, in the weighted values' space (keys' and values' alike)."""
    out = []
    for layer in range(c.shape[0]):
        ck, cv, Vk, Vv = c[layer, 0], c[layer, 1], V[layer, 0], V[layer, 1]
        sk, sv = weights[layer, 0].unsqueeze(-2), weights[layer, 1].unsqueeze(-2)  # [H, 1, d]
        weighted_values = cv @ Vv.transpose(-1, -2)  # [H, T, d]
        ctx = in_context(block, layer, (ck @ Vk.transpose(-1, -2)) / sk, weighted_values / sv)
        directions = (Vk / weights[layer, 0].unsqueeze(-1)).transpose(-1, -2)  # [H, n, d]: key per unit coefficient
        keys = attended_key_errors(ck, ctx.score_gradient(directions), ctx.probs, weighted_values, ctx.output * sv)
        out.append(torch.stack((keys, attended_column_errors(cv, ctx.probs)), dim=0))
    return torch.stack(out)


def _weighted_parts(f: BlockFactors, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(coefficients Σ U [L, 2, H, T, n], orthonormal basis V [L, 2, H, d, n]) of X diag(s) from factors
    whose B is V divided by s."""
    return f.A.float() * f.S.float().unsqueeze(-2), f.B.float() * weights.unsqueeze(-1)


def _pack(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Codes [C, T] at ``widths`` [C]: each column's T codes LSB first, padded to a whole byte, in order."""
    out = []
    for row, b in zip(codes.numpy(), widths.tolist()):
        bit_rows = np.unpackbits(row[:, None], axis=1, bitorder="little")[:, :b]
        out.append(np.packbits(bit_rows.reshape(-1), bitorder="little"))
    return torch.from_numpy(np.concatenate(out))

