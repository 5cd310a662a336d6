"""Quantized factors: INT8 with one scale and minimum per factor column (FlexGen-style), and
KIVI-style INT4/INT2 whose key scales each cover a span of tokens (KIVI's groups). The formats are specified in docs/format.md.

INT8:

A and B columns are unit vectors, so one scale and minimum per column cost 8 bytes per rank unit and adds
~0.1% error where truncation adds 10-35% (docs/results.md); at equal bytes INT8 nearly doubles the
rank. Readers dequantize in place: ``milo_kernels`` (reference and the fused Triton kernel).
Segment of rank r over T tokens, d head dim (r * (T' + d + 10) bytes, T' = T rounded up to even):
``Σ, A scale, A min, B scale, B min`` (fp16 [r] each), then ``A`` codes [T', r] (a last zero row when T
is odd), ``B`` codes [d, r] (uint8). With d even every segment has an even size, so in a buffer that
starts aligned every header is 2-byte aligned, as a GPU kernel reading it in place needs.
"""
import torch

from milo_format import SCALE_SPAN, QUANT_BITS, lowbit_rows
from ..format import TORCH_DTYPES


def quantize(x: torch.Tensor, dim: int = 0, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 codes (< 2**bits), fp16 scale and fp16 minimum over ``dim`` of x; x ≈ codes * scale + minimum."""
    top = 2 ** bits - 1
    lo = x.amin(dim=dim, keepdim=True).half()
    scale = ((x.amax(dim=dim, keepdim=True) - lo.float()) / top).clamp_min(torch.finfo(torch.float16).tiny).half()
    codes = torch.round((x - lo.float()) / scale.float()).clamp(0, top).to(torch.uint8)
    return codes, scale.squeeze(dim), lo.squeeze(dim)


def quantize_token_spans(x: torch.Tensor, span: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [T, r], scale and minimum [ceil(T / span), r] of each column of x [T, r] in spans of
    ``span`` tokens (the last span padded by repeating the last row, which leaves its range alone)."""
    T, r = x.shape
    spans = -(-T // span)
    padded = torch.cat((x, x[-1:].expand(spans * span - T, r)))
    codes, scale, low = quantize(padded.view(spans, span, r), 1, bits)
    return codes.reshape(-1, r)[:T], scale, low


def quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 codes, fp16 scale, fp16 minimum of each column of x [n, r]; x ≈ codes * scale + minimum."""
    return quantize(x, 0, 8)


def pack_segment(A: torch.Tensor, S: torch.Tensor, B: torch.Tensor, quant: str = "int8", kind: int = 0) -> torch.Tensor:
    """The bytes of one quantized segment (A [T, r], S [r], B [d, r], any float dtype) of a ``kind`` unit."""
    if quant != "int8":
        return pack_lowbit_segment(A, S, B, QUANT_BITS[quant], kind)
    if A.shape[1] == 0:
        return torch.empty(0, dtype=torch.uint8)
    a, a_scale, a_min = quantize_columns(A.float())
    b, b_scale, b_min = quantize_columns(B.float())
    header = torch.stack((S.half(), a_scale, a_min, b_scale, b_min)).reshape(-1).view(torch.uint8)
    pad = a.new_zeros((A.shape[0] % 2) * A.shape[1])
    return torch.cat((header, a.reshape(-1), pad, b.reshape(-1)))


def pack_lowbit_segment(A: torch.Tensor, S: torch.Tensor, B: torch.Tensor, bits: int, kind: int) -> torch.Tensor:
    """The bytes of one INT4/INT2 segment, KIVI-style: keys per channel, values per token.

    Layout (all little-endian): fp16 Σ, B scale, B min [r]; then A's fp16 scales and minima: for a
    key [2, G, r] (one per column and span of SCALE_SPAN tokens, G = ceil(T / SCALE_SPAN)), for a
    value [2, T] (one per token, over its r columns); B codes uint8 [d, r]; A codes [r, T'] column by
    column, ``8 // bits`` consecutive tokens per byte (first token in the lowest bits), T' = T padded
    so each column fills an even number of bytes. Σ stays outside A, so A's columns are unit vectors
    and share one range: the per-token scales of a value are not dominated by its largest direction.
    """
    if A.shape[1] == 0:
        return torch.empty(0, dtype=torch.uint8)
    params, packed = _lowbit_columns(A.float(), bits, kind)
    b, b_scale, b_min = quantize(B.float(), 0, 8)
    header = torch.stack((S.half(), b_scale, b_min)).reshape(-1)
    return torch.cat((header.view(torch.uint8), params, b.reshape(-1), packed))


def _lowbit_columns(x: torch.Tensor, bits: int, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 scales and minima, packed codes) of x [T, c] as bytes: a key per channel in spans of
    SCALE_SPAN tokens ([2, G, c]), a value per token ([2, T]); codes column by column, ``8 // bits``
    tokens per byte, each column padded to an even number of bytes."""
    T, c = x.shape
    per_byte, rows = 8 // bits, lowbit_rows(T, bits)
    if kind == 0:
        codes, scale, low = quantize_token_spans(x, SCALE_SPAN, bits)
    else:
        codes, scale, low = quantize(x, 1, bits)
    codes = torch.cat((codes, codes.new_zeros(rows - T, c))).T.reshape(c, rows // per_byte, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.uint8) * bits
    packed = (codes << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bit fields: the sum is an OR
    return torch.stack((scale, low)).reshape(-1).view(torch.uint8), packed.reshape(-1)


def pack_raw_segment(x: torch.Tensor, quant: str, kind: int) -> torch.Tensor:
    """The bytes of a raw ``quant`` segment: a unit's K or V x [T, d] itself, no factors (docs/format.md).

    It is the A part of a rank-d segment whose Σ = 1 and B = I go unstored: INT8 keeps one scale and
    minimum per channel (fp16 [2, d]) then codes [T', d] (a zero last row when T is odd); INT4/INT2 keep
    KIVI's grouping (keys per channel in spans of SCALE_SPAN tokens, values per token) as a low-bit A.
    """
    x = x.float()
    if quant == "int8":
        codes, scale, low = quantize_columns(x)
        pad = codes.new_zeros((x.shape[0] % 2) * x.shape[1])
        return torch.cat((torch.stack((scale, low)).reshape(-1).view(torch.uint8), codes.reshape(-1), pad))
    params, packed = _lowbit_columns(x, QUANT_BITS[quant], kind)
    return torch.cat((params, packed))


def roundtrip(x: torch.Tensor, dtype: str, kind: int) -> torch.Tensor:
    """x [T, c] as a reader gets it back when stored as a ``dtype`` A part or raw segment of a ``kind`` unit:
    cast for floating dtypes; INT8 per column; INT4/INT2 per column in token spans (keys) or per token."""
    x = x.float()
    if dtype not in QUANT_BITS:
        return x.to(TORCH_DTYPES[dtype]).float()
    if dtype == "int8":
        return _dequantize(*quantize(x, 0, 8), 0)
    if kind == 0:
        codes, scale, low = quantize_token_spans(x, SCALE_SPAN, QUANT_BITS[dtype])
        span = torch.arange(x.shape[0]) // SCALE_SPAN
        return codes.float() * scale[span].float() + low[span].float()
    return _dequantize(*quantize(x, 1, QUANT_BITS[dtype]), 1)


def _dequantize(codes, scale, low, dim):
    return codes.float() * scale.unsqueeze(dim).float() + low.unsqueeze(dim).float()

