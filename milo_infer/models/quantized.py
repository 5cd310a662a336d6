"""The weights milo reads out of a module itself (MLA's ``kv_b_proj``, `latent`; the output projection the query-aware
value weights come from, `capture.output_channel_scales`) as floats, whatever a checkpoint's quantization left there.

transformers keeps a fine-grained FP8 checkpoint (``quantization_config`` of method ``fp8``: DeepSeek-V3's, Kimi K2's,
Qwen3's FP8 releases) as it ships where a GPU is: each linear module's ``weight`` in float8_e4m3fn with
``weight_scale_inv`` beside it, one fp32 (or UE8M0) scale per ``block_size`` = (rows, columns) block of the weight
(one scale for all of it where the block size is None), and the weight is their product (the scale is "inverse" to
the quantizer, which rounded weight / scale). Without a GPU it dequantizes while loading and drops the config. Models
of any other method are refused from their config (`families.check_supported`): their weights are nothing milo can
read.
"""
from __future__ import annotations

import torch

from .families import UnsupportedModelError


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` as floats: itself where it is a float of 16 bits or more, its fine-grained FP8 form times its
    scales (fp32) where it carries them; an `UnsupportedModelError` naming the module's weight otherwise."""
    weight = module.weight
    if weight.dtype.is_floating_point and weight.element_size() > 1:
        return weight
    scale = getattr(module, "weight_scale_inv", None)
    if weight.dtype != torch.float8_e4m3fn or scale is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}'s weight is {weight.dtype}{'' if scale is not None else ' with no weight_scale_inv'}"
            ": milo reads module weights in float, or in fine-grained FP8 (float8_e4m3fn) with their block scales")
    return dequantized(weight, scale, getattr(module, "block_size", None))


def dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] | None) -> torch.Tensor:
    """fp32 [rows, columns]: an FP8 ``weight`` times ``scale_inv``, one scale per ``block_size`` block (the last row and
    column of blocks may be cut short), or one for the whole weight where ``block_size`` is None."""
    w, s = weight.float(), scale_inv.float()
    if block_size is None:
        if s.numel() != 1:
            raise ValueError(f"a per-tensor FP8 weight has one scale; got {tuple(s.shape)}")
        return w * s.reshape(())
    (rows, columns), (block_rows, block_columns) = w.shape, block_size
    blocks = (-(-rows // block_rows), -(-columns // block_columns))
    if tuple(s.shape) != blocks:
        raise ValueError(f"an FP8 weight [{rows}, {columns}] in blocks of {block_rows}x{block_columns} has "
                         f"{blocks[0]}x{blocks[1]} scales; got {tuple(s.shape)}")
    per_row = s.repeat_interleave(block_rows, dim=0)[:rows]
    return w * per_row.repeat_interleave(block_columns, dim=1)[:, :columns]
