"""Each model family's attention as milo must know it to store a layer's K/V and put them back exactly.

One declarative `Attention` per family, in the spirit of vLLM's model files (transformers' modeling files
are what each describes), in one registry, `FAMILIES`, keyed by ``config.model_type``. Capture and the
query-aware channel weights (`capture`), the per-layer RoPE tables (`rope`), the store's identity
(`identity`), the engine's rebuild and the vLLM connector all read it. A MoE family shares its dense
parent's attention: only the model type is new (and the routing fields its identity hashes). Families
milo cannot reproduce are in `REFUSED` with the reason, which `check_supported` names in one line.
Each family's detail (how it is read, what proves it, what was seen red, how it runs under vLLM) is
docs/families.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from milo_store import Layout
from milo_store.layers import ATTENTION, LATENT, LINEAR, MLP, SHARED, LayerSpec

# RoPE variants whose tables depend only on the position: "dynamic" and "longrope" recompute their
# frequencies from the length of the current forward pass, so a stored key could not be re-rotated.
# "proportional" (Gemma 4's full layers) turns the first part of a head's frequencies and leaves the rest at zero.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


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
    partial: bool = False  # only the first rotary_dim channels rotate (config partial_rotary_factor), the channels
    # after them taking identity tables: interleaved pairs (GLM-4) keep the kernels' pairing as they are; rotate-half
    # pairs (j, j + rotary_dim/2) (GLM-4.5, Phi-2) are the kernels' rotary_dim layout (`rope_layout`)
    identity: tuple[str, ...] = ()  # config fields beyond the common ones that change its K/V (hashed into the
    # store's config_hash; none for llama, qwen2 and mistral, whose stores predate this field)
    heads_first: bool = False  # its key and query taps output [batch, heads, tokens, d] (a norm after the transpose;
    # a fallback projection, the tap of a config without the norm, outputs [batch, tokens, heads * d] as any)
    output: str = "o_proj"  # the projection of the attention's output (Phi's ``dense``): the value weights read it
    keywords_kept: bool = False  # its decoder layers keep their forward keywords from their attention (StableLM,
    # Nemotron): `loading.LoadedModel` hands them on, the engine's batch among them
    unwindowed_nope: bool = False  # when a window is on, its full-attention layers do not rotate (Cohere 2, Exaone 4)
    half_tables: bool = False  # its rotary module makes one table per pair, applied to both of its channels (gpt-oss's
    # rotate-half halves; Llama 4's interleaved pairs, whose tables are complex)
    sinks: bool = False  # each query head has a learned sink logit in its softmax, attended by nothing (gpt-oss)
    softcap: str | None = None  # a config field: scores are capped to cap·tanh(score/cap) before the softmax (Gemma 2)
    query_scalar: str | None = None  # a config field: scores are scaled by its inverse square root, not 1/sqrt(d)
    scaling: float | None = None  # its scores' scale where it is a constant (Gemma 4's 1: queries and keys normalised)
    window_refused: str | None = None  # why an active window is refused (its modeling file applies it half-way)
    norm_after_rope: str | None = None  # a weightless norm its attention applies to queries and keys after RoPE, in
    # the layers that have it (Llama 4's qk_norm): a rotation keeps a head's RMS, so the tap's output normed is what
    # RoPE turns
    first_chunk: bool = False  # exact within its first attention chunk only (Llama 4): its chunked layers are accepted
    # and the store's positions capped (`chunked.first_chunk_positions`)
    query_turns: bool = True  # its cached keys are a rotation of what the store keeps, so a row's query turned back
    # by a block's offset attends one copy held at 0..T-1 for every row (`milo_infer.runtime.shared_blocks`); False:
    # each row holds its own copy (a norm after RoPE, say, would not commute with turning the query)
    keys_from_values: str | None = None  # a config flag: where on, its full-attention layers' keys are their values
    # times the key norm's weight (Gemma 4's attention_k_eq_v: one projection, an RMSNorm with and one without a
    # weight), so a store keeps the values alone (`milo_store.layers`)
    kv_sharing: bool = False  # its last num_kv_shared_layers layers attend an earlier layer's K/V and hold none (Gemma 4)
    latent: bool = False  # multi-head latent attention (DeepSeek's MLA): ``keys`` the projection whose output ends in
    # the rope key, ``values`` the latent's norm; each layer caches one unit [rope key | latent] (`models.latent`)
    rope_interleave: str | bool = "rope_interleave"  # an MLA rope key's raw pairs turned as evens then odds: where
    # this config flag is on, or always (True: LongCat's)
    latent_gains: tuple[str, str] | None = None  # attributes of the MLA module scaling its latent after the norm and
    # its queries (LongCat's mla_scale_kv_lora, mla_scale_q_lora)
    linear: str | None = None  # the decoder layer's attribute holding a ``linear_attention`` layer's module (Qwen3.5's
    # and Qwen3-Next's Gated DeltaNet linear_attn, Bamba's Mamba2 mamba): its state per block is stored
    # (`milo_store.layers` ``linear``)
    linear_rule: str = "gated_delta"  # how that state moves (`milo_store.layers.RULES`)
    linear_type: str = "linear_attention"  # the layer type (config.layer_types) of those layers (LFM2's "conv")
    rope_switch: str | None = None  # a config field that must say "rope" for its attention to rotate (Granite
    # 4.0-H's position_embedding_type; "nope" or null, as released: no layer rotates)
    rotates: bool = True  # False: no layer has RoPE (NemotronH's attention)
    mlp_types: tuple[str, ...] = ()  # layer types that mix no tokens (NemotronH's "mlp", "moe" blocks: `LayerSpec` mlp)

    def rope_layout(self, config, layer: int = 0) -> dict:
        """The kernels' RoPE layout arguments for ``layer`` of this model (``milo_kernels`` ``interleaved`` and
        ``rotary_dim``): a rotate-half partial rotary names its width; interleaved pairs and a whole-head rotary need
        none."""
        return layer_specs(config)[layer].rope_layout()

    def nope_layers(self, config) -> list[int]:
        """The layers whose keys are cached as computed, not rotated."""
        if self.nope is None:
            return []
        return [i for i, rotates in enumerate(getattr(config, self.nope)) if not rotates]

    def windows(self, config) -> list[int | None]:
        """Per layer, how many positions back (itself included) a token attends, or None for every position:
        ``layer_types`` name the sliding layers where the config has them, else the window is on every layer
        (Mistral's); a window at or past max_position_embeddings never bites (None)."""
        if not window_active(config):
            return [None] * config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return [config.sliding_window if kind == "sliding_attention" else None for kind in layer_types]
        return [config.sliding_window if self.window else None] * config.num_hidden_layers

    def scores(self, config) -> dict:
        """How its attention scores differ from Llama's: the scale (None: 1/sqrt(head_dim)), the soft-cap, and
        whether a sink logit per head sits beside them."""
        scalar = getattr(config, self.query_scalar) if self.query_scalar else None
        return {"scaling": scalar ** -0.5 if scalar else self.scaling,
                "softcap": getattr(config, self.softcap) if self.softcap else None, "sinks": self.sinks}

    def unrotated_layers(self, config) -> list[int]:
        """Every layer cached as computed: the NoPE list's, and the full layers of a family that pairs them with
        windows; every layer where its ``rope_switch`` is off."""
        if not self.rotates or self.rope_switch and getattr(config, self.rope_switch, None) != "rope":
            return list(range(config.num_hidden_layers))
        paired = [i for i, w in enumerate(self.windows(config)) if w is None] if self.unwindowed_nope and any(
            w is not None for w in self.windows(config)) else []
        return sorted(set(self.nope_layers(config)) | set(paired))


PLAIN = Attention()  # Llama's: k_proj and v_proj outputs (biases included), rotate-half, every layer
WINDOWED = replace(PLAIN, window=True)  # Mistral's: Llama's, config.sliding_window on every layer
QK_NORM = Attention(keys=("k_norm",), queries=("q_norm",))  # the norm's output: per head (Qwen3), over the projection (OLMo 2)
FUSED = Attention(fused="qkv_proj", window=True, partial=True)  # Phi-3's: q, k and v slices of one projection;
# Phi-4-mini's rotate-half over 3/4 of the head
GATED_DELTA = replace(QK_NORM, partial=True, linear="linear_attn", identity=("linear_num_key_heads",))
MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
       "mlp_only_layers")  # Qwen's routing
GRANITE = ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")
DEEPSEEK_MOE = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
                "topk_method")
# MLA: the latent's and the rope key's widths, the queries' and values' per head, the query's own low rank
MLA = Attention(keys=("kv_a_proj_with_mqa",), values="kv_a_layernorm", queries=("q_proj", "q_b_proj"), latent=True,
                identity=("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                          "rope_interleave") + DEEPSEEK_MOE)

FAMILIES: dict[str, Attention] = {
    "llama": PLAIN,
    "qwen2": PLAIN,
    "mistral": WINDOWED,
    "qwen3": QK_NORM,
    "qwen3_moe": replace(QK_NORM, window=True, identity=MOE),
    "qwen2_moe": replace(PLAIN, identity=("qkv_bias", "shared_expert_intermediate_size") + MOE),
    "mixtral": replace(WINDOWED, identity=("num_local_experts", "num_experts_per_tok")),
    "phi3": FUSED,
    "phimoe": replace(WINDOWED, identity=("num_local_experts", "num_experts_per_tok", "input_jitter_noise"),
                      window_refused="its mask has the window and its attention is not told it"),
    "gemma": PLAIN,  # head_dim 256
    "olmo2": QK_NORM,
    "olmoe": replace(QK_NORM, window=True, identity=("num_experts", "num_experts_per_tok", "clip_qkv"),
                     window_refused="its attention is told the window and its mask has none (SDPA attends in full)"),
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
                                        "routed_scaling_factor")),  # Qwen3's attention, sliding layers by layer_types
    "minimax_m2": replace(QK_NORM, partial=True, identity=("num_local_experts", "num_experts_per_tok")),  # k_norm
    # over the whole projection (OLMo 2's); its released checkpoints turn rotary_dim 64 of 128, rotate-half
    "glm4_moe": Attention(keys=("k_norm", "k_proj"), queries=("q_norm", "q_proj"), partial=True, identity=(
        "use_qk_norm", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
        "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group")),  # GLM-4.5/4.6:
    # rotate-half over half the head (GLM-4's dense models pair interleaved), k_norm per head where use_qk_norm
    "phi": Attention(keys=("k_layernorm", "k_proj"), queries=("q_layernorm", "q_proj"), heads_first=True,
                     partial=True, output="dense", identity=("layer_norm_eps", "qk_layernorm")),  # Phi-2: biases,
    # a LayerNorm per head where qk_layernorm, an output projection named dense, a parallel MLP
    "stablelm": Attention(keys=("k_layernorm", "k_proj"), queries=("q_layernorm", "q_proj"), heads_first=True,
                          partial=True, keywords_kept=True, identity=(
                              "layer_norm_eps", "use_qkv_bias", "qk_layernorm", "use_parallel_residual")),  # a
    # quarter of the head rotates
    "nemotron": replace(PLAIN, partial=True, keywords_kept=True, identity=("norm_eps", "mlp_bias")),  # half the head
    # rotates; LayerNorm1P
    "ministral": PLAIN,  # layer_types: sliding layers, or all
    "gemma2": replace(PLAIN, softcap="attn_logit_softcapping", query_scalar="query_pre_attn_scalar",
                      identity=("attn_logit_softcapping", "query_pre_attn_scalar")),
    "gemma3_text": replace(QK_NORM, heads_first=True, query_scalar="query_pre_attn_scalar",  # a RoPE base per layer type
                           identity=("query_pre_attn_scalar",)),
    "olmo3": QK_NORM,  # a RoPE base per layer type
    "exaone4": replace(QK_NORM, heads_first=True, unwindowed_nope=True),
    "cohere2": Attention(interleaved=True, unwindowed_nope=True,
                         identity=("layer_norm_eps", "logit_scale")),
    "gpt_oss": Attention(half_tables=True, sinks=True,
                         identity=("num_local_experts", "num_experts_per_tok", "swiglu_limit")),
    # Gemma 4: q/k norms per head before RoPE, values through a norm without weight, scale 1; per-layer head sizes and
    # KV heads (transformers' per_layer_config); full layers' K = V where attention_k_eq_v; the last
    # num_kv_shared_layers layers attend an earlier layer's K/V; full layers' proportional RoPE
    "gemma4_text": Attention(keys=("k_norm",), values="v_norm", queries=("q_norm",), scaling=1.0,
                             keys_from_values="attention_k_eq_v", kv_sharing=True, identity=(
                                 "attention_k_eq_v", "num_kv_shared_layers", "hidden_size_per_layer_input",
                                 "vocab_size_per_layer_input", "final_logit_softcapping", "enable_moe_block",
                                 "num_experts", "top_k_experts", "moe_intermediate_size", "use_double_wide_mlp",
                                 "use_bidirectional_attention")),
    # the text models of multimodal checkpoints (`multimodal.TextModelForCausalLM`): their multimodal RoPE takes
    # each frequency from one of three position rows (mrope_section), equal for text, so it is one rotation per position
    "qwen2_vl_text": PLAIN,  # Qwen2's attention: q/k/v biases
    "qwen2_5_vl_text": PLAIN,
    "qwen3_vl_text": QK_NORM,  # Qwen3's: k_norm per head; the rows' sections interleaved
    "qwen3_vl_moe_text": replace(QK_NORM, identity=MOE),
    "llama4_text": Attention(nope="no_rope_layers", interleaved=True, half_tables=True, norm_after_rope="qk_norm",
                             first_chunk=True, identity=(
                                 "no_rope_layers", "attention_chunk_size", "attn_temperature_tuning", "floor_scale",
                                 "attn_scale", "use_qk_norm", "num_local_experts", "num_experts_per_tok", "moe_layers",
                                 "intermediate_size_mlp")),  # Llama 4: complex RoPE tables, NoPE every 4th layer
    # MLA: a latent and one rope key a token (`models.latent`); V3's rope_interleave lays the rope key out evens then
    # odds before rotate-half, V2's complex tables turn its raw pairs (2i, 2i + 1)
    # hybrids: Gated DeltaNet layers (`linear_attn`, three in four) beside attention layers of Qwen3's per-head q/k norms,
    # a quarter of the head rotating and an output gate from q_proj's second half (applied after attention, as it is)
    "qwen3_5_text": GATED_DELTA,
    "qwen3_5_moe_text": replace(GATED_DELTA, identity=GATED_DELTA.identity + MOE + ("shared_expert_intermediate_size",)),
    "qwen3_next": replace(GATED_DELTA, identity=GATED_DELTA.identity + MOE + ("shared_expert_intermediate_size",)),
    # OLMo Hybrid: Gated DeltaNet layers of separate projections (β up to 2 where linear_allow_neg_eigval) beside OLMo 2's
    # attention (q/k norms over the whole projection)
    "olmo_hybrid": replace(QK_NORM, linear="linear_attn", identity=("linear_num_key_heads", "linear_allow_neg_eigval")),
    # LFM2: gated short convolutions (`conv`: y = C ⊙ conv(B ⊙ x), a window of conv_L_cache, no recurrent state) beside
    # attention with a norm per head on queries and keys and an output projection named out_proj
    "lfm2": Attention(keys=("k_layernorm",), queries=("q_layernorm",), output="out_proj", linear="conv",
                      linear_rule="conv", linear_type="conv", identity=("conv_L_cache", "conv_bias", "layer_types")),
    # Bamba: Mamba2 layers (`mamba`: a scalar decay a head, groups of B and C, a gated RMSNorm by groups) beside Llama
    # attention with half the head rotating, where attn_layer_indices says
    "bamba": Attention(partial=True, linear="mamba", linear_rule="mamba2", identity=(
        "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
        "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit")),
    # NemotronH (Nemotron-H, Nemotron 3 Nano): Mamba2 mixers, attention without RoPE, and blocks of an MLP or experts
    # alone, each a layer of its own
    "nemotron_h": Attention(linear="mixer", linear_rule="mamba2", rotates=False, mlp_types=("mlp", "moe"), identity=(
        "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "chunk_size",
        "use_conv_bias", "use_bias", "time_step_limit", "mamba_hidden_act", "layer_types", "n_routed_experts",
        "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_group",
        "topk_group", "routed_scaling_factor", "norm_topk_prob", "mlp_hidden_act")),
    # Granite 4.0-H: Bamba's Mamba2 layers beside Granite's attention (its multipliers), shared and routed experts, and
    # no RoPE unless position_embedding_type says "rope" (its released checkpoints: "nope")
    "granitemoehybrid": Attention(linear="mamba", linear_rule="mamba2", rope_switch="position_embedding_type", identity=(
        GRANITE + ("num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "position_embedding_type",
                   "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
                   "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit"))),
    "deepseek_v3": MLA,
    "deepseek_v2": replace(MLA, interleaved=True, half_tables=True),
    "glm4_moe_lite": replace(MLA, identity=MLA.identity + ("mlp_layer_types",)),  # GLM-4.7-Flash: V3's attention
    # LongCat-Flash: two MLAs a decoder layer (cache layers 2l, 2l + 1), evens-then-odds always, a low-rank query, its
    # latent and queries scaled by sqrt(hidden / rank) after their norms
    "longcat_flash": replace(MLA, rope_interleave=True, latent_gains=("mla_scale_kv_lora", "mla_scale_q_lora"),
                             identity=("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                       "v_head_dim", "head_dim", "ffn_hidden_size", "expert_ffn_hidden_size",
                                       "n_routed_experts", "zero_expert_num", "moe_topk", "routed_scaling_factor")),
}

HYBRID_LINEAR = ("hybrid linear attention of a kind milo does not compose yet: milo stores and composes each block's "
                 "Gated DeltaNet state (Qwen3.5, Qwen3-Next) and Mamba2 state (Bamba, Granite 4.0-H, NemotronH)")
KEY_NORM_AFTER_ROPE = ("its query and key RMSNorms follow RoPE, each with a weight per channel, so a score "
                       "<wq*R(m)q, wk*R(n)k> depends on m and n, not on m - n alone: a block's K/V past the first layer "
                       "change with the absolute positions it was encoded at, and no stored block placed elsewhere is "
                       "what the model computes there (tried: keys stored as k/rms(k) before RoPE, the norm's weight "
                       "on each layer's tables, rebuild its cache to fp32 rounding; placed at new positions, a tiny "
                       "model's layer-1 keys were off by 19-97% of their size)")
SPARSE_LATENT = ("DeepSeek Sparse Attention: each query attends only the index_topk columns an indexer picks from a "
                 "second per-token key cache (its indexer keys), which milo does not store yet; its engine would "
                 "attend every column, unlike the model past index_topk tokens")
REFUSED: dict[str, str] = {
    "deepseek_v32": SPARSE_LATENT, "glm_moe_dsa": SPARSE_LATENT,
    "kimi_linear": HYBRID_LINEAR + "; Kimi's KDA layers decay per channel (beside MLA layers, which milo stores)",
    "deepseek_v4": ("compressed attention: its compressed and heavily compressed layers cache one entry per "
                    "compress_rate tokens, aligned to absolute positions, beside a window: a block placed elsewhere "
                    "would compress over other tokens"),
    "falcon_h1": HYBRID_LINEAR + "; Falcon-H1 runs attention and a Mamba2 mixer side by side in every layer, so a "
                 "layer would hold K/V and a state at once",
    "jamba": HYBRID_LINEAR + "; Jamba's Mamba1 layers decay per channel and state, not by a scalar a head",
    "gemma3": ("the multimodal Gemma 3 (gemma3): its image tokens attend bidirectionally, and its text model "
               "is not yet proven loaded out of it; its text model as a checkpoint of its own (gemma3_text) is "
               "supported"),
    "hunyuan_v1_dense": KEY_NORM_AFTER_ROPE,
    "hunyuan_v1_moe": KEY_NORM_AFTER_ROPE,
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


def layer_config(config, layer: int):
    """The config as ``layer`` reads it: its own view where the model's layers differ (transformers'
    ``per_layer_config``: Gemma 4's full layers have their own head_dim and KV heads), else the config itself."""
    return config.per_layer_config[layer] if getattr(config, "is_heterogeneous", False) else config


def head_dim(config, layer: int = 0) -> int:
    """A head's channels at ``layer``."""
    c = layer_config(config, layer)
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def kv_heads(config, layer: int = 0) -> int:
    c = layer_config(config, layer)
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def rotary_dim(config, layer: int = 0) -> int:
    """How many of a head's first channels RoPE turns at ``layer`` (head_dim for a whole-head rotary): a RoPE per layer
    type whose ``rope_type`` is "proportional" turns the whole head (its frequencies past the factor are zero)."""
    rope = layer_rope_parameters(config, layer)
    if rope.get("rope_type") == "proportional":
        return head_dim(config, layer)
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim(config, layer) * factor)


def layer_rope_parameters(config, layer: int) -> dict:
    """The RoPE parameters ``layer`` turns by: its layer type's where the model has a RoPE per type."""
    per_type = rope_per_layer_type(config)
    return per_type[config.layer_types[layer]] if per_type else dict(getattr(config, "rope_parameters", None) or {})


def kv_sources(config) -> dict[int, int]:
    """Each layer that attends another's K/V, and that layer: Gemma 4's last ``num_kv_shared_layers`` each attend the
    last earlier layer of its own type (its transformers' ``kv_sharing_modes``, which older transformers, vLLM's,
    lack)."""
    first = config.num_hidden_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
    types = config.layer_types
    return {l: max(j for j in range(first) if types[j] == types[l]) for l in range(first, config.num_hidden_layers)}


def model_layout(config) -> Layout:
    """The store layout of this model's layers (`layer_specs` on their grid)."""
    return Layout.of(layer_specs(config))


def layer_specs(config) -> tuple[LayerSpec, ...]:
    """What each layer of a store of this model holds (`milo_store.layers.LayerSpec`): the one per-layer description
    capture, the RoPE tables, the store, the engine's cache and rebuild and the vLLM connector all read. A shared layer
    (`Attention.kv_sharing`) holds nothing and names its source; it keeps its own heads, width and RoPE layout, which
    are its source's (the same layer type). A hybrid's ``linear_attention`` layers (`Attention.linear`) hold a state
    (`linear_spec`)."""
    spec = attention_of(config)
    if spec.latent:
        rope, latent = config.qk_rope_head_dim, config.kv_lora_rank
        rotary = dict(rotary="interleaved") if spec.interleaved else dict(rotary="half", rotary_dim=rope)
        return tuple(LayerSpec(LATENT, 1, rope + latent, latent=latent, **rotary)
                     for _ in range(config.num_hidden_layers))
    unrotated = set(spec.unrotated_layers(config))
    types = list(getattr(config, "layer_types", None) or ())
    sources = kv_sources(config) if spec.kv_sharing else {}
    k_eq_v = bool(spec.keys_from_values and getattr(config, spec.keys_from_values, False))
    layers = []
    for l in range(config.num_hidden_layers):
        if spec.linear and types[l] == spec.linear_type:
            layers.append(linear_spec(config, spec.linear_rule))
            continue
        if types and types[l] in spec.mlp_types:
            layers.append(LayerSpec(MLP))
            continue
        d = head_dim(config, l)
        turns = rotary_dim(config, l)
        partial = spec.partial and not spec.interleaved and turns != d
        rotary = dict(rotary="interleaved" if spec.interleaved else "half", rotary_dim=turns if partial else None,
                      nope=l in unrotated)
        kind, source = (SHARED, sources[l]) if l in sources else (ATTENTION, None)
        layers.append(LayerSpec(kind, kv_heads(config, l), d, **rotary, source=source,
                                keys_from_values=k_eq_v and kind == ATTENTION and types[l] == "full_attention"))
    return tuple(layers)


def linear_spec(config, rule: str = "gated_delta") -> LayerSpec:
    """A Gated DeltaNet layer's state (`milo_infer.models.delta_rule`): a [key_dim, value_dim] state per value head,
    and its short convolution over the queries', keys' and values' channels; or a Mamba2 layer's (``mamba2``,
    `milo_infer.models.ssd`): a [head_dim, d_state] state per head, its convolution over x, B and C."""
    if rule == "conv":  # LFM2's gated short convolution over the hidden channels: its last inputs alone
        return LayerSpec(LINEAR, conv_dim=config.hidden_size, conv_kernel=config.conv_L_cache, rule=rule)
    if rule == "mamba2":  # Bamba's and Granite's field names, or NemotronH's
        heads = getattr(config, "mamba_n_heads", None) or config.mamba_num_heads
        head_dim = getattr(config, "mamba_d_head", None) or config.mamba_head_dim
        state = getattr(config, "mamba_d_state", None) or config.ssm_state_size
        groups = getattr(config, "mamba_n_groups", None) or config.n_groups
        return LayerSpec(LINEAR, heads, head_dim, value_dim=state, rule=rule, conv_dim=heads * head_dim + 2 * groups * state,
                         conv_kernel=getattr(config, "mamba_d_conv", None) or config.conv_kernel)
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    return LayerSpec(LINEAR, value_heads, key_dim, value_dim=value_dim,
                     conv_dim=2 * key_heads * key_dim + value_heads * value_dim,
                     conv_kernel=config.linear_conv_kernel_dim)


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
    per_type = rope_per_layer_type(config)
    if per_type:  # a RoPE per layer type (Gemma 3's local and global bases): each is checked as a model's one
        for kind, parameters in per_type.items():
            if parameters.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES or "rope_theta" not in parameters:
                problems.append(f"the {kind} layers' RoPE {parameters} is not a supported one "
                                f"(rope_theta and a rope_type of {', '.join(SUPPORTED_ROPE_TYPES)})")
    elif spec is not None and not spec.rotates:
        pass  # no layer rotates: nothing to read
    elif not rope or "rope_theta" not in rope:
        problems.append("no RoPE parameters (config.rope_parameters with rope_theta): MILO needs rotary positions")
    else:
        if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
            problems.append(
                f"rope_type {rope.get('rope_type')!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
                "dynamic/longrope rescale with the sequence length, so stored keys could not be re-rotated"
            )
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if factor != 1.0 and not (spec is not None and spec.partial):
            problems.append(f"partial rotary embedding (partial_rotary_factor={factor}) is not supported: its "
                            f"family's attention is not described as partial")
        elif factor != 1.0 and (rotary_dim(config) % 2 or not 0 < rotary_dim(config) <= head_dim(config)):
            problems.append(f"partial_rotary_factor={factor} turns {rotary_dim(config)} of {head_dim(config)} "
                            "channels: RoPE pairs channels, so it needs an even number within the head")
    heads = getattr(config, "num_attention_heads", None)
    for layer in range(config.num_hidden_layers) if heads else ():
        found = _layer_problem(config, layer, heads)
        if found and found not in problems:
            problems.append(found)
    layer_types = getattr(config, "layer_types", None) or []
    attended = ({"full_attention", "sliding_attention"} | ({"chunked_attention"} if spec and spec.first_chunk else set())
                | ({spec.linear_type} if spec and spec.linear else set()) | set(spec.mlp_types if spec else ()))
    other = sorted({kind for kind in layer_types} - attended)
    if other:
        problems.append(f"layers of type {', '.join(map(repr, other))}: MILO attends full or sliding-window layers only")
    if spec is not None and spec.window_refused and any(w is not None for w in spec.windows(config)):
        problems.append(f"sliding_window={config.sliding_window} is active, which milo cannot follow here: "
                        f"{spec.window_refused} (transformers' {model_type} modeling file); set it to null")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        problems.append("use_bidirectional_attention='all': every token attends the tokens after it, so no block "
                        "could be encoded before the blocks placed after it")
    quantized = quantization_problem(config)
    if quantized:
        problems.append(quantized)
    if model_type == "olmoe" and getattr(config, "clip_qkv", None) is not None:
        problems.append(f"clip_qkv={config.clip_qkv} clamps keys after their norm, in place: not captured")
    if problems:
        name = getattr(config, "name_or_path", "") or model_type
        raise UnsupportedModelError(f"model {name!r} is not supported: " + "; ".join(problems))


READABLE_QUANTIZATION = ("fp8",)  # transformers' fine-grained FP8: a weight and its block scales (`quantized`)


def quantization_problem(config) -> str | None:
    """What makes the checkpoint's quantization (``config.quantization_config``) one whose weights milo cannot read
    (None: none, one dequantized while loading, or fine-grained FP8, which `quantized.dense_weight` reads)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    field = quantization.get if isinstance(quantization, dict) else lambda name: getattr(quantization, name, None)
    method = getattr(field("quant_method"), "value", field("quant_method"))  # an enum in a config object
    if field("dequantize") or method in READABLE_QUANTIZATION:
        return None
    return (f"its weights are quantized by {method!r} (config.quantization_config), which milo cannot read: it reads "
            "some module weights itself (MLA's kv_b_proj, the output projection of its query-aware weights), and "
            f"reads quantized ones of {', '.join(READABLE_QUANTIZATION)} alone (transformers' fine-grained FP8)")


def _layer_problem(config, layer: int, heads: int) -> str | None:
    """What makes ``layer``'s shape one RoPE cannot pair or GQA cannot group (None: nothing)."""
    kv, d = kv_heads(config, layer), head_dim(config, layer)
    where = f" (layer {layer})" if getattr(config, "is_heterogeneous", False) else ""
    if heads % kv:
        return f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}{where}"
    if d % 2:
        return f"head_dim={d} is odd{where}: RoPE pairs channels, so it needs an even head dimension"
    return None


def window_active(config) -> bool:
    """A sliding window that can bite: set, and shorter than the positions the model takes."""
    window = getattr(config, "sliding_window", None)
    return window is not None and window < config.max_position_embeddings


def rope_per_layer_type(config) -> dict[str, dict]:
    """``rope_parameters`` given per layer type (Gemma 3's and OLMo 3's {"sliding_attention": ..., "full_attention":
    ...}), or {} for one RoPE over every layer."""
    rope = getattr(config, "rope_parameters", None) or {}
    return dict(rope) if rope and all(isinstance(v, dict) for v in rope.values()) else {}


def vllm_problem(config) -> str | None:
    """Why the vLLM connector cannot serve this model, or None: where vLLM's own model file attends otherwise than
    transformers' (which milo's stores are encoded by and its engine answers as), a loaded prefix would answer
    unlike both: Cohere 2 with an active window, and MLA models, in vLLM 0.32; a hybrid's linear layers, whose
    state the connector does not load."""
    if FAMILIES.get(config.model_type, PLAIN).latent:
        return ("its MLA layers: vLLM 0.32's CPU DeepSeek answers unlike transformers' with no milo in the way (tiny "
                "random DeepSeek V2 and V3: its own first-token logprobs off by up to 1.8 on a 6-token prompt), so a "
                "loaded prefix could not answer as milo's engine does; the connector writes no MLA cache: served by "
                "milo's own engine only")
    if any(spec.state_values for spec in layer_specs(config)):
        return ("its linear layers' state (Gated DeltaNet's, Mamba2's): vLLM 0.32 hands a connector its hybrid "
                "allocator's state groups only through SupportsHMA, each request's state beside its conv state, while "
                "milo's connector writes K/V pages alone and would leave the rows' states unset: served by milo's own "
                "engine only (docs/design.md, \"Hybrid linear layers\")")
    if config.model_type == "cohere2" and any(w is not None for w in attention_of(config).windows(config)):
        return (f"vLLM's Cohere 2 attends sliding_window + 1 = {config.sliding_window + 1} tokens in its window "
                f"layers (its commandr.py: 'cohere swa layer sees [pos - sliding_window, pos]'), transformers' "
                f"{config.sliding_window}, which milo's stores and engine follow: served by milo's own engine only")
    return None
