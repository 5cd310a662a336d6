"""INT4/INT2 segments (KIVI-style groups, docs/format.md) back to floating factors, in plain PyTorch.

The Triton kernel reads these segments in place (`reconstruct.py`); this expansion is the CPU and
reference path: a low-bit layer becomes packed fp16 factors and a matching segment table, rebuilt by
the floating CPU path or the reference (one fp16 copy of the layer's factors, 4× (int4) or 8× (int2)
the streamed bytes).
"""
import torch

BITS = {"int4": 4, "int2": 2}
GROUP_TOKENS = 32  # must equal milo_store.layout.GROUP_TOKENS (checked by tests)


def _padded_rows(tokens: int, per_byte: int) -> int:
    """A's rows once padded so that every column fills an even number of bytes."""
    return -(-tokens // (2 * per_byte)) * 2 * per_byte


def lowbit_segment_bytes(rank, tokens, d: int, bits: int, kind):
    """Size of one segment (docs/format.md); zero at rank zero. Takes ints or int64 tensors (elementwise)."""
    per_byte = 8 // bits
    rows = _padded_rows(tokens, per_byte)
    params = 4 * rank * -(-tokens // GROUP_TOKENS) * (kind == 0) + 4 * tokens * (kind != 0)
    return (rank * (6 + d + rows // per_byte) + params) * (rank > 0)


def dequantize_lowbit_segment(raw: torch.Tensor, rank: int, tokens: int, d: int, bits: int, kind: int):
    """fp32 A [T, r], Σ [r], B [d, r] of one segment, from its bytes (uint8, starting at its header)."""
    r, T, per_byte = rank, tokens, 8 // bits
    rows = _padded_rows(T, per_byte)
    header = raw[:6 * r].view(torch.float16).float().view(3, r)
    s, b_scale, b_min = header
    groups = -(-T // GROUP_TOKENS)
    n_params = 4 * r * groups if kind == 0 else 4 * T
    params = raw[6 * r:6 * r + n_params].view(torch.float16).float()
    at = 6 * r + n_params
    b = raw[at:at + d * r].view(d, r).float() * b_scale + b_min
    packed = raw[at + d * r:at + d * r + r * rows // per_byte].view(r, rows // per_byte)
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=raw.device) * bits
    codes = ((packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)).reshape(r, rows)[:, :T].T.float()
    if kind == 0:  # one scale and minimum per column and group of GROUP_TOKENS tokens
        a_scale, a_min = params.view(2, groups, r)[:, torch.arange(T, device=raw.device) // GROUP_TOKENS]
    else:  # one per token
        a_scale, a_min = params.view(2, T, 1)
    a = codes * a_scale + a_min
    return a, s, b


def dequantize_lowbit_layer(factors: torch.Tensor, segments: torch.Tensor, d: int,
                            quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed floating factors, segment table) equal to a layer of low-bit segments, on factors' device.

    The new table keeps every row's rank, tokens, destination, head and kind; only src_offset moves
    to where the segment's A, Σ, B now start in the floating buffer (docs/format.md).
    """
    if quant not in BITS:
        raise ValueError(f"unknown low-bit quantization {quant!r}; expected one of {tuple(BITS)}")
    if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != 6:
        raise ValueError(f"segments must be int64 [S, 6], got {segments.dtype} {tuple(segments.shape)}")
    bits = BITS[quant]
    parts, table, at = [], segments.clone(), 0
    for i, (src, rank, tokens, _, _, kind) in enumerate(segments.tolist()):
        table[i, 0] = at
        if rank == 0:
            continue
        end = src + lowbit_segment_bytes(rank, tokens, d, bits, kind)
        if src < 0 or src % 2 or end > factors.numel():
            raise ValueError(f"segment {i} {segments[i].tolist()}: its {quant} bytes [{src}, {end}) are not an "
                             f"even-aligned range of the {factors.numel()} factor bytes")
        raw = factors[src:end]
        a, s, b = dequantize_lowbit_segment(raw, rank, tokens, d, bits, kind)
        parts += [a.reshape(-1), s, b.reshape(-1)]
        at += rank * (tokens + d + 1)
    flat = torch.cat(parts).half() if parts else torch.empty(0, dtype=torch.float16, device=factors.device)
    return flat, table
