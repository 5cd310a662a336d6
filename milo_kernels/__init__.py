"""Kernels that turn stored low-rank KV factors back into attention-ready K and V."""
from .naive import apply_rope, dequantize_int8_segment, int8_segment_bytes, reconstruct_layer_naive, rotate
from .reconstruct import reconstruct_layer

__all__ = ["apply_rope", "dequantize_int8_segment", "int8_segment_bytes", "reconstruct_layer",
           "reconstruct_layer_naive", "rotate"]
