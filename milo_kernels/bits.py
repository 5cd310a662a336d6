"""Rebuild one layer's K and V straight from per-component bit codes (issue 45, "rebuild on the device").

The buffers describe components, not stores: ``data`` is a flat uint8 buffer; component k of the
``components`` table (int64 [C, 4], COMPONENT_COLUMNS) has four fp16 parameters (coefficient scale and
minimum, basis scale and minimum; little-endian, at any byte offset) at ``params_offset``, its INT8 basis
column [d] at ``basis_offset`` and its T coefficient codes at ``width`` bits (1..8, least significant bit
first, token after token) at ``codes_offset``. A segment row (int64 [S, 6], BITS_SEGMENT_COLUMNS) rebuilds
X = Σⱼ ĉⱼ V̂ⱼᵀ over its ``components`` consecutive table rows from ``first_component``, multiplies channel c
by ``channel_scale[kind, head, c]`` (the inverse channel weights of a query-weighted basis; ones for
none) and writes it to out[head, dst_row: dst_row + tokens], keys rotated by RoPE at those rows.

Why a kernel of its own: the low-rank kernel reads fp16 (or one-width) factors, so a bits block had to
be decoded on the host into fp16 factors first, twice its bytes. Here one program per (segment, BLOCK_T
tokens, BLOCK_H RoPE pairs) unpacks each component's codes at its own width in registers, dequantizes
its basis, and accumulates in fp32 from fp16 tiles on tensor cores; nothing but K and V is written.

`reconstruct_bits_layer` dispatches like `reconstruct.reconstruct_layer`: CUDA tensors (or MILO_KERNEL=
triton with TRITON_INTERPRET=1 on CPU) to the Triton kernel, other CPU tensors to the batched
`cpu.reconstruct_bits_layer_cpu`; MILO_KERNEL=reference to `naive.reconstruct_bits_layer_naive`, the
plain-PyTorch definition the kernel and the CPU path are held to.
"""
from dataclasses import dataclass

import torch

from . import triton_kernel
from .cpu import reconstruct_bits_layer_cpu
from .naive import reconstruct_bits_layer_naive
from .plan import _upload, check_tensors
from .reconstruct import check_rope_layout, kernel_backend

COMPONENT_COLUMNS = ("params_offset", "basis_offset", "codes_offset", "width")
BITS_SEGMENT_COLUMNS = ("first_component", "components", "tokens", "dst_row", "head", "kind")
PARAM_BYTES = 8  # four fp16 parameters per component


@dataclass(frozen=True)
class BitsPlan:
    """A validated layer: its tile table (segment columns, then the tile's first token) and component
    table, on the device."""

    tiles: torch.Tensor  # int64 [n_tiles, 7]
    components: torch.Tensor  # int64 [C, 4]
    d: int
    need_rows: int
    need_heads: int
    block_t: int
    block_r: int
    block_h: int
    num_warps: int
    num_stages: int


def bits_tile_config(d: int) -> dict:
    """64 tokens x up to 32 RoPE pairs per program, 16 components per step (tl.dot's smallest), 4 warps:
    the low-rank kernel's tiling, which spills nothing here either (tools/compile_kernels.py, `bits`)."""
    block_h = min(32, max(16, 1 << max(d // 2 - 1, 0).bit_length()))
    return dict(block_t=64, block_r=16, block_h=block_h, num_warps=4, num_stages=2)


def check_buffers(data, channel_scale, out_k, out_v, cos, sin) -> None:
    """Dtype, shape and device checks that need no table values (so `launch_bits` stays free of host syncs)."""
    check_tensors(out_k.new_empty(0), out_k, out_v, cos, sin)
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise TypeError(f"data must be a 1-D contiguous uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    n_heads, _, d = out_k.shape
    if channel_scale.dtype != torch.float32 or channel_scale.shape != (2, n_heads, d):
        raise ValueError(f"channel_scale must be fp32 [2, {n_heads}, {d}], got {channel_scale.dtype} "
                         f"{tuple(channel_scale.shape)}")
    if len({t.device for t in (data, channel_scale, out_k)}) != 1:
        raise ValueError("data, channel_scale and the outputs must share a device")


def check_bits_tables(data, components, segments, d: int):
    """Validate a layer's tables against ``data`` and the head dim, whatever the outputs (their rows and heads
    are the plan's need_rows and need_heads); returns (components, segments) as CPU int64."""
    for name, table, columns in (("components", components, COMPONENT_COLUMNS),
                                 ("segments", segments, BITS_SEGMENT_COLUMNS)):
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != len(columns):
            raise ValueError(f"{name} must be int64 [n, {len(columns)}] with columns {columns}, "
                             f"got {table.dtype} {tuple(table.shape)}")
    comps, segs = components.cpu(), segments.cpu()
    first, count, tokens, dst, head, kind = segs.unbind(1)
    _require(segs, BITS_SEGMENT_COLUMNS, (
        ((first >= 0) & (count >= 0) & (first + count <= len(comps)), f"components fall outside the table ({len(comps)})"),
        (count <= d, f"more than d={d} components"),
        (tokens > 0, "tokens must be positive"),
        (dst >= 0, "dst_row is negative"),
        (head >= 0, "head is negative"),
        ((kind == 0) | (kind == 1), "kind must be 0 (key) or 1 (value)"),
    ))
    p, b, c, w = comps.unbind(1)
    owner = torch.repeat_interleave(torch.arange(len(segs)), count)  # each used component's segment
    used_tokens = torch.zeros(len(comps), dtype=torch.int64)
    used_tokens[torch.repeat_interleave(first, count) + (torch.arange(len(owner)) - torch.repeat_interleave(
        torch.cumsum(count, 0) - count, count))] = tokens[owner]
    n = data.numel()
    _require(comps, COMPONENT_COLUMNS, (
        ((w >= 1) & (w <= 8), "width must be in 1..8 (a dropped component has no row)"),
        ((p >= 0) & (p + PARAM_BYTES <= n), f"parameters fall outside data ({n} bytes)"),
        ((b >= 0) & (b + d <= n), f"the basis column falls outside data ({n} bytes)"),
        ((c >= 0) & (c + (used_tokens * w + 7) // 8 <= n), f"the codes fall outside data ({n} bytes)"),
    ))
    target = kind * (int(head.max()) + 1 if len(segs) else 1) + head
    order = torch.argsort(target * (int((dst + tokens).max()) + 1 if len(segs) else 1) + dst)
    t, s = target[order], dst[order]
    if bool(((t[1:] == t[:-1]) & (s[1:] < (dst + tokens)[order][:-1])).any()):  # would race in the kernel
        raise ValueError("two segments write overlapping rows")
    return comps, segs


def check_bits_layer(data, components, segments, channel_scale, out_k, out_v, cos, sin):
    """Validate a layer's tables against its buffers; returns (components, segments) as CPU int64."""
    check_buffers(data, channel_scale, out_k, out_v, cos, sin)
    n_heads, n_rows, d = out_k.shape
    comps, segs = check_bits_tables(data, components, segments, d)
    _require(segs, BITS_SEGMENT_COLUMNS, (
        (segs[:, 3] + segs[:, 2] <= n_rows, f"rows fall outside the output's N={n_rows}"),
        (segs[:, 4] < n_heads, f"head must be in [0, {n_heads})"),
    ))
    return comps, segs


def _require(table, columns, rules) -> None:
    for ok, message in rules:
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise ValueError(f"row {i} {dict(zip(columns, table[i].tolist()))}: {message}")


def plan_bits_tables(data, components, segments, d: int, **tiles) -> BitsPlan:
    """Validate a layer's tables on the host (against ``data``, not yet the outputs: `launch_bits` checks
    those against need_rows and need_heads) and build the tile table; both go up in non-blocking copies, so a
    caller plans once (a `PrefixRebuild` at admission) and only launches per layer."""
    triton_kernel.require_triton(data)
    comps, segs = check_bits_tables(data, components, segments, d)
    config = {**bits_tile_config(d), **{k: v for k, v in tiles.items() if v is not None}}
    for name in ("block_t", "block_r", "block_h"):
        if config[name] < 16 or config[name] & (config[name] - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {config[name]}")
    n_tiles = (segs[:, 2] + config["block_t"] - 1) // config["block_t"]
    owner = torch.repeat_interleave(torch.arange(len(segs)), n_tiles)
    t0 = (torch.arange(len(owner)) - (torch.cumsum(n_tiles, 0) - n_tiles)[owner]) * config["block_t"]
    table = torch.cat([segs[owner], t0[:, None]], dim=1)
    return BitsPlan(tiles=_upload(table, data.device), components=_upload(comps, data.device), d=d,
                    need_rows=int((segs[:, 3] + segs[:, 2]).max()) if len(segs) else 0,
                    need_heads=int(segs[:, 4].max()) + 1 if len(segs) else 0, **config)


def plan_bits_layer(data, components, segments, channel_scale, out_k, out_v, cos, sin, **tiles) -> BitsPlan:
    """`plan_bits_tables` after checking the tables against these buffers too."""
    check_bits_layer(data, components, segments, channel_scale, out_k, out_v, cos, sin)
    return plan_bits_tables(data, components, segments, out_k.shape[-1], **tiles)


def launch_bits(plan: BitsPlan, data, channel_scale, out_k, out_v, cos, sin, *, interleaved=False,
                rotary_dim=None) -> None:
    """One Triton launch for a planned layer; checks metadata only (no host sync)."""
    triton_kernel.require_triton(data)
    check_buffers(data, channel_scale, out_k, out_v, cos, sin)
    check_rope_layout(out_k.shape[-1], interleaved, rotary_dim)
    n_heads, n_rows, d = out_k.shape
    if d != plan.d or n_rows < plan.need_rows or n_heads < plan.need_heads or plan.tiles.device != data.device:
        raise ValueError("buffers do not match the plan (d, rows, heads or device differ)")
    if len(plan.tiles) == 0:
        return
    grid = (len(plan.tiles), triton_kernel.triton.cdiv(d // 2, plan.block_h))
    triton_kernel.bits_kernel()[grid](
        data, plan.components, plan.tiles, channel_scale, out_k, out_v, cos, sin, d, (rotary_dim or d) // 2,
        *channel_scale.stride(), *out_k.stride(), *out_v.stride(), *cos.stride(), *sin.stride(),
        INTERLEAVED=bool(interleaved), PARTIAL=rotary_dim not in (None, d), BLOCK_T=plan.block_t, BLOCK_R=plan.block_r, BLOCK_H=plan.block_h,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )


def reconstruct_bits_layer(data, components, segments, channel_scale, out_k, out_v, cos, sin, *,
                           interleaved=False, rotary_dim=None, backend: str | None = None) -> None:
    """Write every segment's X (keys rotated) into out_k / out_v: the Triton kernel for CUDA tensors (or
    ``backend="triton"``, MILO_KERNEL=triton), the batched CPU path for CPU tensors (`cpu`), the plain-PyTorch
    definition for ``backend="reference"`` (MILO_KERNEL=reference). The RoPE layout is `reconstruct_layer`'s."""
    choice = kernel_backend(data.device, backend)
    if choice == "triton":
        plan = plan_bits_layer(data, components, segments, channel_scale, out_k, out_v, cos, sin)
        launch_bits(plan, data, channel_scale, out_k, out_v, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    else:
        comps, segs = check_bits_layer(data, components, segments, channel_scale, out_k, out_v, cos, sin)
        check_rope_layout(out_k.shape[-1], interleaved, rotary_dim)
        rebuild = reconstruct_bits_layer_naive if choice == "reference" else reconstruct_bits_layer_cpu
        rebuild(data, comps, segs, channel_scale, out_k, out_v, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
