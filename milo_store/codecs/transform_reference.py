"""The transform codec's decode, in plain PyTorch: the definition a fused kernel must reproduce.

X̂ = (codes * scale + minimum) @ decoder + mean, per unit, in fp32: codes uint8 [U, T, n], scale and
minimum fp16 [U, n] (zeros for a dropped column), decoder [U, n, d] (basisᵀ diag(1/weight)), mean [U, d].
"""
import torch


def decode_reference(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, decoder: torch.Tensor,
                     mean: torch.Tensor) -> torch.Tensor:
    coefficients = codes.float() * scale.float().unsqueeze(-2) + minimum.float().unsqueeze(-2)
    return coefficients @ decoder.float() + mean.float().unsqueeze(-2)
