"""Builders shared by the kernel tests: RoPE tables, an independent RoPE, and packed random layers."""
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from milo_kernels import RAW_RANK


def rope_angles(n: int, d: int, interleaved: bool, base: float = 10000.0) -> torch.Tensor:
    """Angle [n, d] of every (position, channel); both channels of a RoPE pair share one frequency."""
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    pair_angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq  # [n, d/2]
    if interleaved:
        return pair_angle.repeat_interleave(2, dim=1)
    return torch.cat([pair_angle, pair_angle], dim=1)


def rope_tables(n: int, d: int, interleaved: bool):
    angles = rope_angles(n, d, interleaved)
    return angles.cos().float(), angles.sin().float()


def rope_by_complex(x: torch.Tensor, first_position: int, interleaved: bool) -> torch.Tensor:
    """RoPE written as complex multiplication, independent of naive.rotate; x is [T, d] float64."""
    t, d = x.shape
    angles = rope_angles(first_position + t, d, interleaved)[first_position:]
    if interleaved:
        re, im, theta = x[:, 0::2], x[:, 1::2], angles[:, 0::2]
    else:
        re, im, theta = x[:, : d // 2], x[:, d // 2:], angles[:, : d // 2]
    z = torch.complex(re, im) * torch.polar(torch.ones_like(theta), theta)
    out = torch.empty_like(x)
    if interleaved:
        out[:, 0::2], out[:, 1::2] = z.real, z.imag
    else:
        out[:, : d // 2], out[:, d // 2:] = z.real, z.imag
    return out


def random_layer(kv_heads, d, block_tokens, dtype, seed, raw=False):
    """A packed layer: every (block, kind, head) segment with ragged ranks, in shuffled storage order.

    Output rows leave a 2-row gap before every block, and the factor buffer has NaN gaps between
    segments and at its end, so a kernel that reads or writes outside its segments shows up as NaN.
    ``raw``: every third segment is raw instead (rank RAW_RANK, X [T, d] itself).
    Returns factors, segments [S, 6] and the number of output rows N.
    """
    gen = torch.Generator().manual_seed(seed)
    rank_pool = [d - 1, 0, d, 1] + torch.randint(0, d + 1, (16,), generator=gen).tolist()
    if raw:
        pairs = zip(rank_pool[0::2], rank_pool[1::2])
        rank_pool = [rank for pair in pairs for rank in (RAW_RANK, *pair)]  # raw, then two of the ranks
    rows, row = [], 2
    for tokens in block_tokens:
        rows.append(row)
        row += tokens + 2
    specs = []  # (rank, tokens, dst_row, head, kind)
    for tokens, dst in zip(block_tokens, rows):
        for kind in (0, 1):
            for head in range(kv_heads):
                specs.append((rank_pool[len(specs) % len(rank_pool)], tokens, dst, head, kind))
    parts, segments, offset = [], [], 0
    for i in torch.randperm(len(specs), generator=gen).tolist():
        rank, tokens, dst, head, kind = specs[i]
        gap = int(torch.randint(0, 5, (), generator=gen))
        parts.append(torch.full((gap,), math.nan))
        offset += gap
        segments.append([offset, rank, tokens, dst, head, kind])
        if rank == RAW_RANK:
            parts.append(torch.randn(tokens * d, generator=gen))
            offset += tokens * d
            continue
        a = torch.randn(tokens, rank, generator=gen)
        sigma = (torch.rand(rank, generator=gen) + 0.5) / math.sqrt(max(rank, 1))
        b = torch.randn(d, rank, generator=gen)
        parts += [a.flatten(), sigma, b.flatten()]
        offset += rank * (tokens + d + 1)
    parts.append(torch.full((3,), math.nan))
    return torch.cat(parts).to(dtype), torch.tensor(segments, dtype=torch.int64), row


def target_mask(segments, kv_heads, n_rows, d):
    """Boolean [2, kv_heads, N, d]: which output elements the segments own (index 0 keys, 1 values)."""
    mask = torch.zeros(2, kv_heads, n_rows, d, dtype=torch.bool)
    for _, _, tokens, dst, head, kind in segments.tolist():
        mask[kind, head, dst:dst + tokens] = True
    return mask


def run_under_interpreter(test_file, keyword=None):
    """Run a kernel test file's tests in a fresh process with TRITON_INTERPRET=1 (it must be set before
    triton is first used), so a CPU machine runs the real kernel without switching the interpreter on
    for every other test; fails unless they all pass and none is skipped."""
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-k", keyword] if keyword else []),
         str(test_file)],
        cwd=repo, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1", "MILO_KERNEL": "", "PYTHONPATH": str(repo)},
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-2000:]
    return result.stdout


def quantized_layer(kv_heads, d, block_tokens, quant, seed, rank_pool):
    """One layer packed as ``quant`` segments (milo_store.codecs.quant.pack_segment): ranks taken in turn from
    ``rank_pool`` (ragged; RAW_RANK packs a raw segment, pack_raw_segment), shuffled storage order, even
    gaps of random bytes between segments and at the end (headers stay 2-byte aligned). Output rows
    leave a 2-row gap before every block.
    Returns uint8 factors, segments [S, 6] with byte offsets, and the number of output rows N."""
    from milo_store.codecs.quant import pack_raw_segment, pack_segment

    gen = torch.Generator().manual_seed(seed)
    rows, row = [], 2
    for tokens in block_tokens:
        rows.append(row)
        row += tokens + 2
    specs = [(t, dst, h, k) for t, dst in zip(block_tokens, rows) for k in (0, 1) for h in range(kv_heads)]
    parts, segments, offset = [], [], 0
    for i in torch.randperm(len(specs), generator=gen).tolist():
        tokens, dst, head, kind = specs[i]
        rank = rank_pool[i % len(rank_pool)]
        gap = 2 * int(torch.randint(0, 3, (), generator=gen))
        parts.append(torch.randint(0, 256, (gap,), generator=gen, dtype=torch.uint8))
        offset += gap
        if rank == RAW_RANK:
            raw = pack_raw_segment(torch.randn(tokens, d, generator=gen), quant, kind)
        else:
            a, b = torch.randn(tokens, rank, generator=gen), torch.randn(d, rank, generator=gen)
            sigma = (torch.rand(rank, generator=gen) + 0.5) / math.sqrt(max(rank, 1))
            raw = pack_segment(a, sigma, b, quant, kind)
        parts.append(raw)
        segments.append([offset, rank, tokens, dst, head, kind])
        offset += raw.numel()
    parts.append(torch.randint(0, 256, (4,), generator=gen, dtype=torch.uint8))
    return torch.cat(parts), torch.tensor(segments, dtype=torch.int64), row


def check_outputs(got, want, mask, atol, rtol):
    """got and want (out_k, out_v) agree on the elements ``mask`` (`target_mask`) names, got was written
    there (no NaN left) and nowhere else (still NaN)."""
    for kind in (0, 1):
        g, w, m = got[kind].float().cpu(), want[kind].float(), mask[kind]
        assert w[m].isfinite().all(), "the reference itself produced non-finite targets"
        assert g[m].isfinite().all(), "a target element was not written (still NaN)"
        assert g[~m].isnan().all(), "an element outside every segment was written"
        torch.testing.assert_close(g[m], w[m], atol=atol, rtol=rtol)


def nan_buffers(kv_heads, n_rows, d, dtype, device="cpu"):
    """out_k, out_v filled with NaN: an element a kernel should write and did not stays NaN."""
    out_k = torch.full((kv_heads, n_rows, d), math.nan, dtype=dtype, device=device)
    return out_k, out_k.clone()


def bits_layer(kv_heads, d, block_tokens, seed):
    """One layer of per-component bit codes (milo_kernels.bits' tables): component counts taken in turn from
    a pool with 0, odd counts and d, each component at a random width 0..8 (0: dropped, no table row),
    its parameters, basis and codes at odd byte offsets with random bytes between them (and in the codes'
    padding bits). Output rows leave a 2-row gap before every block.
    Returns uint8 data, components [C, 4], segments [S, 6], channel_scale [2, kv_heads, d] and N."""
    gen = torch.Generator().manual_seed(seed)
    count_pool = [d, 0, 1, 3, d - 1] + torch.randint(0, d + 1, (11,), generator=gen).tolist()
    data, components, segments, row = [], [], [], 2
    junk = lambda n: data.extend(torch.randint(0, 256, (n,), generator=gen).tolist())  # noqa: E731
    for tokens in block_tokens:
        for kind in (0, 1):
            for head in range(kv_heads):
                widths = torch.randint(0, 9, (count_pool[len(segments) % len(count_pool)],), generator=gen)
                first = len(components)
                for w in widths[widths > 0].tolist():
                    scale = 6.0 / (2 ** w - 1)
                    params = torch.tensor([scale, -3.0, 2.0 / 255, -1.0]) * (0.5 + torch.rand(4, generator=gen))
                    junk(int(torch.randint(1, 4, (), generator=gen)))
                    at = len(data)
                    data.extend(params.half().view(torch.uint8).tolist())
                    junk(d + 1)  # the basis codes and one byte of padding
                    junk(-(-tokens * w // 8))
                    components.append([at, at + 8, at + 9 + d, w])
                segments.append([first, len(components) - first, tokens, row, head, kind])
        row += tokens + 2
    junk(3)
    channel_scale = 0.5 + 1.5 * torch.rand(2, kv_heads, d, generator=gen)
    return (torch.tensor(data, dtype=torch.uint8), torch.tensor(components, dtype=torch.int64).reshape(-1, 4),
            torch.tensor(segments, dtype=torch.int64), channel_scale, row)
