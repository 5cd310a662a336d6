"""INT8 factors: asymmetric, one scale and minimum per factor column (FlexGen-style, group = column).

A and B columns are unit vectors, so one group per column costs 8 bytes per rank unit and adds
~0.1% error where truncation adds 10-35% (docs/results.md); at equal bytes INT8 nearly doubles the
rank. Readers dequantize in place: ``milo_kernels`` (reference and the fused Triton kernel).
Segment of rank r over T tokens, d head dim (r * (T' + d + 10) bytes, T' = T rounded up to even):
``Σ, A scale, A min, B scale, B min`` (fp16 [r] each), then ``A`` codes [T', r] (a last zero row when T
is odd), ``B`` codes [d, r] (uint8). With d even every segment has an even size, so in a buffer that
starts aligned every header is 2-byte aligned, as a GPU kernel reading it in place needs.
"""
import torch

from .layout import QUANT_UNIT_OVERHEAD

HEADER = QUANT_UNIT_OVERHEAD // 2  # fp16 vectors of length r before the codes


def quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 codes, fp16 scale, fp16 minimum of each column of x [n, r]; x ≈ codes * scale + minimum."""
    lo = x.min(dim=0).values.half()
    scale = ((x.max(dim=0).values - lo.float()) / 255).clamp_min(torch.finfo(torch.float16).tiny).half()
    codes = torch.round((x - lo.float()) / scale.float()).clamp(0, 255).to(torch.uint8)
    return codes, scale, lo


def pack_segment(A: torch.Tensor, S: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The bytes of one INT8 segment (A [T, r], S [r], B [d, r], any float dtype)."""
    if A.shape[1] == 0:
        return torch.empty(0, dtype=torch.uint8)
    a, a_scale, a_min = quantize_columns(A.float())
    b, b_scale, b_min = quantize_columns(B.float())
    header = torch.stack((S.half(), a_scale, a_min, b_scale, b_min)).reshape(-1).view(torch.uint8)
    pad = a.new_zeros((A.shape[0] % 2) * A.shape[1])
    return torch.cat((header, a.reshape(-1), pad, b.reshape(-1)))
