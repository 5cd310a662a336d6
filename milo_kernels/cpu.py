"""The CPU reconstruction path: the reference's arithmetic with a third of its tensor ops.

`naive.reconstruct_layer_naive` spends about a dozen tensor ops per segment (casts, Σ scaling, the
GEMM, a rotate-half built by ``cat``, three RoPE passes, a cast, the write), and a query touches
blocks × layers × 2 × kv_heads segments (8 blocks of a 30-layer, 3-head model: 1,440). Here each
segment costs one GEMM (Σ folded into B, the smaller factor; a raw segment one copy), written
straight into a per-(block, kind) fp32 buffer, and the rest is done once per (block, kind) over all
its heads: RoPE as one multiply and two in-place ``addcmul`` over the buffer (no rotated copy), then
one casting copy per head into its rows.

Why not one padded ``bmm`` per (block, kind): ranks differ per head (entropy allocation), so padding
to the block's largest rank multiplies zeros, and packing the ragged factors into padded tensors
(by index gathers or per-segment copies) costs as much as the GEMMs it batches. On one layer of 8
blocks × 640 tokens, 3 heads, d = 64, ragged ranks, one thread, the padded bmm took 35 ms and the
reference 8.4 ms; this path 7.8 ms. Arithmetic is fp32 as in the reference;
results differ from it by fp32 rounding only. Inputs are not validated here:
`reconstruct.reconstruct_layer` does that.
"""
import numpy as np
import torch

from milo_format import RAW_RANK, segment_size
from .naive import dequantize_int8_segment, raw_segment


def reconstruct_layer_cpu(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, rotary_dim=None) -> None:
    """Same contract as `naive.reconstruct_layer_naive`: write every segment's rows, touch no others. ``cos`` None:
    keys are written unrotated (`reconstruct.decode_layer`, whose fp32 outputs the products are written into)."""
    d = out_k.shape[-1]
    if cos is None:  # nothing to rotate: each product straight into its rows
        for src, rank, tokens, dst, head, kind in segments.tolist():
            _product(factors, src, rank, tokens, d, out=(out_k if kind == 0 else out_v)[head, dst:dst + tokens])
        return
    groups = {}  # (kind, dst_row, tokens) -> [(src_offset, rank, head)]: the keys or values of one block
    for src, rank, tokens, dst, head, kind in segments.tolist():
        groups.setdefault((kind, dst, tokens), []).append((src, rank, head))
    for (kind, dst, tokens), members in groups.items():
        x = torch.empty(len(members), tokens, d, dtype=torch.float32, device=factors.device)
        for g, (src, rank, _) in enumerate(members):
            _product(factors, src, rank, tokens, d, out=x[g])
        rows = slice(dst, dst + tokens)
        if kind == 0:
            x = rope(x, cos[rows], sin[rows], interleaved, rotary_dim=rotary_dim)
        out = out_k if kind == 0 else out_v
        for g, (_, _, head) in enumerate(members):
            out[head, rows].copy_(x[g])


def _product(factors, src: int, rank: int, tokens: int, d: int, out: torch.Tensor) -> None:
    """out [tokens, d] = A diag(Σ) Bᵀ of the segment packed at factors[src:] (uint8: INT8), in fp32; X
    itself for a raw segment."""
    if rank == 0:
        out.zero_()
        return
    if rank == RAW_RANK:
        out.copy_(raw_segment(factors, src, tokens, d))
        return
    if factors.dtype == torch.uint8:
        a, s, b = dequantize_int8_segment(factors[src:src + segment_size(rank, tokens, d, 8, 0)], rank, tokens, d)
        torch.mm(a, (b * s).t(), out=out)
        return
    s_at = src + tokens * rank
    a = factors[src:s_at].view(tokens, rank).float()
    b = factors[s_at + rank:s_at + rank + d * rank].view(d, rank).float() * factors[s_at:s_at + rank].float()
    torch.mm(a, b.t(), out=out)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         out: torch.Tensor | None = None, *, rotary_dim: int | None = None) -> torch.Tensor:
    """x·cos + rotate(x)·sin for fp32 x [..., T, d], without materialising rotate(x); into ``out`` (fp32, x's
    shape, not overlapping x) when given. ``rotary_dim``: rotate-half over the first rotary_dim channels only
    (`naive.rotate`); the rest are x·cos, cos being 1 there.

    rotate(x) is (-x2, x1) over the RoPE pairs (halves, or even/odd channels when interleaved), so the
    sin term is two fused multiply-adds on the halves of the result.
    """
    out = x * cos if out is None else torch.mul(x, cos, out=out)
    if interleaved:
        x1, x2, o1, o2, s1, s2 = (t[..., i::2] for t, i in ((x, 0), (x, 1), (out, 0), (out, 1), (sin, 0), (sin, 1)))
    else:
        r = x.shape[-1] if rotary_dim is None else rotary_dim
        h = r // 2
        x1, x2, o1, o2, s1, s2 = x[..., :h], x[..., h:r], out[..., :h], out[..., h:r], sin[..., :h], sin[..., h:r]
    o1.addcmul_(x2, s1, value=-1)
    o2.addcmul_(x1, s2)
    return out


def reconstruct_bits_layer_cpu(data, components, segments, channel_scale, out_k, out_v, cos, sin, *,
                               interleaved=False, rotary_dim=None) -> None:
    """Same contract as `naive.reconstruct_bits_layer_naive`, batched for a CPU: the codes of every component of
    one (width, tokens) are unpacked at once with numpy (unpackbits over their bytes, not a gather per bit),
    then each segment is one fp32 product of its coefficients and basis, rotated if a key."""
    d = out_k.shape[-1]
    buf, comps, segs = data.numpy(), components.numpy(), segments.numpy()
    first, count, tokens = segs[:, 0], segs[:, 1], segs[:, 2]
    total = int(count.sum())
    used = np.repeat(first, count) + np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    used_tokens = np.repeat(tokens, count)
    starts = np.concatenate(([0], np.cumsum(used_tokens)[:-1])).astype(np.int64)  # each segment's rows are consecutive
    params_at, basis_at, codes_at, width = comps[used].T
    params = buf[params_at[:, None] + np.arange(8)].view(np.float16).astype(np.float32)  # [n, 4]
    basis = buf[basis_at[:, None] + np.arange(d)].astype(np.float32) * params[:, 2:3] + params[:, 3:4]  # [n, d]
    coefficients = np.empty(int(used_tokens.sum()), dtype=np.float32)
    for b, t in {(int(b), int(t)) for b, t in zip(width, used_tokens)}:
        rows = np.nonzero((width == b) & (used_tokens == t))[0]
        held = buf[codes_at[rows, None] + np.arange(-(-t * b // 8))]
        bits = np.unpackbits(held, axis=1, bitorder="little")[:, :t * b].reshape(len(rows), t, b)
        codes = bits[..., 0].astype(np.int32)
        for k in range(1, b):
            codes |= bits[..., k].astype(np.int32) << k
        coefficients[starts[rows, None] + np.arange(t)] = codes * params[rows, :1] + params[rows, 1:2]
    at = 0
    for (c, t, row, head, kind) in segs[:, 1:].tolist():
        a = torch.from_numpy(coefficients[starts[at]:starts[at] + c * t].reshape(c, t)) if c else torch.zeros(0, t)
        x = (a.T @ torch.from_numpy(basis[at:at + c])) * channel_scale[kind, head]
        at += c
        rows = slice(row, row + t)
        if kind == 0:
            x = rope(x, cos[rows], sin[rows], interleaved, rotary_dim=rotary_dim)
        (out_k if kind == 0 else out_v)[head, rows] = x.to(out_k.dtype)
