"""A tiny random-weight model of every family `milo_infer.models.FAMILIES` accepts, from its transformers config
class (no download), and a small corpus to build its stores from: what the conformance suites run over.

A new family is one entry of `TINY` (its config class and what its tiny config sets beyond `SHAPE`); the
suites are parametrized over it, and `tests/infer/test_conformance.py` fails naming any family without one.
"""
import importlib
import os

import torch

from milo_infer.bench.synthetic_model import byte_tokenizer
from milo_infer.models import LoadedModel, model_identity
from milo_infer.tasks.corpus import Demonstration, TaskSpec

DEVICE = os.environ.get("MILO_TEST_DEVICE", "cpu")  # where the tiny models live (tools/gpu_bench.sh's conformance part)
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.1, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # positions past 64 are rescaled
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # time, height, width
MROPE_INTERLEAVED = dict(MROPE, mrope_interleaved=True)  # Qwen3-VL's
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=12, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           n_group=1, topk_group=1, first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek V3's: the scale in the attention's, none in the tables
HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=6, linear_conv_kernel_dim=4)
HYBRID_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
               "mrope_interleaved": True}

# family -> (config class, what its tiny config sets): each line one attention path the suite proves
TINY = {
    "llama": ("LlamaConfig", dict(rope_parameters=LLAMA3)),  # Llama 3.x
    "qwen2": ("Qwen2Config", {}),  # q/k/v biases
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),  # k_norm per head, a head_dim of its own
    "qwen3_moe": ("Qwen3MoeConfig", MOE),
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, shared_expert_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", {}),  # fused qkv_proj
    "phimoe": ("PhimoeConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma": ("GemmaConfig", dict(head_dim=256)),  # head_dim 256
    "olmo2": ("Olmo2Config", {}),  # k_norm over the whole projection
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    "granite": ("GraniteConfig", dict(attention_multiplier=0.6, embedding_multiplier=2.0, residual_multiplier=0.5,
                                      logits_scaling=2.0)),  # the attention's scale is not 1/sqrt(d)
    "granitemoe": ("GraniteMoeConfig", dict(attention_multiplier=0.6, num_local_experts=4, num_experts_per_tok=2)),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2)),  # layers 1 and 3 NoPE
    "cohere": ("CohereConfig", dict(use_qk_norm=True)),  # interleaved RoPE, LayerNorm per head
    "helium": ("HeliumConfig", dict(head_dim=16)),  # interleaved pairs on re-laid rotate-half tables
    "glm": ("GlmConfig", dict(head_dim=16)),  # rotary over half the head, interleaved
    "glm4": ("Glm4Config", dict(head_dim=16)),
    "seed_oss": ("SeedOssConfig", dict(head_dim=16, attention_out_bias=True)),  # q/k/v and o_proj biases
    "arcee": ("ArceeConfig", dict(head_dim=16)),
    "apertus": ("ApertusConfig", dict(rope_parameters=LLAMA3)),  # k_norm per head, llama3 scaling
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8)),  # biases, LayerNorm, one window on every layer
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=16, use_bias=True)),  # interleaved pairs on re-laid tables
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                                                moe_num_shared_experts=1)),
    "dots1": ("Dots1Config", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  n_shared_experts=1, first_k_dense_replace=1, sliding_window=8,
                                  max_window_layers=1)),  # k_norm per head; layer 1 slides
    "minimax_m2": ("MiniMaxM2Config", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8)),
    # k_norm over the whole projection; rotate-half over half the head, as released (rotary_dim 64 of 128)
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                       moe_intermediate_size=32, first_k_dense_replace=1, use_qk_norm=True)),
    # GLM-4.5: rotate-half over half the head, k_norm per head, a dense first layer
    "phi": ("PhiConfig", {}),  # Phi-2: rotate-half over half the head, biases, output projection "dense"
    "stablelm": ("StableLmConfig", dict(qk_layernorm=True, use_qkv_bias=True)),  # a quarter of the head, a
    # LayerNorm per head (StableLM 2 12B's)
    "nemotron": ("NemotronConfig", {}),  # rotate-half over half the head, LayerNorm1P
    # windows of 8 tokens: the conformance rows (an anchor and two blocks) are ~40 tokens, so every window bites
    "ministral": ("MinistralConfig", dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=30.0)),  # scores capped low
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"])),  # RoPE 10k / 1M
    "olmo3": ("Olmo3Config", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "exaone4": ("Exaone4Config", dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "cohere2": ("Cohere2Config", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"])),  # sinks
    # Gemma 4: sliding layers of 2 KV heads of 16 beside full layers of 1 of 32 whose K = V, proportional RoPE on the
    # full layers, per-layer input embeddings; layers 2 and 3 attend layers 0's and 1's K/V (E2B's kv sharing)
    "gemma4_text": ("Gemma4TextConfig", dict(num_hidden_layers=4, head_dim=16, global_head_dim=32,
                                             num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"] * 2,
                                             num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                                             vocab_size_per_layer_input=300)),
    # multimodal checkpoints' text models (milo's causal LM over each): multimodal RoPE sections over 8 frequencies
    "qwen2_vl_text": ("Qwen2VLTextConfig", dict(rope_parameters=MROPE)),
    "qwen2_5_vl_text": ("Qwen2_5_VLTextConfig", dict(rope_parameters=MROPE, use_sliding_window=True, sliding_window=8,
                                                    max_window_layers=1)),  # layer 1 slides
    "qwen3_vl_text": ("Qwen3VLTextConfig", dict(head_dim=16, rope_parameters=MROPE_INTERLEAVED)),
    "qwen3_vl_moe_text": ("Qwen3VLMoeTextConfig", dict(MOE, rope_parameters=MROPE_INTERLEAVED)),
    # Llama 4: layer 0 chunked with complex interleaved RoPE and a weightless norm after it, layer 1 NoPE with the
    # query temperature; chunks of 512 and floor_scale 512 cap its positions at 511, past every conformance row
    "llama4_text": ("Llama4TextConfig", dict(head_dim=16, intermediate_size_mlp=96, num_local_experts=2,
                                             no_rope_layers=[1, 0], attention_chunk_size=512, floor_scale=512,
                                             rope_parameters=LLAMA3)),
    # MLA (a latent and one rope key a token): V3 with a low-rank query, rope_interleave and YaRN; V2 with q_proj and
    # complex tables on raw pairs; GLM-4.7-Flash's is V3's attention
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, rope_parameters=YARN)),
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, q_lora_rank=None)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", MLA),
    # LongCat-Flash: two MLAs in each of its 2 decoder layers (num_hidden_layers counts MLAs), zero experts too
    "longcat_flash": ("LongcatFlashConfig", dict(MLA, num_hidden_layers=4, head_dim=8,
                                                 ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=2,
                                                 moe_topk=2)),
    # hybrids: Gated DeltaNet layers 0-2 (a state per value head, 4 value heads over 2 key heads) beside attention at
    # layer 3, its output gated, a partial rotary (Qwen3.5's multimodal sections over it, interleaved)
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(HYBRID, rope_parameters=HYBRID_ROPE)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(HYBRID, **MOE, shared_expert_intermediate_size=32,
                                                      rope_parameters=HYBRID_ROPE)),
    "qwen3_next": ("Qwen3NextConfig", dict(HYBRID, **MOE, shared_expert_intermediate_size=32)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(HYBRID, linear_allow_neg_eigval=True)),  # β up to 2
    # LFM2: gated short convolutions at layers 0-2 (a window of 3), attention with per-head q/k norms at layer 3
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=4, layer_types=["conv"] * 3 + ["full_attention"], conv_L_cache=3)),
    # Bamba: Mamba2 layers 0-2 (4 heads of 16, a state of 6, two groups of B and C) beside attention at layer 3
    "bamba": ("BambaConfig", dict(num_hidden_layers=4, attn_layer_indices=[3], mamba_n_heads=4, mamba_d_head=16,
                                  mamba_d_state=6, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=1,
                                  mamba_chunk_size=16)),
    # NemotronH: a Mamba2 mixer, a block of experts, attention without RoPE and an MLP block, one a layer
    "nemotron_h": ("NemotronHConfig", dict(num_hidden_layers=4, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                                           ssm_state_size=6, n_groups=2, conv_kernel=4, chunk_size=16,
                                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1)),
    # Granite 4.0-H: the same Mamba2 layers beside Granite's attention without RoPE (as released), experts
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=4, layer_types=["mamba"] * 3 + ["attention"], position_embedding_type="nope",
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=6, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=1,
        mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        attention_multiplier=0.6, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0)),
}

TASK = TaskSpec(name="topics", template="Message: {input}\nTopic: {output}\n", anchor="Name each message's topic.",
                answer_kind="label", labels=("card", "cash", "fee", "pin"))


def config(family: str, **overrides):
    name, extra = TINY[family]
    return getattr(importlib.import_module("transformers"), name)(**{**SHAPE, **extra, **overrides})


def random_model(tiny, seed: int = 0):
    """A causal LM of config ``tiny`` in fp32 on `DEVICE`, random weights; biases and norm weights randomised too
    (transformers starts them at 0 and 1, which would hide a bias or a norm the capture missed)."""
    from milo_infer.models.multimodal import causal_lm_class

    torch.manual_seed(seed)
    model = causal_lm_class(tiny).from_config(tiny, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.to(DEVICE).eval().requires_grad_(False)


def tiny_model(family: str, seed: int = 0, **overrides) -> LoadedModel:
    """The family's tiny model (`random_model`)."""
    model = random_model(config(family, **overrides), seed)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), identity=model_identity(model))


def demonstrations(n: int = 8, offset: int = 0) -> list[Demonstration]:
    words = ("my", "card", "was", "charged", "twice", "cash", "pin", "fee")
    return [Demonstration(input=f"{words[i % 8]} {words[(i * 3) % 8]} {i} {words[(i * 5) % 8]}",
                          output=TASK.labels[i % 4], id=str(i)) for i in range(offset, offset + n)]


def fetched_model(gguf: str, label: str) -> LoadedModel:
    """A real model `tools/fetch_gguf.py` fetched once (``gguf``, one of `loading.FETCHABLE`), loaded; the calling
    test skips, naming the fetch command, where it was not fetched here."""
    import pytest

    from milo_infer.models import ModelUnavailable, load_model
    from milo_infer.models.loading import fetched_gguf_path

    try:
        path = fetched_gguf_path(gguf)
    except ModelUnavailable as exc:
        pytest.skip(f"{label} unavailable: {exc}")
    return load_model(path)


def conformance_on_one_thread(loaded: LoadedModel, shots: int, block_size: int, workdir):
    """`check_conformance` of a real model over ``shots`` demonstrations in blocks of ``block_size`` (one context
    block), on one torch thread (its fp32 rounding is what the tolerances were set from)."""
    from milo_infer.evaluation.conformance import check_conformance

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return check_conformance(loaded, demonstrations(shots), TASK, "my card was charged twice",
                                 block_size=block_size, context_blocks=1, workdir=workdir)
    finally:
        torch.set_num_threads(threads)


def linear_layer_io(model, attribute: str, ids: torch.Tensor, **forward):
    """Each linear layer's (module, its input [T, hidden], its output [T, hidden]) over one forward of ``ids`` [1, T]
    (the decoder layers' ``attribute`` modules: Qwen3.5's linear_attn, Bamba's mamba), and that forward's output."""
    seen, handles = {}, []
    for l, layer in enumerate(model.model.layers):
        if getattr(layer, attribute, None) is not None:
            handles.append(getattr(layer, attribute).register_forward_hook(
                lambda module, args, kwargs, out, l=l: seen.__setitem__(
                    l, (module, kwargs["hidden_states"][0], out[0])), with_kwargs=True))
    try:
        out = model(ids, **forward)
    finally:
        for handle in handles:
            handle.remove()
    return seen, out
