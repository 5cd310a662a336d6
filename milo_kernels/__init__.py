"""Kernels that turn stored low-rank KV factors back into attention-ready K and V."""
from milo_format import RAW_RANK
from .lowbit import dequantize_lowbit_layer, dequantize_lowbit_segment
from .naive import apply_rope, dequantize_int8_segment, reconstruct_layer_naive, rotate
from .plan import plan_layers
from .reconstruct import decode_layer, kernel_backend, reconstruct_layer

__all__ = ["RAW_RANK", "apply_rope", "decode_layer", "dequantize_lowbit_layer", "dequantize_lowbit_segment",
           "dequantize_int8_segment", "kernel_backend", "plan_layers", "reconstruct_layer", "reconstruct_layer_naive",
           "rotate"]
