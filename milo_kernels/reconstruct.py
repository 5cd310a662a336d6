"""Rebuild one layer's K and V from packed low-rank factors into an attention buffer, keys rotated by RoPE.

`reconstruct_layer` validates its inputs, then dispatches: CUDA tensors go to one Triton launch for the
whole layer, CPU tensors to the batched CPU path (`cpu.reconstruct_layer_cpu`). The environment variable
MILO_KERNEL=reference|triton forces a backend: `reference` is the literal PyTorch oracle
(`naive.reconstruct_layer_naive`) on any device; Triton on CPU tensors needs TRITON_INTERPRET=1.

No host synchronisation when the segment table is a CPU tensor: validation and the tile table are
built on the host and the table goes up with one non-blocking copy from pinned memory. A segment table
on the device is accepted too, but reading it back synchronises. Planning is host work of about a
millisecond per call (many small tensor ops), so a query plans every layer at once with `plan_layers`
(one pass, one upload) and passes each layer's plan to `reconstruct_layer`, which then only launches;
`launch` checks tensor metadata against the plan, so it can also be captured in a CUDA graph.

Why one program per (segment, BLOCK_T tokens, BLOCK_H channel pairs): every program reads its rows of A,
all of Σ and its columns of B (both stay in L2 across a segment's programs), multiplies on tensor cores
with fp32 accumulation, and writes finished, rotated rows. The two RoPE partners of each output channel
are produced as two accumulators (the "first" and "second" channel of every pair), so the rotation
happens in registers and K is written once. `tile_config` picks the tiles per head dim so that no
variant spills registers (tools/compile_kernels.py checks it for sm_80 and sm_90).

Quantized stores (uint8 factors, docs/format.md; src_offset counts bytes and is even, so the fp16
parts are read through an fp16 view of the same buffer at src / 2): the kernel reads the codes and
their scales in place and dequantizes a tile in registers (code * scale + min, Σ folded into A), then
feeds fp16 tiles to the same fp32-accumulating dots; no floating copy of the factors is written.
INT8 has one scale per factor column; INT4/INT2 unpack 2 or 4 tokens per byte of A, with a scale per
(column, 32-token group) for keys and per token for values. On CPU tensors INT8 is dequantized per
segment by the CPU path and INT4/INT2 layers are expanded first (`lowbit.dequantize_lowbit_layer`).

Raw segments (rank RAW_RANK = -1: a unit's K or V itself, stored as the A of a rank-d segment whose
Σ = 1 and B = I are not stored) go through the same launch: a tile whose rank is -1 loads X at the
channels of its RoPE pairs straight into the two accumulators, dequantized as A is (`_load_a`, shared
with the rank loop), and skips the dots, which against B = I would only spend d / BLOCK_R tensor-core
steps to copy X (and round a dequantized X to fp16 tiles). A floating raw value is written as it was
stored, bit for bit; a raw key is rotated in fp32 like every key.
"""
import functools
import os
import types
from dataclasses import dataclass

import torch

from .cpu import reconstruct_layer_cpu
from .lowbit import BITS as LOWBIT_BITS, GROUP_TOKENS, dequantize_lowbit_layer, lowbit_segment_bytes
from .naive import RAW_RANK, float_segment_numel, int8_segment_bytes, reconstruct_layer_naive

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs neither
    triton = tl = None

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FACTOR_DTYPES = FLOAT_DTYPES + (torch.uint8,)  # uint8: quantized segments (INT8, INT4, INT2)
QUANT_BITS = {None: 8, "int8": 8, **LOWBIT_BITS}  # for uint8 factors; None reads as INT8 (older stores)
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
    block_h: int  # RoPE pairs per program: the grid's second axis covers d / 2 in chunks of block_h
    bits: int = 0  # 0: floating factors; 8, 4, 2: uint8 factors of that quantization (byte offsets)

    @property
    def quantized(self) -> bool:
        return self.bits != 0


def tile_config(d: int) -> dict:
    """The tiles `plan_layer` picks: 64 tokens x up to 32 RoPE pairs per program, ranks in steps of
    BLOCK_R = 16 (tl.dot's smallest dimension), 4 warps.

    Why: with BLOCK_R = 64 or all d / 2 pairs in one program, two fp32 accumulators plus the A and B
    tiles take 255 registers and spill; BLOCK_R = 32 still spills a few bytes on sm_80; this tiling
    spills nothing for any factor dtype and head dim on sm_80 and sm_90 (tools/compile_kernels.py).
    Of the spill-free tilings, 4 warps rebuilt the H200 workload 1.7x faster than 8 (bench_kernels'
    sweep, docs/benchmarks.md).
    """
    block_h = min(32, max(16, 1 << max(d // 2 - 1, 0).bit_length()))
    return dict(block_t=64, block_r=16, block_h=block_h, num_warps=4, num_stages=2)


def reconstruct_layer(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, quant=None,
                      plan: "Plan | None" = None) -> None:
    """Write X = A diag(Σ) Bᵀ of every segment (X itself when raw, rank RAW_RANK) to out[head, dst_row:
    dst_row + tokens], keys rotated by RoPE.

    factors: 1-D contiguous fp16/bf16/fp32, or uint8 holding ``quant`` segments (int8 when None, int4
    or int2; src_offset in bytes, even); segments: int64 [S, 6] (see SEGMENT_COLUMNS), best on the CPU
    (a device table is read back, a sync); out_k, out_v: [kv_heads, N, d]; cos, sin: fp32 [>= N, d].
    Only the segments' rows are written. ``plan``: these segments' plan from `plan_layers`, used by the
    Triton backend instead of planning again (the other backends take the segments).
    """
    bits = _bits(factors.dtype, quant)
    backend = kernel_backend(factors.device)
    if backend in ("reference", "cpu"):
        segs = _check_all(factors, segments, out_k, out_v, cos, sin, bits)
        if bits in (4, 2):  # the CPU and reference paths rebuild expanded fp16 factors
            factors, segs = dequantize_lowbit_layer(factors, segs, out_k.shape[-1], quant)
        rebuild = reconstruct_layer_naive if backend == "reference" else reconstruct_layer_cpu
        rebuild(factors, segs, out_k, out_v, cos, sin, interleaved=interleaved)
    else:
        if plan is None:
            plan = plan_layer(factors, segments, out_k, out_v, cos, sin, quant=quant)
        launch(plan, factors, out_k, out_v, cos, sin, interleaved=interleaved)


def plan_layer(factors, segments, out_k, out_v, cos, sin, *, quant=None, **tiles) -> Plan:
    """Validate a layer's segments against its buffers and build the Triton tile table.

    Works on the host: a CPU segment table costs no device synchronisation (a device one is read back,
    which does); the tile table is uploaded with one non-blocking copy from pinned memory. Tile sizes
    (block_t, block_r, block_h, num_warps, num_stages) default to `tile_config`; any can be overridden
    (block_* powers of two >= 16).
    """
    _require_triton(factors)
    bits = _bits(factors.dtype, quant)
    segs = _check_all(factors, segments, out_k, out_v, cos, sin, bits)
    return _plan(segs[None], out_k.shape[-1], bits, factors.device, tiles)[0]


def plan_layers(segments, d: int, *, factor_dtype, device, quant=None, **tiles) -> list[Plan]:
    """Plans for every layer of one retrieval: segments int64 [L, S, 6] on the CPU, validated and tiled
    in one host pass and uploaded in one non-blocking copy. The bounds that need the buffers (factors
    length, output rows and heads) are checked by `launch` against each plan.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; plan_layers is for the Triton backend")
    if segments.dtype != torch.int64 or segments.dim() != 3 or segments.shape[2] != len(SEGMENT_COLUMNS):
        raise ValueError(f"segments must be int64 [L, S, {len(SEGMENT_COLUMNS)}], got {segments.dtype} "
                         f"{tuple(segments.shape)}")
    segs = segments.cpu()
    bits = _bits(factor_dtype, quant)
    flat = segs.reshape(-1, len(SEGMENT_COLUMNS))
    _check_rules(flat, _structure_rules(flat, d, bits))
    _check_disjoint(flat, torch.arange(segs.shape[0]).repeat_interleave(segs.shape[1]))
    return _plan(segs, d, bits, torch.device(device), tiles)


def _plan(segs, d: int, bits: int, device, tiles: dict) -> list[Plan]:
    """Tile validated segment tables [L, S, 6] and upload them at once; one Plan per layer."""
    config = {**tile_config(d), **{k: v for k, v in tiles.items() if v is not None}}
    for name in ("block_t", "block_r", "block_h"):
        size = config[name]
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    L, S = segs.shape[:2]
    flat = segs.reshape(-1, len(SEGMENT_COLUMNS))
    src, rank, tokens, dst, head = (flat[:, i] for i in range(5))
    n_tiles = (tokens + config["block_t"] - 1) // config["block_t"]
    owner = torch.repeat_interleave(torch.arange(len(flat)), n_tiles)
    first_tile = torch.cumsum(n_tiles, 0) - n_tiles
    t0 = (torch.arange(len(owner)) - first_tile[owner]) * config["block_t"]
    table = _upload(torch.cat([flat[owner], t0[:, None]], dim=1), device)
    per_layer = n_tiles.view(L, S).sum(1).tolist()
    ends = (src + _segment_numel(flat, d, bits)).view(L, S)
    rows, heads = (dst + tokens).view(L, S), head.view(L, S)
    need = [(0, 0, 0)] * L if S == 0 else zip(ends.amax(1).tolist(), rows.amax(1).tolist(), (heads.amax(1) + 1).tolist())
    return [Plan(tiles=t, d=d, need_numel=n, need_rows=r, need_heads=h, bits=bits, **config)
            for t, (n, r, h) in zip(table.split(per_layer), need)]


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
    # quantized headers and scales are fp16: an fp16 alias of the same bytes (alignment checked above)
    header = factors[:factors.numel() // 2 * 2].view(torch.float16) if plan.quantized else factors
    grid = (len(plan.tiles), triton.cdiv(d // 2, plan.block_h))
    _kernel()[grid](
        factors, header, plan.tiles, out_k, out_v, cos, sin, d,
        *out_k.stride(), *out_v.stride(), *cos.stride(), *sin.stride(),
        BITS=plan.bits,
        GROUP=GROUP_TOKENS,
        INTERLEAVED=bool(interleaved),
        IEEE_DOT=factors.dtype == torch.float32,
        BLOCK_T=plan.block_t,
        BLOCK_R=plan.block_r,
        BLOCK_H=plan.block_h,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )


def _bits(factor_dtype, quant) -> int:
    """0 for floating factors, else the code width of the uint8 factors' quantization."""
    if quant not in QUANT_BITS:
        raise ValueError(f"unknown low-bit quantization {quant!r}; expected None, 'int8', 'int4' or 'int2'")
    return QUANT_BITS[quant] if factor_dtype == torch.uint8 else 0


def _upload(table, device):
    """The host-built table on `device`: pinned and non-blocking to CUDA, so the host never waits."""
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def kernel_backend(device) -> str:
    """What rebuilds tensors on ``device``: "triton" (CUDA), "cpu", or what MILO_KERNEL forces."""
    choice = os.environ.get("MILO_KERNEL", "").strip().lower() or "auto"
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" else "cpu"
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
        raise TypeError(f"factors must be a 1-D contiguous fp16/bf16/fp32 (or uint8 quantized) tensor, got "
                        f"{factors.dtype} with shape {tuple(factors.shape)}")
    if factors.dtype == torch.uint8 and factors.data_ptr() % 2:
        raise ValueError("uint8 (quantized) factors must start 2-byte aligned: segment headers are fp16")
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


def _check_all(factors, segments, out_k, out_v, cos, sin, bits: int) -> torch.Tensor:
    """Full validation; returns the segment table as a CPU int64 tensor (read back if it was on a device).

    bits: `_bits` of the factors (0 floating; 8, 4 or 2 the quantization of uint8 factors)."""
    _check_tensors(factors, out_k, out_v, cos, sin)
    if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != len(SEGMENT_COLUMNS):
        raise ValueError(f"segments must be int64 [S, {len(SEGMENT_COLUMNS)}] with columns {SEGMENT_COLUMNS}, "
                         f"got {segments.dtype} {tuple(segments.shape)}")
    segs = segments.cpu()
    n_heads, n_rows, d = out_k.shape
    src, rank, tokens, dst, head, kind = segs.unbind(1)
    _check_rules(segs, _structure_rules(segs, d, bits) + (
        (src + _segment_numel(segs, d, bits) <= factors.numel(), f"reads past the end of factors ({factors.numel()})"),
        (dst + tokens <= n_rows, f"rows fall outside the output's N={n_rows}"),
        (head < n_heads, f"head must be in [0, {n_heads})"),
    ))
    _check_disjoint(segs)
    return segs


def _structure_rules(segs, d, bits) -> tuple:
    """(ok per segment, message) for what a segment must satisfy whatever the buffers."""
    src, rank, tokens, dst, head, kind = segs.unbind(1)
    return (
        (src >= 0, "src_offset is negative"),
        ((src % 2 == 0) | (bits == 0), "src_offset of a quantized segment must be even (fp16 header)"),
        ((rank == RAW_RANK) | ((rank >= 0) & (rank <= d)), f"rank must be in [0, d={d}] or {RAW_RANK} (raw)"),
        (tokens > 0, "tokens must be positive"),
        (dst >= 0, "dst_row is negative"),
        (head >= 0, "head is negative"),
        ((kind == 0) | (kind == 1), "kind must be 0 (key) or 1 (value)"),
    )


def _check_rules(segs, rules) -> None:
    for ok, message in rules:
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise ValueError(f"segment {i} {dict(zip(SEGMENT_COLUMNS, segs[i].tolist()))}: {message}")


def _segment_numel(segs, d, bits):
    """Elements each segment occupies: r (T + d + 1) values (T d raw), or its bytes when quantized (docs/format.md)."""
    _, rank, tokens, _, _, kind = segs.unbind(1)
    if bits == 8:
        return int8_segment_bytes(rank, tokens, d)
    if bits:
        return lowbit_segment_bytes(rank, tokens, d, bits, kind)
    return float_segment_numel(rank, tokens, d)


def _check_disjoint(segs, layer=None) -> None:
    """Two segments of one layer writing the same (kind, head, row) would race in the kernel; reject them."""
    _, _, tokens, dst, head, kind = segs.unbind(1)
    if len(segs) < 2:
        return
    layer = torch.zeros_like(kind) if layer is None else layer
    target = (layer * 2 + kind) * (int(head.max()) + 1) + head  # one id per (layer, kind, head)
    order = torch.argsort(target * (int((dst + tokens).max()) + 1) + dst)
    overlaps = (target[order][1:] == target[order][:-1]) & (dst[order][1:] < (dst + tokens)[order][:-1])
    if bool(overlaps.any()):
        j = int(overlaps.nonzero()[0])
        raise ValueError(f"segments {int(order[j])} and {int(order[j + 1])} write overlapping rows")


# Device helpers of the kernel, jitted with it by `_kernel_for` (plain functions until then); BITS and
# GROUP are the kernel's constexprs (a device function takes its caller's constexprs as constants).


def _scale_count(columns, tokens, key, BITS, GROUP):
    """fp16 scales of an A with ``columns`` columns (as many minima follow them): none when floating,
    one per column for INT8; INT4/INT2 one per (column, GROUP tokens) for keys, one per token for values."""
    if BITS == 0:
        n = 0
    elif BITS == 8:
        n = columns
    else:
        n = tl.where(key, (tokens + GROUP - 1) // GROUP * columns, tokens)
    return n


def _load_a(CODES, SCALES, n_scales, t, c, t_ok, c_ok, columns, tokens, key, BITS, GROUP):
    """fp32 A[t, c], zero outside t_ok x c_ok, of an A [tokens, columns] (docs/format.md): floating
    values row-major at CODES; or codes dequantized in registers, code * scale + min, with the fp16
    scales at SCALES and the minima n_scales after them: INT8 codes row-major, INT4/INT2 codes column
    by column, 8 / BITS tokens per byte (first token in the lowest bits), columns of even bytes."""
    mask = t_ok[:, None] & c_ok[None, :]
    if BITS == 0:
        a = tl.load(CODES + t[:, None] * columns + c[None, :], mask=mask, other=0).to(tl.float32)
    else:
        if BITS == 8:
            scale = tl.load(SCALES + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            low = tl.load(SCALES + n_scales + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            code = tl.load(CODES + t[:, None] * columns + c[None, :], mask=mask, other=0).to(tl.float32)
        else:
            PER_BYTE = 8 // BITS
            at = tl.where(key, t // GROUP * columns, t)[:, None] + tl.where(key, c, 0)[None, :]
            scale = tl.load(SCALES + at, mask=mask, other=0.0).to(tl.float32)
            low = tl.load(SCALES + n_scales + at, mask=mask, other=0.0).to(tl.float32)
            column_bytes = (tokens + 2 * PER_BYTE - 1) // (2 * PER_BYTE) * 2
            packed = tl.load(CODES + c[None, :] * column_bytes + (t // PER_BYTE)[:, None], mask=mask,
                             other=0).to(tl.int32)
            code = ((packed >> ((t % PER_BYTE) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
        a = code * scale + low
    return a


@functools.cache
def _kernel_for(interpret: bool):
    """Build the JIT kernel lazily: triton decides interpreter vs compiler when the decorator runs.

    The device helpers are jitted at the same time and bound in the kernel's own copy of this module's
    globals, where both the compiler and the interpreter look callees up (the interpreter ignores closures).
    """

    def reconstruct_kernel(F, F16, TILES, K, V, COS, SIN, D,
                           skh, skn, skd, svh, svn, svd, scn, scd, ssn, ssd,
                           BITS: tl.constexpr, GROUP: tl.constexpr, INTERLEAVED: tl.constexpr, IEEE_DOT: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        tile = TILES + tl.program_id(0) * 7
        src = tl.load(tile)
        rank = tl.load(tile + 1).to(tl.int32)
        tokens = tl.load(tile + 2).to(tl.int32)
        row0 = tl.load(tile + 3)
        head = tl.load(tile + 4)
        kind = tl.load(tile + 5)
        t0 = tl.load(tile + 6).to(tl.int32)

        t = t0 + tl.arange(0, BLOCK_T)  # token index inside the segment
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # RoPE pairs: channels c1[h] and c2[h]
        t_ok = t < tokens
        h_ok = h < D // 2
        if INTERLEAVED:
            c1 = 2 * h
            c2 = 2 * h + 1
        else:
            c1 = h
            c2 = h + D // 2

        # where each part of the segment starts (docs/format.md); fp16 parts are read through F16
        hdr = F16 + src // 2
        key = kind == 0
        if rank < 0:  # raw (RAW_RANK): X itself, the A [tokens, d] of a rank-d segment without Σ and B = I
            raw_scales = _scale_count(D, tokens, key, BITS, GROUP)
            raw_codes = F + src + 4 * raw_scales
            acc1 = _load_a(raw_codes, hdr, raw_scales, t, c1, t_ok, h_ok, D, tokens, key, BITS, GROUP)
            acc2 = _load_a(raw_codes, hdr, raw_scales, t, c2, t_ok, h_ok, D, tokens, key, BITS, GROUP)
        else:
            n_scales = _scale_count(rank, tokens, key, BITS, GROUP)
            if BITS == 0:  # A [tokens, rank], Σ [rank], B [d, rank]
                a_ptr = F + src
                a_scale_ptr = hdr  # no scales: load_a reads the values as they are
                s_ptr = F + src + tokens * rank
                b_ptr = s_ptr + rank
            elif BITS == 8:  # fp16 Σ, A scale, A min, B scale, B min [rank]; codes A [T', rank], B [d, rank]
                s_ptr = hdr
                a_scale_ptr = hdr + rank
                b_scale_ptr = hdr + 3 * rank
                a_ptr = F + src + 10 * rank
                b_ptr = a_ptr + (tokens + tokens % 2) * rank
            else:  # fp16 Σ, B scale, B min [rank], A scales, A minima; codes B [d, rank], A [rank, T' / PER_BYTE]
                s_ptr = hdr
                b_scale_ptr = hdr + rank
                a_scale_ptr = hdr + 3 * rank
                b_ptr = F + src + 6 * rank + 4 * n_scales
                a_ptr = b_ptr + D * rank
            acc1 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                r_ok = r < rank
                b_mask = r_ok[:, None] & h_ok[None, :]
                s = tl.load(s_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
                b1 = tl.load(b_ptr + c1[None, :] * rank + r[:, None], mask=b_mask, other=0)  # Bᵀ, first channels
                b2 = tl.load(b_ptr + c2[None, :] * rank + r[:, None], mask=b_mask, other=0)  # Bᵀ, partners
                # Σ fused into A's columns; quantized lanes past the rank have scale = min = 0, so stay 0
                a = _load_a(a_ptr, a_scale_ptr, n_scales, t, r, t_ok, r_ok, rank, tokens, key, BITS, GROUP) * s[None, :]
                if BITS == 0:
                    a = a.to(F.dtype.element_ty)
                else:  # dequantize B in registers too, then fp16 tiles for the dots
                    b_scale = tl.load(b_scale_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
                    b_min = tl.load(b_scale_ptr + rank + r, mask=r_ok, other=0.0).to(tl.float32)
                    b1 = (b1.to(tl.float32) * b_scale[:, None] + b_min[:, None]).to(tl.float16)
                    b2 = (b2.to(tl.float32) * b_scale[:, None] + b_min[:, None]).to(tl.float16)
                    a = a.to(tl.float16)
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

    scope = {**globals(), "_scale_count": triton.jit(_scale_count), "_load_a": triton.jit(_load_a)}
    return triton.jit(types.FunctionType(reconstruct_kernel.__code__, scope))


def _kernel():
    return _kernel_for(_interpreting())
