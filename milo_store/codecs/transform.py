"""The transform codec (KVTC-style; issue 45): a corpus mean and PCA basis per unit, each component's
coefficients at one fixed width for every block, chosen under a byte budget by measured error.

A *unit* is one (layer, kind, head) triple; a block's rows are x [U, T, d]. `TransformCodec.fit` takes
sample blocks, fits the query-weighted mean and basis (`rate_distortion.fit_transform`), measures each
component's error at every width (plainly, or as the caller measures it: attention-aware errors for
values, `rate_distortion.attended_column_errors`) and allocates widths (`allocate_bits`) so that the
samples' coefficient bytes fit ``ratio`` times their fp16 bytes. The basis and mean are stored once
(`fixed_bytes`), outside the blocks.

An encoded block (`encode`): for each stored column (width > 0, units then components in order) its
fp16 scale and minimum, then each stored column's T codes packed LSB first at its width, padded to a
byte (`rate_distortion.pack_columns`). Its size depends on T only (`block_bytes`), so a reader finds
every column at a known offset and a device kernel can read the codes in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .rate_distortion import (WIDTHS, Transform, allocate_bits, column_bytes, column_errors, fit_transform,
                               pack_columns, quantize_columns, unpack_columns)
from .transform_reference import decode_reference


@dataclass
class TransformCodec:
    transform: Transform
    widths: torch.Tensor  # int64 [U, d]: each component's code width, 0 = dropped

    @classmethod
    def fit(cls, samples: list[torch.Tensor], ratio: float, weight: torch.Tensor | None = None,
            errors: torch.Tensor | None = None) -> "TransformCodec":
        """Fit on ``samples`` (blocks [U, T_i, d]) so that their coefficient bytes stay within ``ratio``
        times their fp16 bytes. ``errors`` [U, d, len(WIDTHS)]: each component's error at each width on
        the samples' coefficients as the caller measures it (default: the squared error)."""
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1]; got {ratio}")
        transform = fit_transform(samples, weight)
        U, d = transform.mean.shape
        if errors is None:
            errors = sum(column_errors(transform.project(s)) for s in samples)
        if tuple(errors.shape) != (U, d, len(WIDTHS)):
            raise ValueError(f"errors must be [units, d, widths] = [{U}, {d}, {len(WIDTHS)}]; got {tuple(errors.shape)}")
        tokens = np.array([s.shape[-2] for s in samples])
        costs = np.stack([column_bytes(tokens, w).sum() for w in WIDTHS]).astype(np.float64)
        budget = ratio * 2 * U * d * tokens.sum()
        choice = allocate_bits(errors.reshape(U * d, -1).numpy(), np.broadcast_to(costs, (U * d, len(WIDTHS))), budget)
        return cls(transform, torch.as_tensor(np.array(WIDTHS)[choice]).reshape(U, d))

    @property
    def fixed_bytes(self) -> int:
        """Bytes stored once for every block: the mean and decoding matrix in fp16."""
        return self.transform.stored_bytes()

    def block_bytes(self, tokens: int) -> int:
        """Size of an encoded block of ``tokens`` rows."""
        return int(column_bytes(tokens, self.widths.numpy()).sum())

    def encode(self, x: torch.Tensor) -> bytes:
        """The bytes of block x [U, T, d]."""
        U, d = self.widths.shape
        if x.dim() != 3 or (x.shape[0], x.shape[2]) != (U, d) or x.shape[1] == 0:
            raise ValueError(f"a block must be [units, tokens, d] = [{U}, T > 0, {d}]; got {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError("block K/V contains NaN or Inf")
        codes, scale, low = quantize_columns(self.transform.project(x), self.widths)
        stored = self.widths > 0
        header = torch.stack((scale[stored], low[stored]), dim=-1).reshape(-1)
        return header.view(torch.uint8).numpy().tobytes() + pack_columns(codes, self.widths)

    def parse(self, data: bytes, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [U, T, d], scale, minimum fp16 [U, d]) of an encoded block of ``tokens`` rows."""
        if len(data) != self.block_bytes(tokens):
            raise ValueError(f"an encoded block of {tokens} tokens holds {self.block_bytes(tokens)} bytes, not {len(data)}")
        U, d = self.widths.shape
        stored = self.widths > 0
        n = int(stored.sum())
        params = torch.frombuffer(bytearray(data[:4 * n]), dtype=torch.float16).reshape(n, 2) if n else \
            torch.zeros(0, 2, dtype=torch.float16)
        scale, low = torch.zeros(U, d, dtype=torch.float16), torch.zeros(U, d, dtype=torch.float16)
        scale[stored], low[stored] = params[:, 0], params[:, 1]
        codes, pos = torch.zeros(U, tokens, d, dtype=torch.uint8), 4 * n
        for u in range(U):
            size = int(-(-tokens * self.widths[u] // 8).sum())
            codes[u] = unpack_columns(data[pos:pos + size], tokens, self.widths[u])
            pos += size
        return codes, scale, low

    def decode(self, data: bytes, tokens: int) -> torch.Tensor:
        """Block rows [U, T, d] in fp32 back from its bytes."""
        return decode_reference(*self.parse(data, tokens), *self.stored())

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(decoder [U, d, d], mean [U, d]) as stored once, fp16 (`fixed_bytes`)."""
        t = self.transform
        return (t.basis.transpose(-1, -2) / t.weight.unsqueeze(-2)).half(), t.mean.half()
