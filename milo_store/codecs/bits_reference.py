"""The bits codec's decode of one unit in plain PyTorch: the definition `BitsCodec.decode` (and a fused
kernel, later) must reproduce.

X̂ = (codes · c_scale + c_min)ᵀ-columns @ ((basis · b_scale + b_min) / s)ᵀ: codes uint8 [r, T],
params fp16 [r, 4] (coefficient scale, coefficient minimum, basis scale, basis minimum), basis uint8
[r, d], s the unit's channel weights [d]. Returns [T, d] in fp32.
"""
import torch


def decode_unit_reference(codes: torch.Tensor, params: torch.Tensor, basis: torch.Tensor,
                          weight: torch.Tensor) -> torch.Tensor:
    p = params.float()
    coefficients = codes.float() * p[:, 0:1] + p[:, 1:2]  # [r, T]
    columns = (basis.float() * p[:, 2:3] + p[:, 3:4]) / weight.float()  # [r, d]
    return coefficients.T @ columns
