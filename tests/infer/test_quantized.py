"""Weights milo reads itself from a quantized checkpoint (`milo_infer.models.quantized`): transformers' fine-grained FP8
(a float8_e4m3fn weight and one scale per block, as DeepSeek-V3 and Kimi K2 ship and transformers keeps them on CUDA)
read as the weight times its scales; any other quantization refused naming its method."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.integrations.finegrained_fp8 import FP8Linear

from milo_infer.models import UnsupportedModelError, check_supported, latent, output_channel_scales
from milo_infer.models.quantized import dense_weight, dequantized

from . import families

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantized_blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scales [row blocks, column blocks]) of a float weight, block by block as a checkpoint
    quantizes it: each block's largest magnitude maps to float8_e4m3fn's largest."""
    rows, columns = weight.shape
    scales = torch.zeros(-(-rows // block[0]), -(-columns // block[1]))
    codes = torch.zeros(rows, columns, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scales[i, j] = part.abs().max().clamp_min(1e-12) / FP8_MAX
            codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                part / scales[i, j]).to(torch.float8_e4m3fn)
    return codes, scales


def reference_dequantized(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each element times its own block's scale, one element at a time."""
    out = torch.zeros(codes.shape)
    for r in range(codes.shape[0]):
        for c in range(codes.shape[1]):
            out[r, c] = codes[r, c].float() * scales[r // block[0], c // block[1]]
    return out


def fp8_linear(weight: torch.Tensor, block: tuple[int, int]) -> FP8Linear:
    """transformers' FP8Linear holding ``weight`` [out, in] quantized in ``block`` blocks, as loaded on CUDA."""
    module = FP8Linear(weight.shape[1], weight.shape[0], block_size=block)
    module.weight.data, module.weight_scale_inv.data = quantized_blockwise(weight, block)
    return module


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24), st.integers(1, 24), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**16))
def test_dequantized_fp8_is_each_element_times_its_blocks_scale(rows, columns, block_rows, block_columns, seed):
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 3
    block = (block_rows, block_columns)
    codes, scales = quantized_blockwise(weight, block)
    read = dequantized(codes, scales, block)
    assert torch.equal(read, reference_dequantized(codes, scales, block))
    # and that is the weight to float8_e4m3fn's precision (3 mantissa bits; subnormal steps 2^-9 of the scale)
    step = scales.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)[:, :columns]
    assert ((read - weight).abs() <= weight.abs() / 16 + step * 2**-9).all()


def test_mla_reads_an_fp8_kv_b_proj_times_its_scales():
    model = families.tiny_model("deepseek_v3").model
    attention = model.model.layers[0].self_attn
    weight = attention.kv_b_proj.weight.detach().clone()  # [heads * (nope + v) = 80, latent = 16]
    up_keys, up_values = latent.key_up(attention).clone(), latent.value_up(attention).clone()
    block = (32, 8)  # the last row block cut short
    attention.kv_b_proj = fp8_linear(weight, block)
    codes, scales = attention.kv_b_proj.weight, attention.kv_b_proj.weight_scale_inv
    expected = reference_dequantized(codes, scales, block).view(up_keys.shape[0], -1, weight.shape[1])
    nope = attention.qk_nope_head_dim
    assert torch.equal(latent.key_up(attention), expected[:, :nope])
    assert torch.equal(latent.value_up(attention), expected[:, nope:])
    torch.testing.assert_close(latent.key_up(attention), up_keys, atol=0.07 * float(up_keys.abs().max()), rtol=0)
    torch.testing.assert_close(latent.value_up(attention), up_values, atol=0.07 * float(up_values.abs().max()), rtol=0)


def test_output_channel_scales_read_an_fp8_output_projection_times_its_scales():
    model = families.tiny_model("llama").model
    block = (16, 16)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data = dequantized(*quantized_blockwise(layer.self_attn.o_proj.weight, block), block)
    dense = output_channel_scales(model)
    for layer in model.model.layers:
        layer.self_attn.o_proj = fp8_linear(layer.self_attn.o_proj.weight.detach(), block)  # the same codes again
    torch.testing.assert_close(output_channel_scales(model), dense, rtol=1e-6, atol=0)


def test_a_quantization_milo_cannot_read_is_refused_naming_it():
    for readable in ({"quant_method": "fp8", "weight_block_size": [128, 128]}, {"quant_method": "gguf", "dequantize": True}):
        check_supported(families.config("deepseek_v3", quantization_config=readable))
    with pytest.raises(UnsupportedModelError, match="quantized by 'gptq'"):
        check_supported(families.config("deepseek_v3", quantization_config={"quant_method": "gptq", "bits": 4}))
    packed = FP8Linear(16, 8, block_size=(8, 8))
    packed.weight = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.int8), requires_grad=False)  # FP4 codes, 2 a byte
    with pytest.raises(UnsupportedModelError, match="weight is torch.int8"):
        dense_weight(packed)
    del packed.weight_scale_inv
    packed.weight = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(UnsupportedModelError, match="no weight_scale_inv"):
        dense_weight(packed)
