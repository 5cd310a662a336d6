"""The store format's numeric facts, in one place (docs/format.md).

The writer and its byte accounting (milo_store) and the kernels that read segments in place
(milo_kernels) must agree on every number here, and may not import each other: both import this, so
they cannot disagree. It imports nothing of milo.

The sizes take ints, numpy arrays or int64 torch tensors (elementwise arithmetic only). ``bits`` is
0 for floating factors, where sizes count values, else the code width of a quantization (QUANT_BITS),
where they count bytes; ``kind`` is 0 for a key, 1 for a value.
"""
RAW_RANK = -1  # the rank recorded for a raw unit: its K or V [T, d] itself
SCALE_SPAN = 32  # tokens per scale of a low-bit key factor column (KIVI's group size; "group" means a retrieval group in milo)
QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}  # code width of each quantization
INT8_HEADER = 5  # fp16 vectors [r] before an INT8 segment's codes: Σ, A scale, A min, B scale, B min
LOWBIT_HEADER = 3  # fp16 vectors [r] that open an INT4/INT2 segment: Σ, B scale, B min


def lowbit_rows(tokens, bits: int):
    """A low-bit A's rows once padded so that every column fills an even number of bytes."""
    per_byte = 8 // bits
    return -(-tokens // (2 * per_byte)) * 2 * per_byte


def lowbit_scale_bytes(columns, tokens, kind):
    """Bytes of a low-bit A's fp16 scales and minima: a key's per column and span of SCALE_SPAN
    tokens, a value's per token."""
    return 4 * columns * -(-tokens // SCALE_SPAN) * (kind == 0) + 4 * tokens * (kind != 0)


def lowbit_code_bytes(columns, tokens, bits: int):
    """Bytes of a low-bit A's codes, column by column."""
    return columns * lowbit_rows(tokens, bits) // (8 // bits)


def unit_size(tokens, d: int, bits: int, kind):
    """What one rank unit of a segment costs; every quantized size is even (fp16 headers stay aligned)."""
    if bits == 0:  # a column of A, a value of Σ, a column of B
        return tokens + d + 1
    if bits == 8:  # A codes padded to an even row count, B codes, the header
        return tokens + tokens % 2 + d + 2 * INT8_HEADER
    # the header, B's codes, A's codes and (a key's, per column) A's scales
    a_scales = lowbit_scale_bytes(1, tokens, kind) * (kind == 0)
    return 2 * LOWBIT_HEADER + d + lowbit_code_bytes(1, tokens, bits) + a_scales


def fixed_size(tokens, bits: int, kind):
    """What a segment of rank > 0 costs beyond its rank units: a low-bit value's per-token scales."""
    return 4 * tokens * (kind != 0) * (0 < bits < 8)


def raw_size(tokens, d: int, bits: int, kind):
    """Size of a raw segment: X [T, d] itself; INT8 a scale and minimum per channel, then T' d codes;
    INT4/INT2 a low-bit A of d columns without Σ and B."""
    if bits == 0:
        return tokens * d
    if bits == 8:
        return (4 + tokens + tokens % 2) * d
    return lowbit_scale_bytes(d, tokens, kind) + lowbit_code_bytes(d, tokens, bits)


def segment_size(rank, tokens, d: int, bits: int, kind):
    """Size of one segment of rank r (RAW_RANK: raw); zero at rank zero."""
    factored = rank * unit_size(tokens, d, bits, kind) + fixed_size(tokens, bits, kind)
    return (rank == RAW_RANK) * raw_size(tokens, d, bits, kind) + (rank > 0) * factored
