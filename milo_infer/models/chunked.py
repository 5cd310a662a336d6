"""Llama 4's attention, which milo reproduces within its first attention chunk only.

Three of its four layers attend inside chunks of ``attention_chunk_size`` absolute positions (layer_types
'chunked_attention'); the fourth are NoPE layers whose queries are scaled by a temperature that grows with the query's
absolute position, log1p(floor((p + 1) / floor_scale)) · attn_scale + 1. A stored block is position-free only where
neither bites: a block encoded at the start of its row and placed elsewhere sees other chunk boundaries cut its
encoding row, and its NoPE layers another temperature, so its K/V past the first layer are not what the model computes
there (`tests/infer/test_llama4.py` measures both). Within the first chunk and below floor_scale − 1 every chunked
layer attends as a full one and every temperature is 1 exactly: there milo is exact, so a Llama 4 model is accepted
with its positions capped (`first_chunk_positions`, the store's recorded ``max_position_embeddings``), and a build or
query past them is refused as any context past a model's positions is.

Its RoPE layers norm queries and keys after RoPE without a weight (``qk_norm``): a rotation keeps a head's RMS, so the
norm commutes with RoPE and milo stores the normed keys before it (`families.Attention.norm_after_rope`).
"""
from __future__ import annotations

from .capture import decoder_layers


def first_chunk_positions(config) -> int:
    """The positions a chunked model is exact at: its own, within its first attention chunk, and, where its query
    temperature is on, below floor_scale − 1 (where the temperature is 1)."""
    limits = [config.max_position_embeddings]
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        limits.append(config.attention_chunk_size)
    if getattr(config, "attn_temperature_tuning", False):
        limits.append(config.floor_scale - 1)
    return min(limits)


def without_temperature(model) -> None:
    """Turn the NoPE layers' query temperature off: it is 1 at every position `first_chunk_positions` leaves, and
    the module counts positions along the engine's packed forward (every row's tokens one after another), not each
    row's own. Exact: below floor_scale − 1 the module multiplies by 1.0."""
    for layer in decoder_layers(model):
        if getattr(layer.self_attn, "attn_temperature_tuning", False):
            layer.self_attn.attn_temperature_tuning = False
