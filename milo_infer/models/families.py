"""Each model family's attention as milo must know it to store a layer's K/V and put them back exactly.

One declarative `Attention` per family, in the spirit of vLLM's model files (transformers' modeling files
are what each describes), in one registry, `FAMILIES`, keyed by ``config.model_type``. Capture and the
query-aware channel weights (`capture`), the per-layer RoPE tables (`rope`), the store's identity
(`identity`), the engine's rebuild and the vLLM connector all read it. A MoE family shares its dense
parent's attention: only the model type is new (and the routing fields its identity hashes). Families
milo cannot reproduce are in `REFUSED` with the reason, which `check_supported` names in one line.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# RoPE variants whose tables depend only on the position: "dynamic" and "longrope" recompute their
# frequencies from the length of the current forward pass, so a stored key could not be re-rotated.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


class UnsupportedModelError(ValueError):
    """The model's attention or position embedding is not one MILO can store and re-rotate."""


@dataclass(frozen=True)
class Attention:
    """Where a layer's keys before RoPE, its values and its queries are read (each the output of a module of the
    layer's ``self_attn``), which layers rotate, and how."""

    keys: tuple[str, ...] = ("k_proj",)  # the first of these the layer has: its output is the keys RoPE turns
    values: str = "v_proj"
    queries: tuple[str, ...] = ("q_proj",)  # what the query-aware key weights read: the queries RoPE turns
    fused: str | None = None  # a projection whose output is [q | k | v] (Phi-3's qkv_proj): all three are its slices
    nope: str | None = None  # a config list whose falsy entries are the layers without RoPE (SmolLM3's no_rope_layers)
    window: bool = False  # its attention applies config.sliding_window to every layer (else only layer_types say)
    interleaved: bool = False  # RoPE turns channel pairs (2i, 2i + 1) (Cohere), not rotate-half's (j, j + d/2)
    regroup_tables: bool = False  # its rotary module makes rotate-half tables, which its attention re-lays for
    # interleaved pairs (Helium)
    partial: bool = False  # only the first rotary_dim channels rotate (GLM: interleaved pairs, which keep the
    # kernels' pairing: the channels after them take identity tables); rotate-half partial rotary is refused
    heads_first: bool = False  # its key and query taps give [batch, heads, tokens, d], not [batch, tokens, ...]:
    # the norms run after the heads are moved before the tokens (Apertus)
    identity: tuple[str, ...] = ()  # config fields beyond the common ones that change its K/V (hashed into the
    # store's config_hash; none for llama, qwen2 and mistral, whose stores predate this field)

    def __post_init__(self):
        if self.partial and not self.interleaved:
            raise ValueError("partial rotary keeps the kernels' pairing only with interleaved pairs")

    def nope_layers(self, config) -> list[int]:
        """The layers whose keys are cached as computed, not rotated."""
        if self.nope is None:
            return []
        return [i for i, rotates in enumerate(getattr(config, self.nope)) if not rotates]


PLAIN = Attention()  # Llama's: k_proj and v_proj outputs (biases included), rotate-half, every layer
WINDOWED = replace(PLAIN, window=True)  # Mistral's: Llama's, config.sliding_window on every layer
QK_NORM = Attention(keys=("k_norm",), queries=("q_norm",))  # the norm's output: per head (Qwen3), over the projection (OLMo 2)
FUSED = Attention(fused="qkv_proj", window=True)  # Phi-3's: q, k and v slices of one projection
MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
       "mlp_only_layers")  # Qwen's routing
GRANITE = ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")

FAMILIES: dict[str, Attention] = {
    "llama": PLAIN,
    "qwen2": PLAIN,
    "mistral": WINDOWED,
    "qwen3": QK_NORM,
    "qwen3_moe": replace(QK_NORM, window=True, identity=MOE),
    "qwen2_moe": replace(PLAIN, identity=("qkv_bias", "shared_expert_intermediate_size") + MOE),
    "mixtral": replace(WINDOWED, identity=("num_local_experts", "num_experts_per_tok")),
    "phi3": FUSED,
    "phimoe": replace(WINDOWED, identity=("num_local_experts", "num_experts_per_tok", "input_jitter_noise")),
    "gemma": PLAIN,  # head_dim 256
    "olmo2": QK_NORM,
    "olmoe": replace(QK_NORM, window=True, identity=("num_experts", "num_experts_per_tok", "clip_qkv")),
    "granite": replace(PLAIN, identity=GRANITE),  # attention_multiplier is the attention's scale
    "granitemoe": replace(PLAIN, identity=GRANITE + ("num_local_experts", "num_experts_per_tok")),
    "smollm3": replace(PLAIN, nope="no_rope_layers", identity=("no_rope_layers",)),
    "cohere": Attention(keys=("k_norm", "k_proj"), queries=("q_norm", "q_proj"), interleaved=True,
                        identity=("layer_norm_eps", "logit_scale", "use_qk_norm")),
    "helium": Attention(interleaved=True, regroup_tables=True),
    "glm": Attention(interleaved=True, regroup_tables=True, partial=True),  # GLM-4-9B (rotary over half the head)
    "glm4": Attention(interleaved=True, regroup_tables=True, partial=True),  # GLM-4-0414
    "seed_oss": replace(PLAIN, identity=("attention_out_bias",)),  # q/k/v biases, an o_proj bias of its own
    "arcee": PLAIN,  # AFM: Llama's attention (a ReLU² MLP)
    "apertus": replace(QK_NORM, heads_first=True),  # k_norm per head before RoPE, llama3 scaling
    "starcoder2": replace(WINDOWED, identity=("use_bias", "norm_epsilon")),  # biases, LayerNorm, one window
    "ernie4_5": Attention(interleaved=True, regroup_tables=True, identity=("use_bias",)),  # pairs (2i, 2i + 1)
    "ernie4_5_moe": Attention(interleaved=True, regroup_tables=True, identity=(
        "use_bias", "moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts",
        "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")),
    "dots1": replace(QK_NORM, identity=("n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "first_k_dense_replace", "norm_topk_prob",
                                        "routed_scaling_factor")),  # Qwen3's attention; windows by layer_types
    "minimax_m2": replace(QK_NORM, identity=("num_local_experts", "num_experts_per_tok")),  # k_norm over the
    # whole projection (OLMo 2's); its released checkpoints' rotary_dim 64 of 128 is refused as partial rotary
}

HYBRID_LINEAR = ("hybrid linear attention: its linear-attention layers keep a recurrent state, not per-token K/V "
                 "that could be stored and placed at new positions")
SLIDING_HYBRID = ("sliding-window layers beside full-attention ones: a placed block would be attended beyond the "
                  "window the model sees (milo attends every layer in full)")
MLA = ("multi-head latent attention (MLA): its cache holds a compressed latent and one shared RoPE key per token, "
       "not per-head K/V before RoPE")
PARTIAL = ("partial rotary embedding with rotate-half pairs (j, j + rotary_dim/2) over the first channels: milo's "
           "kernels pair (j, j + d/2)")
MROPE = ("multimodal RoPE (rope_parameters' mrope_section): its rotary module turns each part of a head by "
         "its own position row (time, height, width), which milo's one table per position does not describe")
REFUSED: dict[str, str] = {
    "qwen3_next": HYBRID_LINEAR, "qwen3_5": HYBRID_LINEAR, "qwen3_5_text": HYBRID_LINEAR, "qwen3_5_moe": HYBRID_LINEAR,
    "qwen3_5_moe_text": HYBRID_LINEAR, "falcon_h1": HYBRID_LINEAR, "jamba": HYBRID_LINEAR,
    "gemma2": SLIDING_HYBRID, "gemma3": SLIDING_HYBRID, "gemma3_text": SLIDING_HYBRID, "cohere2": SLIDING_HYBRID,
    "gpt_oss": SLIDING_HYBRID + ", and per-head attention sinks", "olmo3": SLIDING_HYBRID, "exaone4": SLIDING_HYBRID,
    "ministral": "sliding-window attention in every layer: milo attends every layer in full",
    "deepseek_v2": MLA, "deepseek_v3": MLA,
    "hunyuan_v1_dense": "its key norm follows RoPE, so a cached key is not a rotation of a stored one",
    "stablelm": PARTIAL, "nemotron": PARTIAL, "phi": PARTIAL,
    "glm4_moe": PARTIAL + " (GLM-4.5/4.6: partial_rotary_factor 0.5; GLM-4's dense models pair interleaved)",
    "hunyuan_v1_moe": "its key norm follows RoPE, so a cached key is not a rotation of a stored one",
    "llama4_text": ("chunked local attention in 3 of 4 layers (attention_chunk_size, layer_types "
                    "'chunked_attention'): a placed block would be attended beyond the chunk the model sees; "
                    "its other layers are NoPE with a query temperature that grows with the position"),
    "gemma4_text": ("sliding-window attention in 5 of 6 layers (layer_types 'sliding_attention'), and per-layer "
                    "head sizes and RoPE (global_head_dim with proportional partial RoPE in the full-attention "
                    "layers): milo stores one head size and attends every layer in full"),
    "qwen2_vl_text": MROPE, "qwen2_5_vl_text": MROPE, "qwen3_vl_text": MROPE,
}


def attention_of(config) -> Attention:
    """The family's description (`check_supported` first: this raises for any other model type)."""
    spec = FAMILIES.get(getattr(config, "model_type", None))
    if spec is None:
        raise UnsupportedModelError(_family_problem(getattr(config, "model_type", None)))
    return spec


def _family_problem(model_type) -> str:
    if model_type in REFUSED:
        return f"model_type {model_type!r} is not supported: {REFUSED[model_type]}"
    return f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})"


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_supported(config) -> None:
    """Raise `UnsupportedModelError` naming every reason MILO cannot store this model's KV cache.

    A refused family is refused for its own reason alone: its config may not even read as one attention for
    every layer (Gemma 4's per-layer head_dim raises when read globally). Any other config that raises where
    milo reads it is refused naming what could not be read: one line, never the exception's traceback."""
    model_type = getattr(config, "model_type", None)
    name = getattr(config, "name_or_path", "") or model_type
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model {name!r} is not supported: {_family_problem(model_type)}")
    try:
        _check_config(config)
    except UnsupportedModelError:
        raise
    except Exception as error:  # noqa: BLE001 - a config milo cannot read is a refusal, not a crash
        said = str(error).splitlines()[0][:160] if str(error) else ""
        raise UnsupportedModelError(f"model {name!r} is not supported: its config cannot be read as one attention "
                                    f"for every layer ({type(error).__name__}: {said})") from None


def _check_config(config) -> None:
    """`check_supported` of a family not refused as a whole."""
    problems = []
    model_type = getattr(config, "model_type", None)
    spec = FAMILIES.get(model_type)
    if spec is None:
        problems.append(_family_problem(model_type))
    rope = getattr(config, "rope_parameters", None)
    if not rope or "rope_theta" not in rope:
        problems.append("no RoPE parameters (config.rope_parameters with rope_theta): MILO needs rotary positions")
    else:
        if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
            problems.append(
                f"rope_type {rope.get('rope_type')!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
                "dynamic/longrope rescale with the sequence length, so stored keys could not be re-rotated"
            )
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if factor != 1.0 and model_type not in REFUSED and not (spec is not None and spec.partial):
            problems.append(f"partial rotary embedding (partial_rotary_factor={factor}) is not supported: {PARTIAL}")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads and kv_heads and heads % kv_heads:
        problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if heads and head_dim(config) % 2:
        problems.append(f"head_dim={head_dim(config)} is odd: RoPE pairs channels, so it needs an even head dimension")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding and model_type not in REFUSED:
        problems.append(f"layers {sliding} use {layer_types[sliding[0]]!r} attention; MILO needs full attention in every layer")
    elif spec is not None and spec.window and _window_active(config):
        problems.append(
            f"sliding_window={config.sliding_window} is active (below max_position_embeddings="
            f"{config.max_position_embeddings}); MILO needs full attention (set sliding_window to null)"
        )
    if model_type == "olmoe" and getattr(config, "clip_qkv", None) is not None:
        problems.append(f"clip_qkv={config.clip_qkv} clamps keys after their norm, in place: not captured")
    if problems:
        name = getattr(config, "name_or_path", "") or model_type
        raise UnsupportedModelError(f"model {name!r} is not supported: " + "; ".join(problems))


def _window_active(config) -> bool:
    window = getattr(config, "sliding_window", None)
    return window is not None and window < config.max_position_embeddings
