"""Kernels that turn stored low-rank KV factors back into attention-ready K and V."""
from .lowbit import dequantize_lowbit_layer, dequantize_lowbit_segment, lowbit_segment_bytes
from .naive import RAW_RANK, apply_rope, dequantize_int8_segment, int8_segment_bytes, reconstruct_layer_naive, rotate
from .plan import plan_layers
from .reconstruct import kernel_backend, reconstruct_layer

__all__ = ["RAW_RANK", "apply_rope", "dequantize_lowbit_layer", "dequantize_lowbit_segment", "lowbit_segment_bytes", "dequantize_int8_segment", "int8_segment_bytes", "kernel_backend", "plan_layers", "reconstruct_layer",
           "reconstruct_layer_naive", "rotate"]
