"""Rebuild one layer's K and V from packed low-rank factors into an attention buffer, keys rotated by RoPE.

`reconstruct_layer` validates its inputs, then dispatches: CUDA tensors go to one Triton launch for the
whole layer (`triton_kernel.py`, planned by `plan.py`), CPU tensors to the batched CPU path
(`cpu.reconstruct_layer_cpu`). A caller may force a backend (``backend=``); otherwise the process's
default holds, which the environment variable MILO_KERNEL=reference|triton sets, read once
(`default_backend`). `reference` is the literal PyTorch oracle (`naive.reconstruct_layer_naive`) on
any device; Triton on CPU tensors needs TRITON_INTERPRET=1. On CPU tensors INT8 is dequantized per
segment by the CPU path and INT4/INT2 layers are expanded first (`lowbit.dequantize_lowbit_layer`).

`launch` checks tensor metadata against the plan, never segment values, so it can also be captured in
a CUDA graph.
"""
import functools
import os

import torch

from milo_format import SCALE_SPAN
from . import triton_kernel
from .cpu import reconstruct_layer_cpu
from .lowbit import dequantize_lowbit_layer
from .naive import reconstruct_layer_naive
from .plan import Plan, check_all, check_tensors, factor_bits, plan_layer

BACKENDS = ("auto", "reference", "triton")  # "auto": Triton for CUDA tensors, the batched CPU path otherwise


def reconstruct_layer(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, rotary_dim=None, quant=None,
                      plan: "Plan | None" = None, backend: str | None = None) -> None:
    """Write X = A diag(Σ) Bᵀ of every segment (X itself when raw, rank RAW_RANK) to out[head, dst_row:
    dst_row + tokens], keys rotated by RoPE.

    factors: 1-D contiguous fp16/bf16/fp32, or uint8 holding ``quant`` segments (int8 when None, int4
    or int2; src_offset in bytes, even); segments: int64 [S, 6] (see SEGMENT_COLUMNS), best on the CPU
    (a device table is read back, a sync); out_k, out_v: [kv_heads, N, d]; cos, sin: fp32 [>= N, d].
    Only the segments' rows are written. ``plan``: these segments' plan from `plan_layers`, used by the
    Triton backend instead of planning again (the other backends take the segments). ``backend``: one
    of BACKENDS, for callers that must choose (a comparison of backends); None takes `default_backend`.
    The RoPE layout: ``interleaved`` pairs (2i, 2i + 1), else rotate-half's (j, j + rotary_dim/2) over the first
    ``rotary_dim`` channels (None: the whole head; `naive.rotate`).
    """
    bits = factor_bits(factors.dtype, quant)
    backend = kernel_backend(factors.device, backend)
    if backend in ("reference", "cpu"):
        segs = check_all(factors, segments, out_k, out_v, cos, sin, bits)
        check_rope_layout(out_k.shape[-1], interleaved, rotary_dim)
        if bits in (4, 2):  # the CPU and reference paths rebuild expanded fp16 factors
            factors, segs = dequantize_lowbit_layer(factors, segs, out_k.shape[-1], quant)
        rebuild = reconstruct_layer_naive if backend == "reference" else reconstruct_layer_cpu
        rebuild(factors, segs, out_k, out_v, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    else:
        if plan is None:
            plan = plan_layer(factors, segments, out_k, out_v, cos, sin, quant=quant)
        launch(plan, factors, out_k, out_v, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)


def check_rope_layout(d: int, interleaved: bool, rotary_dim: int | None) -> None:
    """Refuse a RoPE layout the kernels cannot pair: a rotate-half rotary_dim that is odd, not in 1..d, or given
    with interleaved pairs (whose partial rotary is carried by identity tables alone)."""
    if rotary_dim is None:
        return
    if interleaved:
        raise ValueError(f"rotary_dim={rotary_dim} is for rotate-half pairs; interleaved pairs turn a partial "
                         "rotary by identity tables past it, with rotary_dim None")
    if not (isinstance(rotary_dim, int) and 0 < rotary_dim <= d and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim must be an even number of channels in 2..{d} (the head), got {rotary_dim!r}")


def decode_layer(factors, segments, out_k, out_v, *, quant=None) -> None:
    """`reconstruct_layer`'s CPU path without RoPE: X of every segment into fp32 out[head, dst_row: dst_row +
    tokens], keys as stored (pre-RoPE). Rotating those keys afterwards with `cpu.rope` at the rows' positions gives
    what `reconstruct_layer` writes on a CPU, to the bit: a block that several rows place at different positions is
    decoded once and rotated for each (`milo_infer.runtime.prefix.PrefixRebuild`)."""
    if out_k.dtype != torch.float32 or out_v.dtype != torch.float32:
        raise TypeError(f"decode_layer writes fp32 (the rotation that follows is fp32), got {out_k.dtype}")
    bits = factor_bits(factors.dtype, quant)
    segs = check_all(factors, segments, out_k, out_v, None, None, bits)
    if bits in (4, 2):
        factors, segs = dequantize_lowbit_layer(factors, segs, out_k.shape[-1], quant)
    reconstruct_layer_cpu(factors, segs, out_k, out_v, None, None)


def launch(plan: Plan, factors, out_k, out_v, cos, sin, *, interleaved=False, rotary_dim=None) -> None:
    """One Triton launch for a planned layer. Checks metadata only: no host sync, safe to graph-capture."""
    triton_kernel.require_triton(factors)
    check_tensors(factors, out_k, out_v, cos, sin)
    check_rope_layout(out_k.shape[-1], interleaved, rotary_dim)
    n_heads, n_rows, d = out_k.shape
    if (d != plan.d or factors.numel() < plan.need_numel or n_rows < plan.need_rows
            or n_heads < plan.need_heads or plan.tiles.device != factors.device
            or plan.quantized != (factors.dtype == torch.uint8)):
        raise ValueError("buffers do not match the plan (d, factors length or kind, rows, heads or device differ)")
    if len(plan.tiles) == 0:
        return
    # quantized headers and scales are fp16: an fp16 alias of the same bytes (alignment checked above)
    header = factors[:factors.numel() // 2 * 2].view(torch.float16) if plan.quantized else factors
    grid = (len(plan.tiles), triton_kernel.triton.cdiv(d // 2, plan.block_h))
    triton_kernel.kernel()[grid](
        factors, header, plan.tiles, out_k, out_v, cos, sin, d, (rotary_dim or d) // 2,
        *out_k.stride(), *out_v.stride(), *cos.stride(), *sin.stride(),
        BITS=plan.bits,
        SPAN=SCALE_SPAN,
        INTERLEAVED=bool(interleaved),
        PARTIAL=rotary_dim not in (None, d),
        IEEE_DOT=factors.dtype == torch.float32,
        BLOCK_T=plan.block_t,
        BLOCK_R=plan.block_r,
        BLOCK_H=plan.block_h,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )


def kernel_backend(device, backend: str | None = None) -> str:
    """What rebuilds tensors on ``device``: "triton", "cpu" or "reference", as ``backend`` (one of BACKENDS;
    None: `default_backend`) asks."""
    choice = default_backend() if backend is None else backend
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" else "cpu"
    return choice


@functools.cache
def default_backend() -> str:
    """The backend MILO_KERNEL asks for ("reference" or "triton"; unset or empty: "auto"), read on first use
    and kept, so that one process rebuilds every layer the same way."""
    choice = os.environ.get("MILO_KERNEL", "").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"MILO_KERNEL must be 'reference' or 'triton', got {choice!r}")
    return choice
