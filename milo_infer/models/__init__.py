"""The model adapter: load a supported decoder, describe its attention, and expose its keys before RoPE.

MILO stores keys *before* rotary position embedding (so a block of demonstrations can be placed at
any position later) and values as they are. This room is the only place that knows how a Hugging
Face model lays these out:

* `families`: one declarative `Attention` per model family (where its keys, values and queries are read,
  which layers rotate, how), the registry `FAMILIES`, the refused families and why (`check_supported`);
* `loading`: `load_model` (the default model, an HF directory, a ``.gguf``), `model_directory`, `read_config`
  (a wrapped text model's config for a multimodal checkpoint);
* `identity`: `model_identity`, the JSON record a store keeps to refuse a cache built by another model;
* `capture`: `capture_kv` (pre-RoPE keys and values per layer), `capture_queries` (pre-RoPE queries) and the
  query-aware `channel_scales`;
* `rope`: the model's own cos/sin tables (`rope_tables`), and each layer's (`RopeTables`: NoPE layers
  rotate by identity tables);
* `chunked`: Llama 4's positions capped at its first attention chunk, where milo is exact (`first_chunk_positions`);
* `multimodal`: what loads a multimodal checkpoint's text model as a causal LM (`causal_lm_class`; `text_lm` holds
  milo's own, `TextModelForCausalLM`), and its media tokens, refused in a corpus or a query (`media_tokens`,
  `media_problem`).
"""
from .capture import (CapturedKV, attention_modules, capture_kv, capture_queries, channel_scales, decoder_layers,
                      key_gains, output_channel_scales, query_channel_scales)
from .families import (FAMILIES, REFUSED, SUPPORTED_ROPE_TYPES, Attention, UnsupportedModelError, attention_of,
                       check_supported, head_dim, layer_specs, model_layout)
from .identity import IDENTITY_FIELDS, check_compatible, config_identity, identity_layout, model_identity
from .loading import (LoadedModel, ModelUnavailable, _converted_gguf, cache_root, default_gguf_path, llama_as_qwen2,
                      load_model, model_directory, read_config)
from .multimodal import causal_lm_class, media_problem, media_tokens
from .rope import RopeTables, config_layer_rope_tables, config_rope_tables, layer_rope_tables, rope_tables

__all__ = ["Attention", "CapturedKV", "FAMILIES", "IDENTITY_FIELDS", "LoadedModel", "ModelUnavailable", "REFUSED",
           "RopeTables", "SUPPORTED_ROPE_TYPES", "UnsupportedModelError", "attention_modules", "attention_of",
           "cache_root", "capture_kv", "capture_queries", "causal_lm_class",
           "channel_scales", "check_compatible", "check_supported", "config_identity", "config_layer_rope_tables",
           "config_rope_tables", "decoder_layers", "default_gguf_path", "head_dim", "identity_layout", "key_gains",
           "layer_rope_tables", "layer_specs", "llama_as_qwen2", "load_model", "media_problem", "media_tokens",
           "model_directory", "model_identity", "model_layout", "output_channel_scales", "query_channel_scales",
           "read_config", "rope_tables"]
