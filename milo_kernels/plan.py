"""Validation and planning for the Triton kernel: a layer's segment table checked against its buffers and
expanded into one row per program (the tile table), built on the host and uploaded at once.

No host synchronisation when the segment table is a CPU tensor: validation and the tile table are
built on the host and the table goes up with one non-blocking copy from pinned memory. A segment table
on the device is accepted too, but reading it back synchronises. Planning is host work of about a
millisecond per call (many small tensor ops), so a query plans every layer at once with `plan_layers`
(one pass, one upload) and passes each layer's plan to `reconstruct_layer`, which then only launches.

`tile_config` picks the tiles per head dim so that no variant spills registers (tools/compile_kernels.py
checks it for sm_80 and sm_90).
"""
from dataclasses import dataclass

import torch

from milo_format import QUANT_BITS, RAW_RANK, segment_size
from . import triton_kernel

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FACTOR_DTYPES = FLOAT_DTYPES + (torch.uint8,)  # uint8: quantized segments (INT8, INT4, INT2)
UINT8_BITS = {None: QUANT_BITS["int8"], **QUANT_BITS}  # code width of uint8 factors; None reads as INT8 (older stores)
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


def plan_layer(factors, segments, out_k, out_v, cos, sin, *, quant=None, **tiles) -> Plan:
    """Validate a layer's segments against its buffers and build the Triton tile table.

    Works on the host: a CPU segment table costs no device synchronisation (a device one is read back,
    which does); the tile table is uploaded with one non-blocking copy from pinned memory. Tile sizes
    (block_t, block_r, block_h, num_warps, num_stages) default to `tile_config`; any can be overridden
    (block_* powers of two >= 16).
    """
    triton_kernel.require_triton(factors)
    bits = factor_bits(factors.dtype, quant)
    segs = check_all(factors, segments, out_k, out_v, cos, sin, bits)
    return _plan(segs[None], out_k.shape[-1], bits, factors.device, tiles)[0]


def plan_layers(segments, d: int, *, factor_dtype, device, quant=None, **tiles) -> list[Plan]:
    """Plans for every layer of one retrieval: segments int64 [L, S, 6] on the CPU, validated and tiled
    in one host pass and uploaded in one non-blocking copy. The bounds that need the buffers (factors
    length, output rows and heads) are checked by `launch` against each plan.
    """
    if triton_kernel.triton is None:
        raise RuntimeError("triton is not installed; plan_layers is for the Triton backend")
    if segments.dtype != torch.int64 or segments.dim() != 3 or segments.shape[2] != len(SEGMENT_COLUMNS):
        raise ValueError(f"segments must be int64 [L, S, {len(SEGMENT_COLUMNS)}], got {segments.dtype} "
                         f"{tuple(segments.shape)}")
    segs = segments.cpu()
    bits = factor_bits(factor_dtype, quant)
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
    src, rank, tokens, dst, head, kind = flat.unbind(1)
    n_tiles = (tokens + config["block_t"] - 1) // config["block_t"]
    owner = torch.repeat_interleave(torch.arange(len(flat)), n_tiles)
    first_tile = torch.cumsum(n_tiles, 0) - n_tiles
    t0 = (torch.arange(len(owner)) - first_tile[owner]) * config["block_t"]
    table = _upload(torch.cat([flat[owner], t0[:, None]], dim=1), device)
    per_layer = n_tiles.view(L, S).sum(1).tolist()
    ends = (src + segment_size(rank, tokens, d, bits, kind)).view(L, S)
    rows, heads = (dst + tokens).view(L, S), head.view(L, S)
    need = [(0, 0, 0)] * L if S == 0 else zip(ends.amax(1).tolist(), rows.amax(1).tolist(), (heads.amax(1) + 1).tolist())
    return [Plan(tiles=t, d=d, need_numel=n, need_rows=r, need_heads=h, bits=bits, **config)
            for t, (n, r, h) in zip(table.split(per_layer), need)]


def factor_bits(factor_dtype, quant) -> int:
    """0 for floating factors, else the code width of the uint8 factors' quantization."""
    if quant not in UINT8_BITS:
        raise ValueError(f"unknown low-bit quantization {quant!r}; expected None, 'int8', 'int4' or 'int2'")
    return UINT8_BITS[quant] if factor_dtype == torch.uint8 else 0


def _upload(table, device):
    """The host-built table on `device`: pinned and non-blocking to CUDA, so the host never waits."""
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def check_tensors(factors, out_k, out_v, cos, sin) -> None:
    """Dtype, shape and device checks that need no segment values (``cos``, ``sin`` None: no RoPE tables)."""
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
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must both be given (keys rotated) or both be None (keys as stored)")
    for name, table in (("cos", cos), ("sin", sin)) if cos is not None else ():
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != d or table.shape[0] < n_rows:
            raise ValueError(f"{name} must be fp32 [>= {n_rows}, {d}], got {table.dtype} {tuple(table.shape)}")
    devices = {t.device for t in (factors, out_k, out_v, cos, sin) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"factors, out_k, out_v, cos and sin must share a device, got {sorted(map(str, devices))}")


def check_all(factors, segments, out_k, out_v, cos, sin, bits: int) -> torch.Tensor:
    """Full validation; returns the segment table as a CPU int64 tensor (read back if it was on a device).

    bits: `factor_bits` of the factors (0 floating; 8, 4 or 2 the quantization of uint8 factors)."""
    check_tensors(factors, out_k, out_v, cos, sin)
    if segments.dtype != torch.int64 or segments.dim() != 2 or segments.shape[1] != len(SEGMENT_COLUMNS):
        raise ValueError(f"segments must be int64 [S, {len(SEGMENT_COLUMNS)}] with columns {SEGMENT_COLUMNS}, "
                         f"got {segments.dtype} {tuple(segments.shape)}")
    segs = segments.cpu()
    n_heads, n_rows, d = out_k.shape
    src, rank, tokens, dst, head, kind = segs.unbind(1)
    _check_rules(segs, _structure_rules(segs, d, bits) + (
        (src + segment_size(rank, tokens, d, bits, kind) <= factors.numel(),
         f"reads past the end of factors ({factors.numel()})"),
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
