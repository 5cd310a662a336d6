"""Rebuild one layer's K and V from packed low-rank factors into an attention buffer, keys rotated by RoPE.

`reconstruct_layer` validates its inputs, then dispatches: CUDA tensors go to one Triton launch for the
whole layer, CPU tensors to the batched CPU path (`cpu.reconstruct_layer_cpu`). The environment variable
MILO_KERNEL=reference|triton forces a backend: `reference` is the literal PyTorch oracle
(`naive.reconstruct_layer_naive`) on any device; Triton on CPU tensors needs TRITON_INTERPRET=1.

Validation reads the segment table on the host, which synchronises with the device. Callers that replay
launches (a CUDA graph, every layer of one retrieval) call `plan_layer` once per layer and `launch` after:
`launch` only checks tensor metadata against the plan, so it never synchronises and can be captured.

Why one tile per (segment, BLOCK_T tokens): every tile reads its rows of A, all of Σ and B (B stays in
L2 across a segment's tiles), multiplies on tensor cores with fp32 accumulation, and writes finished,
rotated rows. The two RoPE partners of each output channel are produced as two accumulators (the
"first" and "second" channel of every pair), so the rotation happens in registers and K is written once.

INT8 stores (uint8 factors, docs/format.md): the same kernel, with QUANT set, reads each segment's fp16
header (Σ and the per-column scale and minimum of A and B) and its uint8 codes in place, dequantizes a
tile in registers (code * scale + min, Σ folded into A) and feeds fp16 tiles to the same fp32-accumulating
dots, so no fp32 copy of the factors is ever written. src_offset then counts bytes, and since every INT8
segment has an even size the headers are read through an fp16 view of the same buffer (offset src / 2).
On CPU tensors the batched CPU path dequantizes each INT8 segment before its GEMM.

INT4/INT2 stores (``quant="int4"|"int2"``, KIVI-style groups) are expanded to fp16 factors first
(`lowbit.dequantize_lowbit_layer`, plain PyTorch) and then take the floating path: not fused.
"""
import functools
import os
from dataclasses import dataclass

import torch

from .cpu import reconstruct_layer_cpu
from .lowbit import dequantize_lowbit_layer
from .naive import int8_segment_bytes, reconstruct_layer_naive

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs neither
    triton = tl = None

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FACTOR_DTYPES = FLOAT_DTYPES + (torch.uint8,)  # uint8: INT8 segments (quantized stores)
SEGMENT_COLUMNS = ("src_offset", "rank", "tokens", "dst_row", "head", "kind")


@dataclass(frozen=True)
class Plan:
    """A validated segment table expanded into one row per Triton program, already on the device."""

    tiles: torch.Tensor  # int64 [n_tiles, 7]: the segment's six columns, then the tile's first token
    d: int
    need_numel: int  # smallest factors.numel() the segments fit in
    need_rows: int  # smallest N of out_k / out_v
    need_heads: int
    block_t: int
    block_r: int
    num_warps: int
    num_stages: int
    quantized: bool = False  # planned for uint8 factors (INT8 segments, byte offsets)


def reconstruct_layer(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, quant=None) -> None:
    """Write X = A diag(Σ) Bᵀ of every segment to out[head, dst_row:dst_row + tokens], keys rotated by RoPE.

    factors: 1-D contiguous fp16/bf16/fp32, or uint8 holding ``quant`` segments (int8 when None, int4
    or int2; src_offset in bytes, even); segments: int64 [S, 6] (see SEGMENT_COLUMNS); out_k, out_v:
    [kv_heads, N, d]; cos, sin: fp32 [>= N, d]. Only the segments' rows are written.
    """
    if factors.dtype == torch.uint8 and quant not in (None, "int8"):
        _check_tensors(factors, out_k, out_v, cos, sin)
        factors, segments = dequantize_lowbit_layer(factors, segments.cpu(), out_k.shape[-1], quant)
        segments = segments.to(factors.device)
    backend = _backend(factors)
    if backend in ("reference", "cpu"):
        segs = _check_all(factors, segments, out_k, out_v, cos, sin)
        rebuild = reconstruct_layer_naive if backend == "reference" else reconstruct_layer_cpu
        rebuild(factors, segs, out_k, out_v, cos, sin, interleaved=interleaved)
    else:
        plan = plan_layer(factors, segments, out_k, out_v, cos, sin)
        launch(plan, factors, out_k, out_v, cos, sin, interleaved=interleaved)


def plan_layer(factors, segments, out_k, out_v, cos, sin, *, block_t=64, block_r=None, num_warps=4,
               num_stages=2, quant=None) -> Plan:
    """Validate a layer's segments against its buffers and build the Triton tile table (synchronises).

    block_r defaults to the next power of two of the largest rank, clamped to [16, 64]; tl.dot needs
    every tile dimension to be at least 16, so smaller ranks are padded with masked lanes. uint8
    factors must be INT8 (``quant`` None or "int8"): INT4/INT2 layers are expanded first, by
    `reconstruct_layer`.
    """
    if quant not in (None, "int8"):
        raise ValueError(f"the kernel reads floating or INT8 factors, not {quant}; reconstruct_layer expands "
                         f"{quant} layers to fp16 first")
    _require_triton(factors)
    segs = _check_all(factors, segments, out_k, out_v, cos, sin)
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
    max_rank = int(segs[:, 1].max()) if len(segs) else 0
    if block_r is None:
        block_r = min(64, max(16, triton.next_power_of_2(max(max_rank, 1))))
    if block_r < 16 or block_r & (block_r - 1):
        raise ValueError(f"block_r must be a power of two >= 16, got {block_r}")
    src, rank, tokens, dst, head = (segs[:, i] for i in range(5))
    d = out_k.shape[-1]
    n_tiles = (tokens + block_t - 1) // block_t
    owner = torch.repeat_interleave(torch.arange(len(segs)), n_tiles)
    first_tile = torch.cumsum(n_tiles, 0) - n_tiles
    t0 = (torch.arange(len(owner)) - first_tile[owner]) * block_t
    tiles = torch.cat([segs[owner], t0[:, None]], dim=1).to(factors.device)
    return Plan(
        tiles=tiles,
        d=d,
        need_numel=int((src + _segment_numel(rank, tokens, d, factors.dtype)).max()) if len(segs) else 0,
        need_rows=int((dst + tokens).max()) if len(segs) else 0,
        need_heads=int(head.max()) + 1 if len(segs) else 0,
        block_t=block_t,
        block_r=block_r,
        num_warps=num_warps,
        num_stages=num_stages,
        quantized=factors.dtype == torch.uint8,
    )


def launch(plan: Plan, factors, out_k, out_v, cos, sin, *, interleaved=False) -> None:
    """One Triton launch for a planned layer. Checks metadata only: no host sync, safe to graph-capture."""
    _require_triton(factors)
    _check_tensors(factors, out_k, out_v, cos, sin)
    n_heads, n_rows, d = out_k.shape
    if (d != plan.d or factors.numel() < plan.need_numel or n_rows < plan.need_rows
            or n_heads < plan.need_heads or plan.tiles.device != factors.device
            or plan.quantized != (factors.dtype == torch.uint8)):
        raise ValueError("buffers do not match the plan (d, factors length or kind, rows, heads or device differ)")
    if len(plan.tiles) == 0:
        return
    # INT8 headers are fp16: an fp16 alias of the same bytes (alignment checked by _check_tensors)
    header = factors[:factors.numel() // 2 * 2].view(torch.float16) if plan.quantized else factors
    _kernel()[(len(plan.tiles),)](
        factors, header, plan.tiles, out_k, out_v, cos, sin, d,
        *out_k.stride(), *out_v.stride(), *cos.stride(), *sin.stride(),
        QUANT=plan.quantized,
        INTERLEAVED=bool(interleaved),
        IEEE_DOT=factors.dtype == torch.float32,
        BLOCK_T=plan.block_t,
        BLOCK_R=plan.block_r,
        BLOCK_H=max(16, triton.next_power_of_2(d // 2)),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )


def _backend(factors) -> str:
    choice = os.environ.get("MILO_KERNEL", "").strip().lower() or "auto"
    if choice == "auto":
        return "triton" if factors.is_cuda else "cpu"
    if choice not in ("reference", "triton"):
        raise ValueError(f"MILO_KERNEL must be 'reference' or 'triton', got {choice!r}")
    return choice


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _require_triton(factors) -> None:
    if triton is None:
        raise RuntimeError("the Triton kernel needs the triton package; set MILO_KERNEL=reference to use PyTorch")
    if not factors.is_cuda:
        if not _interpreting():
            raise RuntimeError("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                               "(set before the kernel is first used); or set MILO_KERNEL=reference")
        if factors.dtype == torch.bfloat16:
            raise TypeError("the Triton interpreter has no bf16; use fp16/fp32 or MILO_KERNEL=reference")


def _check_tensors(factors, out_k, out_v, cos, sin) -> None:
    """Dtype, shape and device checks that need no segment values."""
    if factors.dtype not in FACTOR_DTYPES or factors.dim() != 1 or not factors.is_contiguous():
        raise TypeError(f"factors must be a 1-D contiguous fp16/bf16/fp32 (or uint8 INT8) tensor, got "
                        f"{factors.dtype} with shape {tuple(factors.shape)}")
    if factors.dtype == torch.uint8 and factors.data_ptr() % 2:
        raise ValueError("uint8 (INT8) factors must start 2-byte aligned: segment headers are fp16")
    if out_k.dim() != 3 or out_k.shape != out_v.shape or out_k.dtype != out_v.dtype:
        raise ValueError(f"out_k and out_v must be [kv_heads, N, d] of one shape and dtype, got "
                         f"{tuple(out_k.shape)} {out_k.dtype} and {tuple(out_v.shape)} {out_v.dtype}")
    if out_k.dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_k/out_v must be fp16, bf16 or fp32, got {out_k.dtype}")
    n_rows, d = out_k.shape[1:]
    if d % 2:
        raise ValueError(f"head dim d must be even for RoPE, got {d}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != d or table.shape[0] < n_rows:
            raise ValueError(f"{name} must be fp32 [>= {n_rows}, {d}], got {table.dtype} {tuple(table.shape)}")
    devices = {t.device for t in (factors, out_k, out_v, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"factors, out_k, out_v, cos and sin must share a device, got {sorted(map(str, devices))}")


def _check_all(factors, segments, out_k, out_v, cos, sin) -> torch.Tensor:
    """Full validation; returns the segment table as a CPU int64 tensor."""
    _check_tensors(factors, out_k, out_v, cos, sin)
    if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != len(SEGMENT_COLUMNS):
        raise ValueError(f"segments must be int64 [S, {len(SEGMENT_COLUMNS)}] with columns {SEGMENT_COLUMNS}, "
                         f"got {segments.dtype} {tuple(segments.shape)}")
    segs = segments.cpu()
    n_heads, n_rows, d = out_k.shape
    src, rank, tokens, dst, head, kind = segs.unbind(1)
    quantized = factors.dtype == torch.uint8
    rules = (
        (src >= 0, "src_offset is negative"),
        ((src % 2 == 0) | (not quantized), "src_offset of an INT8 segment must be even (fp16 header)"),
        ((rank >= 0) & (rank <= d), f"rank must be in [0, d={d}]"),
        (tokens > 0, "tokens must be positive"),
        (src + _segment_numel(rank, tokens, d, factors.dtype) <= factors.numel(),
         f"reads past the end of factors ({factors.numel()})"),
        ((dst >= 0) & (dst + tokens <= n_rows), f"rows fall outside the output's N={n_rows}"),
        ((head >= 0) & (head < n_heads), f"head must be in [0, {n_heads})"),
        ((kind == 0) | (kind == 1), "kind must be 0 (key) or 1 (value)"),
    )
    for ok, message in rules:
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise ValueError(f"segment {i} {dict(zip(SEGMENT_COLUMNS, segs[i].tolist()))}: {message}")
    _check_disjoint(segs, n_heads, n_rows)
    return segs


def _segment_numel(rank, tokens, d, dtype):
    """Elements a segment occupies: r (T + d + 1) values, or INT8 bytes r (T' + d + 10)."""
    if dtype == torch.uint8:
        return int8_segment_bytes(rank, tokens, d)
    return rank * (tokens + d + 1)


def _check_disjoint(segs, n_heads, n_rows) -> None:
    """Two segments writing the same (kind, head, row) would race in the kernel; reject them."""
    _, _, tokens, dst, head, kind = segs.unbind(1)
    order = torch.argsort((kind * n_heads + head) * (n_rows + 1) + dst)
    same_target = (kind[order][1:] == kind[order][:-1]) & (head[order][1:] == head[order][:-1])
    overlaps = same_target & (dst[order][1:] < (dst + tokens)[order][:-1])
    if bool(overlaps.any()):
        j = int(overlaps.nonzero()[0])
        raise ValueError(f"segments {int(order[j])} and {int(order[j + 1])} write overlapping rows")


@functools.cache
def _kernel_for(interpret: bool):
    """Build the JIT kernel lazily: triton decides interpreter vs compiler when the decorator runs."""

    @triton.jit
    def reconstruct_kernel(F, F16, TILES, K, V, COS, SIN, D,
                           skh, skn, skd, svh, svn, svd, scn, scd, ssn, ssd,
                           QUANT: tl.constexpr, INTERLEAVED: tl.constexpr, IEEE_DOT: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        tile = TILES + tl.program_id(0) * 7
        src = tl.load(tile)
        rank = tl.load(tile + 1)
        tokens = tl.load(tile + 2)
        row0 = tl.load(tile + 3)
        head = tl.load(tile + 4)
        kind = tl.load(tile + 5)
        t0 = tl.load(tile + 6)

        t = t0 + tl.arange(0, BLOCK_T)  # token index inside the segment
        h = tl.arange(0, BLOCK_H)  # index of a RoPE pair: channels c1[h] and c2[h]
        t_ok = t < tokens
        h_ok = h < D // 2
        if INTERLEAVED:
            c1 = 2 * h
            c2 = 2 * h + 1
        else:
            c1 = h
            c2 = h + D // 2

        if QUANT:  # bytes: fp16 header [5, rank] (read via F16), A codes [T', rank], B codes [d, rank]
            hdr = F16 + src // 2  # Σ, A scale, A min, B scale, B min
            a_rows = F + src + 10 * rank + t * rank
            s_ptr = hdr
            b_ptr = F + src + 10 * rank + (tokens + tokens % 2) * rank
        else:
            hdr = F16
            a_rows = F + src + t * rank  # A [tokens, rank]
            s_ptr = F + src + tokens * rank  # Σ [rank]
            b_ptr = s_ptr + rank  # B [d, rank]
        acc1 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < rank
            a_mask = t_ok[:, None] & r_ok[None, :]
            b_mask = r_ok[:, None] & h_ok[None, :]
            a = tl.load(a_rows[:, None] + r[None, :], mask=a_mask, other=0)
            s = tl.load(s_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
            b1 = tl.load(b_ptr + c1[None, :] * rank + r[:, None], mask=b_mask, other=0)  # Bᵀ, first channels
            b2 = tl.load(b_ptr + c2[None, :] * rank + r[:, None], mask=b_mask, other=0)  # Bᵀ, partners
            if QUANT:  # dequantize in registers; lanes past the rank have scale = min = 0, so stay 0
                a_scale = tl.load(hdr + rank + r, mask=r_ok, other=0.0).to(tl.float32)
                a_min = tl.load(hdr + 2 * rank + r, mask=r_ok, other=0.0).to(tl.float32)
                b_scale = tl.load(hdr + 3 * rank + r, mask=r_ok, other=0.0).to(tl.float32)
                b_min = tl.load(hdr + 4 * rank + r, mask=r_ok, other=0.0).to(tl.float32)
                a = a.to(tl.float32) * a_scale[None, :] + a_min[None, :]
                a = (a * s[None, :]).to(tl.float16)  # Σ fused into A's columns
                b1 = (b1.to(tl.float32) * b_scale[:, None] + b_min[:, None]).to(tl.float16)
                b2 = (b2.to(tl.float32) * b_scale[:, None] + b_min[:, None]).to(tl.float16)
            else:
                a = (a.to(tl.float32) * s[None, :]).to(F.dtype.element_ty)  # Σ fused into A's columns
            if IEEE_DOT:
                acc1 = tl.dot(a, b1, acc1, input_precision="ieee")
                acc2 = tl.dot(a, b2, acc2, input_precision="ieee")
            else:
                acc1 = tl.dot(a, b1, acc1)
                acc2 = tl.dot(a, b2, acc2)

        rows = row0 + t
        mask = t_ok[:, None] & h_ok[None, :]
        if kind == 0:
            cos1 = tl.load(COS + rows[:, None] * scn + c1[None, :] * scd, mask=mask, other=0.0)
            cos2 = tl.load(COS + rows[:, None] * scn + c2[None, :] * scd, mask=mask, other=0.0)
            sin1 = tl.load(SIN + rows[:, None] * ssn + c1[None, :] * ssd, mask=mask, other=0.0)
            sin2 = tl.load(SIN + rows[:, None] * ssn + c2[None, :] * ssd, mask=mask, other=0.0)
            out = K + head * skh + rows[:, None] * skn
            tl.store(out + c1[None, :] * skd, (acc1 * cos1 - acc2 * sin1).to(K.dtype.element_ty), mask=mask)
            tl.store(out + c2[None, :] * skd, (acc2 * cos2 + acc1 * sin2).to(K.dtype.element_ty), mask=mask)
        else:
            out = V + head * svh + rows[:, None] * svn
            tl.store(out + c1[None, :] * svd, acc1.to(V.dtype.element_ty), mask=mask)
            tl.store(out + c2[None, :] * svd, acc2.to(V.dtype.element_ty), mask=mask)

    return reconstruct_kernel


def _kernel():
    return _kernel_for(_interpreting())
