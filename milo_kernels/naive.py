"""Plain-PyTorch references: short and obviously right. The oracle for tests and the CPU path."""
import torch


def rotate(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The RoPE partner of each channel: rotate-half (HF Llama/Qwen) or interleaved pairs (GPT-J)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [..., T, d] by full-width tables cos, sin [T, d] (computed in fp32, returned in x's dtype)."""
    xf = x.float()
    return (xf * cos + rotate(xf, interleaved) * sin).to(x.dtype)
