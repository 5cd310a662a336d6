"""The Triton kernel that rebuilds one layer's K and V from a tile table (`plan.py` builds the table,
`reconstruct.launch` launches it), and the checks that Triton can run here.

Why one program per (segment, BLOCK_T tokens, BLOCK_H channel pairs): every program reads its rows of A,
all of Σ and its columns of B (both stay in L2 across a segment's programs), multiplies on tensor cores
with fp32 accumulation, and writes finished, rotated rows. The two RoPE partners of each output channel
are produced as two accumulators (the "first" and "second" channel of every pair), so the rotation
happens in registers and K is written once.

Quantized stores (uint8 factors, docs/format.md; src_offset counts bytes and is even, so the fp16
parts are read through an fp16 view of the same buffer at src / 2): the kernel reads the codes and
their scales in place and dequantizes a tile in registers (code * scale + min, Σ folded into A), then
feeds fp16 tiles to the same fp32-accumulating dots; no floating copy of the factors is written.
INT8 has one scale per factor column; INT4/INT2 unpack 2 or 4 tokens per byte of A, with a scale per
(column, 32-token span) for keys and per token for values (the ``BITS`` constexpr: 0 floating, 8, 4, 2).

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

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs neither
    triton = tl = None


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter (Triton on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def require_triton(factors) -> None:
    """Raise, saying what to set, unless the Triton kernel can run on ``factors``' device."""
    if triton is None:
        raise RuntimeError("the Triton kernel needs the triton package; set MILO_KERNEL=reference to use PyTorch")
    if not factors.is_cuda:
        if not interpreting():
            raise RuntimeError("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                               "(set before the kernel is first used); or set MILO_KERNEL=reference")
        if factors.dtype == torch.bfloat16:
            raise TypeError("the Triton interpreter has no bf16; use fp16/fp32 or MILO_KERNEL=reference")


# Device helpers of the kernel, jitted with it by `kernel_for` (plain functions until then); BITS and
# SPAN are the kernel's constexprs (a device function takes its caller's constexprs as constants).


def _scale_count(columns, tokens, key, BITS, SPAN):
    """fp16 scales of an A with ``columns`` columns (as many minima follow them): none when floating,
    one per column for INT8; INT4/INT2 one per (column, SPAN tokens) for keys, one per token for values."""
    if BITS == 0:
        n = 0
    elif BITS == 8:
        n = columns
    else:
        n = tl.where(key, (tokens + SPAN - 1) // SPAN * columns, tokens)
    return n


def _load_a(CODES, SCALES, n_scales, t, c, t_ok, c_ok, columns, tokens, key, BITS, SPAN):
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
            at = tl.where(key, t // SPAN * columns, t)[:, None] + tl.where(key, c, 0)[None, :]
            scale = tl.load(SCALES + at, mask=mask, other=0.0).to(tl.float32)
            low = tl.load(SCALES + n_scales + at, mask=mask, other=0.0).to(tl.float32)
            column_bytes = (tokens + 2 * PER_BYTE - 1) // (2 * PER_BYTE) * 2
            packed = tl.load(CODES + c[None, :] * column_bytes + (t // PER_BYTE)[:, None], mask=mask,
                             other=0).to(tl.int32)
            code = ((packed >> ((t % PER_BYTE) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
        a = code * scale + low
    return a


def _rope_pairs(D, ROT_HALF, INTERLEAVED, PARTIAL, BLOCK_H):
    """This program's BLOCK_H RoPE pairs of a head of D channels: which exist, and their two channels c1 and c2
    (neighbours when INTERLEAVED, else D / 2 apart; when PARTIAL, rotate-half over the first 2 * ROT_HALF channels
    only, ROT_HALF apart, and the unturned channels 2 * ROT_HALF .. D - 1 paired too, (h + ROT_HALF, h + D / 2) for
    pairs h >= ROT_HALF, so that every channel is written once: their tables are the identity). PARTIAL is a
    constexpr so the whole-head kernels compile as they did without it (one occupancy step kept: sm_90's INT4)."""
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if INTERLEAVED:
        c1 = 2 * h
        c2 = 2 * h + 1
    elif PARTIAL:
        turned = h < ROT_HALF
        c1 = tl.where(turned, h, h + ROT_HALF)
        c2 = tl.where(turned, h + ROT_HALF, h + D // 2)
    else:
        c1 = h
        c2 = h + D // 2
    return h < D // 2, c1, c2


def _store_rows(K, V, COS, SIN, head, rows, mask, c1, c2, acc1, acc2, kind,
                skh, skn, skd, svh, svn, svd, scn, scd, ssn, ssd):
    """Write finished rows of both kernels: a key's RoPE pairs (c1, c2) rotated in fp32 at its rows'
    positions, a value as it is."""
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


def _jit_with(kernel, **helpers):
    """Jit ``kernel`` with its device helpers jitted and bound in its own copy of this module's globals, where
    both the compiler and the interpreter look callees up (the interpreter ignores closures). A function made
    from a code object carries no annotations, so the constexprs are copied over: without them nothing compiles
    on a GPU (seen on an H200, 2026-12-04)."""
    scope = {**globals(), **{name: triton.jit(fn) for name, fn in helpers.items()}}
    bound = types.FunctionType(kernel.__code__, scope)
    bound.__annotations__ = kernel.__annotations__
    return triton.jit(bound)


@functools.cache
def kernel_for(interpret: bool):
    """Build the JIT kernel lazily: triton decides interpreter vs compiler when the decorator runs.

    The device helpers are jitted at the same time and bound in the kernel's own copy of this module's
    globals, where both the compiler and the interpreter look callees up (the interpreter ignores closures).
    """

    def reconstruct_kernel(F, F16, TILES, K, V, COS, SIN, D, ROT_HALF,
                           skh, skn, skd, svh, svn, svd, scn, scd, ssn, ssd,
                           BITS: tl.constexpr, SPAN: tl.constexpr, INTERLEAVED: tl.constexpr, PARTIAL: tl.constexpr,
                           IEEE_DOT: tl.constexpr,
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
        t_ok = t < tokens
        h_ok, c1, c2 = _rope_pairs(D, ROT_HALF, INTERLEAVED, PARTIAL, BLOCK_H)

        # where each part of the segment starts (docs/format.md); fp16 parts are read through F16
        hdr = F16 + src // 2
        key = kind == 0
        if rank < 0:  # raw (RAW_RANK): X itself, the A [tokens, d] of a rank-d segment without Σ and B = I
            raw_scales = _scale_count(D, tokens, key, BITS, SPAN)
            raw_codes = F + src + 4 * raw_scales
            acc1 = _load_a(raw_codes, hdr, raw_scales, t, c1, t_ok, h_ok, D, tokens, key, BITS, SPAN)
            acc2 = _load_a(raw_codes, hdr, raw_scales, t, c2, t_ok, h_ok, D, tokens, key, BITS, SPAN)
        else:
            n_scales = _scale_count(rank, tokens, key, BITS, SPAN)
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
                a = _load_a(a_ptr, a_scale_ptr, n_scales, t, r, t_ok, r_ok, rank, tokens, key, BITS, SPAN) * s[None, :]
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

        _store_rows(K, V, COS, SIN, head, row0 + t, t_ok[:, None] & h_ok[None, :], c1, c2, acc1, acc2, kind,
                    skh, skn, skd, svh, svn, svd, scn, scd, ssn, ssd)

    return _jit_with(reconstruct_kernel, _scale_count=_scale_count, _load_a=_load_a, _rope_pairs=_rope_pairs,
                     _store_rows=_store_rows)


def kernel():
    """The kernel built for this process's mode (compiled, or interpreted under TRITON_INTERPRET=1)."""
    return kernel_for(interpreting())


def _half(DATA, at, mask):
    """fp32 of the little-endian fp16 at byte ``at`` of the uint8 buffer DATA (any alignment), 0 where masked."""
    lo = tl.load(DATA + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(DATA + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@functools.cache
def bits_kernel_for(interpret: bool):
    """The kernel that rebuilds K/V from per-component bit codes (`milo_kernels.bits` documents its tables),
    built lazily like `kernel_for`, its constexpr annotations kept."""

    def reconstruct_bits_kernel(DATA, COMPONENTS, TILES, SCALE, K, V, COS, SIN, D, ROT_HALF,
                                sxk, sxh, sxd, skh, skn, skd, svh, svn, svd, scn, scd, ssn, ssd,
                                INTERLEAVED: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_R: tl.constexpr,
                                BLOCK_H: tl.constexpr):
        tile = TILES + tl.program_id(0) * 7
        first = tl.load(tile)
        count = tl.load(tile + 1).to(tl.int32)
        tokens = tl.load(tile + 2).to(tl.int32)
        row0 = tl.load(tile + 3)
        head = tl.load(tile + 4)
        kind = tl.load(tile + 5)
        t0 = tl.load(tile + 6).to(tl.int32)

        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < tokens
        h_ok, c1, c2 = _rope_pairs(D, ROT_HALF, INTERLEAVED, PARTIAL, BLOCK_H)

        acc1 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for r0 in range(0, count, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < count
            row = COMPONENTS + (first + r) * 4
            params_at = tl.load(row, mask=r_ok, other=0)
            basis_at = tl.load(row + 1, mask=r_ok, other=0)
            codes_at = tl.load(row + 2, mask=r_ok, other=0)
            width = tl.load(row + 3, mask=r_ok, other=0).to(tl.int32)
            # lanes past the count have scale = min = 0, so their coefficients and basis values are 0
            scale = _half(DATA, params_at, r_ok)
            low = _half(DATA, params_at + 2, r_ok)
            b_scale = _half(DATA, params_at + 4, r_ok)
            b_low = _half(DATA, params_at + 6, r_ok)
            # token t's code starts at bit t * width of its component and may run into the next byte
            bit = t[:, None] * width[None, :]
            byte = codes_at[None, :] + (bit >> 3)
            shift = bit & 7
            a_mask = t_ok[:, None] & r_ok[None, :]
            lo = tl.load(DATA + byte, mask=a_mask, other=0).to(tl.int32)
            hi = tl.load(DATA + byte + 1, mask=a_mask & (shift + width[None, :] > 8), other=0).to(tl.int32)
            code = ((lo | (hi << 8)) >> shift) & ((1 << width[None, :]) - 1)
            a = (code.to(tl.float32) * scale[None, :] + low[None, :]).to(tl.float16)
            b_mask = r_ok[:, None] & h_ok[None, :]
            b1 = tl.load(DATA + basis_at[:, None] + c1[None, :], mask=b_mask, other=0).to(tl.float32)
            b2 = tl.load(DATA + basis_at[:, None] + c2[None, :], mask=b_mask, other=0).to(tl.float32)
            b1 = (b1 * b_scale[:, None] + b_low[:, None]).to(tl.float16)
            b2 = (b2 * b_scale[:, None] + b_low[:, None]).to(tl.float16)
            acc1 = tl.dot(a, b1, acc1)
            acc2 = tl.dot(a, b2, acc2)

        unit = SCALE + kind * sxk + head * sxh
        acc1 = acc1 * tl.load(unit + c1 * sxd, mask=h_ok, other=0.0)[None, :]
        acc2 = acc2 * tl.load(unit + c2 * sxd, mask=h_ok, other=0.0)[None, :]
        _store_rows(K, V, COS, SIN, head, row0 + t, t_ok[:, None] & h_ok[None, :], c1, c2, acc1, acc2, kind,
                    skh, skn, skd, svh, svn, svd, scn, scd, ssn, ssd)

    return _jit_with(reconstruct_bits_kernel, _half=_half, _rope_pairs=_rope_pairs, _store_rows=_store_rows)


def bits_kernel():
    """The bits kernel built for this process's mode (compiled, or interpreted under TRITON_INTERPRET=1)."""
    return bits_kernel_for(interpreting())
