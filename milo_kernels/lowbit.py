"""INT4/INT2 segments (KIVI-style scale spans, docs/format.md) back to floating factors, in plain PyTorch.

The Triton kernel reads these segments in place (`reconstruct.py`); this expansion is the CPU and
reference path: a low-bit layer becomes packed fp16 factors and a matching segment table, rebuilt by
the floating CPU path or the reference (one fp16 copy of the layer's factors, 4× (int4) or 8× (int2)
the streamed bytes). A raw segment (rank RAW_RANK) is a low-bit A of d columns without Σ and B; it
becomes a floating raw segment, X [T, d], so those paths need nothing else.
"""
import torch

from milo_format import (SCALE_SPAN, LOWBIT_HEADER, QUANT_BITS, RAW_RANK, lowbit_code_bytes, lowbit_rows,
                         lowbit_scale_bytes, segment_size)

LOWBIT_BITS = {quant: bits for quant, bits in QUANT_BITS.items() if bits < 8}  # what this module expands


def _dequantize_a(scales: torch.Tensor, packed: torch.Tensor, columns: int, tokens: int, bits: int, kind: int):
    """fp32 A [T, columns] from the bytes of its scales and minima and of its codes (column by column)."""
    T, per_byte = tokens, 8 // bits
    rows = lowbit_rows(T, bits)
    params = scales.view(torch.float16).float()
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * bits
    packed = packed.view(columns, rows // per_byte)
    codes = ((packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)).reshape(columns, rows)[:, :T].T.float()
    if kind == 0:  # one scale and minimum per column and span of SCALE_SPAN tokens
        spans = -(-T // SCALE_SPAN)
        a_scale, a_min = params.view(2, spans, columns)[:, torch.arange(T, device=packed.device) // SCALE_SPAN]
    else:  # one per token
        a_scale, a_min = params.view(2, T, 1)
    return codes * a_scale + a_min


def dequantize_lowbit_segment(raw: torch.Tensor, rank: int, tokens: int, d: int, bits: int, kind: int):
    """fp32 A [T, r], Σ [r], B [d, r] of one segment, from its bytes (uint8, starting at its header)."""
    r, header = rank, 2 * LOWBIT_HEADER * rank
    s, b_scale, b_min = raw[:header].view(torch.float16).float().view(LOWBIT_HEADER, r)
    at = header + lowbit_scale_bytes(r, tokens, kind)
    b = raw[at:at + d * r].view(d, r).float() * b_scale + b_min
    a_codes = raw[at + d * r:at + d * r + lowbit_code_bytes(r, tokens, bits)]
    a = _dequantize_a(raw[header:at], a_codes, r, tokens, bits, kind)
    return a, s, b


def dequantize_lowbit_raw(raw: torch.Tensor, tokens: int, d: int, bits: int, kind: int) -> torch.Tensor:
    """fp32 X [T, d] of one raw segment, from its bytes (uint8, starting at its scales)."""
    at = lowbit_scale_bytes(d, tokens, kind)
    return _dequantize_a(raw[:at], raw[at:at + lowbit_code_bytes(d, tokens, bits)], d, tokens, bits, kind)


def dequantize_lowbit_layer(factors: torch.Tensor, segments: torch.Tensor, d: int,
                            quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed floating factors, segment table) equal to a layer of low-bit segments, on factors' device.

    The new table keeps every row's rank, tokens, destination, head and kind; only src_offset moves
    to where the segment's A, Σ, B (a raw segment's X) now start in the floating buffer (docs/format.md).
    """
    if quant not in LOWBIT_BITS:
        raise ValueError(f"unknown low-bit quantization {quant!r}; expected one of {tuple(LOWBIT_BITS)}")
    if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != 6:
        raise ValueError(f"segments must be int64 [S, 6], got {segments.dtype} {tuple(segments.shape)}")
    bits = LOWBIT_BITS[quant]
    parts, table, at = [], segments.clone(), 0
    for i, (src, rank, tokens, _, _, kind) in enumerate(segments.tolist()):
        table[i, 0] = at
        if rank == 0:
            continue
        end = src + segment_size(rank, tokens, d, bits, kind)
        if src < 0 or src % 2 or end > factors.numel():
            raise ValueError(f"segment {i} {segments[i].tolist()}: its {quant} bytes [{src}, {end}) are not an "
                             f"even-aligned range of the {factors.numel()} factor bytes")
        raw = factors[src:end]
        if rank == RAW_RANK:
            parts.append(dequantize_lowbit_raw(raw, tokens, d, bits, kind).reshape(-1))
        else:
            a, s, b = dequantize_lowbit_segment(raw, rank, tokens, d, bits, kind)
            parts += [a.reshape(-1), s, b.reshape(-1)]
        at += segment_size(rank, tokens, d, 0, kind)
    flat = torch.cat(parts).half() if parts else torch.empty(0, dtype=torch.float16, device=factors.device)
    return flat, table
