"""Plain-PyTorch references: short and obviously right. The oracle for tests and the CPU path."""
import torch

from milo_format import INT8_HEADER, RAW_RANK, segment_size


def rotate(x: torch.Tensor, interleaved: bool = False, rotary_dim: int | None = None) -> torch.Tensor:
    """The RoPE partner of each channel: rotate-half (HF Llama/Qwen) or interleaved pairs (GPT-J).

    ``rotary_dim``: rotate-half over only the first ``rotary_dim`` channels, pairs (j, j + rotary_dim/2) (GLM-4.5,
    Phi-2, StableLM): the channels after them have no partner (0). None: the whole head."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    x1, x2 = x[..., :r // 2], x[..., r // 2:r]
    return torch.cat((-x2, x1, torch.zeros_like(x[..., r:])), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
               rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate x [..., T, d] by full-width tables cos, sin [T, d] (computed in fp32, returned in x's dtype); the
    layout is ``interleaved`` and ``rotary_dim``'s (`rotate`). A partial rotary's tables are the identity (cos 1,
    sin 0) on the channels it does not turn."""
    xf = x.float()
    return (xf * cos + rotate(xf, interleaved, rotary_dim) * sin).to(x.dtype)


def raw_segment(factors: torch.Tensor, src: int, tokens: int, d: int) -> torch.Tensor:
    """fp32 X [T, d] of the raw segment at factors[src:]: its values, or (uint8) INT8 codes [T', d] after
    an fp16 scale [d] and minimum [d] per channel, value = code * scale + min (docs/format.md)."""
    if factors.dtype != torch.uint8:
        return factors[src:src + tokens * d].float().view(tokens, d)
    scale, low = factors[src:src + 4 * d].view(torch.float16).float().view(2, d)
    return factors[src + 4 * d:src + (4 + tokens) * d].view(tokens, d).float() * scale + low


def dequantize_int8_segment(raw: torch.Tensor, rank: int, tokens: int, d: int):
    """fp32 A [T, r], Σ [r], B [d, r] of one INT8 segment, from its bytes (uint8, starting at the header).

    Layout: fp16 Σ, A scale, A min, B scale, B min (each [r]), A codes [T', r] (last row padding when
    T is odd), B codes [d, r]; value = code * scale + min per column.
    """
    header = raw[:2 * INT8_HEADER * rank].view(torch.float16).float().view(INT8_HEADER, rank)
    s, a_scale, a_min, b_scale, b_min = header
    codes = raw[2 * INT8_HEADER * rank:]
    b_at = (tokens + tokens % 2) * rank
    a = codes[:tokens * rank].view(tokens, rank).float() * a_scale + a_min
    b = codes[b_at:b_at + d * rank].view(d, rank).float() * b_scale + b_min
    return a, s, b


def reconstruct_layer_naive(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, rotary_dim=None) -> None:
    """Rebuild each segment as X = A diag(Σ) Bᵀ in fp32, rotate keys at their output rows, write in place.

    A segment row is (src_offset, rank, tokens, dst_row, head, kind); its factors are packed at
    factors[src_offset:] as A [tokens, rank], Σ [rank], B [d, rank], all row-major. uint8 factors hold
    INT8 segments instead (`dequantize_int8_segment`; src_offset counts bytes). A raw segment (rank
    RAW_RANK) holds X itself (`raw_segment`). Inputs are not validated here
    (milo_kernels.reconstruct_layer does that); this is the oracle, kept literal.
    """
    d = out_k.shape[-1]
    for src, rank, tokens, row, head, kind in segments.tolist():
        if rank == RAW_RANK:
            x = raw_segment(factors, src, tokens, d)
        else:
            if factors.dtype == torch.uint8:
                raw = factors[src:src + segment_size(rank, tokens, d, 8, kind)]
                a, s, b = dequantize_int8_segment(raw, rank, tokens, d)
            else:
                a_end, s_end = src + tokens * rank, src + tokens * rank + rank
                a = factors[src:a_end].float().view(tokens, rank)
                s = factors[a_end:s_end].float()
                b = factors[s_end:s_end + d * rank].float().view(d, rank)
            x = (a * s) @ b.T
        rows = slice(row, row + tokens)
        if kind == 0:
            x = apply_rope(x, cos[rows], sin[rows], interleaved, rotary_dim)
        out = out_k if kind == 0 else out_v
        out[head, rows] = x.to(out.dtype)


def unpack_codes(data: torch.Tensor, offset: torch.Tensor, width: torch.Tensor, tokens: int) -> torch.Tensor:
    """int64 codes [C, T] of C components, each T codes of ``width`` [C] bits at byte ``offset`` [C] of
    ``data`` (uint8), least significant bit first, token after token."""
    bit = torch.arange(tokens)[None, :, None] * width[:, None, None] + torch.arange(8)  # [C, T, 8]
    used = torch.arange(8) < width[:, None, None]
    byte = torch.where(used, offset[:, None, None] + bit // 8, offset[:, None, None])
    bits = (data[byte].long() >> (bit % 8)) & 1
    return (bits * used << torch.arange(8)).sum(-1)


def reconstruct_bits_layer_naive(data, components, segments, channel_scale, out_k, out_v, cos, sin, *,
                                 interleaved=False, rotary_dim=None) -> None:
    """X = Σⱼ (codeⱼ · scaleⱼ + minⱼ)(basisⱼ · b_scaleⱼ + b_minⱼ)ᵀ of each segment in fp32, channels times
    channel_scale[kind, head], keys rotated at their output rows (milo_kernels.bits documents the tables).
    Inputs are not validated here (`bits.reconstruct_bits_layer` does that); this is the oracle, kept literal."""
    d = out_k.shape[-1]
    for first, count, tokens, row, head, kind in segments.tolist():
        params_at, basis_at, codes_at, width = components[first:first + count].unbind(1)
        params = data[params_at[:, None] + torch.arange(8)].view(torch.float16).float()  # [C, 4]
        basis = data[basis_at[:, None] + torch.arange(d)].float() * params[:, 2:3] + params[:, 3:4]  # [C, d]
        codes = unpack_codes(data, codes_at, width, tokens).float() * params[:, 0:1] + params[:, 1:2]  # [C, T]
        x = (codes.T @ basis) * channel_scale[kind, head].float()
        rows = slice(row, row + tokens)
        if kind == 0:
            x = apply_rope(x, cos[rows], sin[rows], interleaved, rotary_dim)
        out = out_k if kind == 0 else out_v
        out[head, rows] = x.to(out.dtype)
