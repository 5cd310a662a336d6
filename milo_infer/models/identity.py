"""The record a store keeps of the model that wrote it, and the check that refuses a store of another model."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from milo_store import IncompatibleStoreError, MiloStore

from .chunked import first_chunk_positions
from .families import attention_of, head_dim, model_layout, rope_per_layer_type


def model_identity(model) -> dict:
    """What a store records about the model that wrote it; JSON-serialisable.

    ``config_hash`` covers the config fields that shape or change the cached keys and values (the
    architecture, sizes, norm, and RoPE), not the weights: ``name`` says which weights.
    """
    return config_identity(model.config, model.dtype)


def config_identity(config, dtype) -> dict:
    """`model_identity` from a model's config alone (what another engine, vLLM, loaded the weights with).

    The fields a family's description adds (`Attention.identity`, the NoPE layers, the windows where one bites)
    appear only for the models that have them, so the records of llama, qwen2 and mistral stores stay what they
    always were.
    """
    spec = attention_of(config)
    windows = spec.windows(config)
    rope = dict(getattr(config, "rope_parameters", None) or {})  # none where no layer rotates (NemotronH)
    layout = model_layout(config)
    kv_fields = {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": layout.num_kv_heads if not layout.uniform else config.num_key_value_heads,
        "head_dim": layout.head_dim if not layout.uniform else head_dim(config),
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "hidden_act": getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None),  # Gemma 2/3
        "rms_norm_eps": getattr(config, "rms_norm_eps", None),
        "attention_bias": getattr(config, "attention_bias", config.model_type == "qwen2"),
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        **{name: getattr(config, name, None) for name in spec.identity},
    }
    if any(w is not None for w in windows):  # a block's encoding row attends within them: its K/V depend on them
        kv_fields["windows"] = windows
    if not layout.uniform:  # what each layer holds (`milo_store.layers`); a uniform one's is the grid and the RoPE
        kv_fields["layers"] = layout.record()["layers"]
    digest = hashlib.sha256(json.dumps(kv_fields, sort_keys=True, default=str).encode()).hexdigest()
    per_type = rope_per_layer_type(config)
    record = {
        "layout": "interleaved" if spec.interleaved else "half",  # which channels RoPE pairs
        "theta": {kind: p.get("rope_theta") for kind, p in per_type.items()} if per_type else rope.get("rope_theta"),
        "scaling": rope if per_type or rope.get("rope_type", "default") != "default" else None,
    }
    if per_type:
        record["layer_types"] = list(config.layer_types)  # which layers each base turns
    if nope := spec.unrotated_layers(config):
        record["nope_layers"] = nope  # stored as computed, never rotated
    if (factor := rope.get("partial_rotary_factor", 1.0)) != 1.0:
        record["rotary_dim"] = int(head_dim(config) * factor)  # the channels RoPE turns; the rest are kept
    positions = first_chunk_positions(config) if spec.first_chunk else config.max_position_embeddings
    identity = {
        "name": Path(str(config.name_or_path)).name or config.model_type,
        "model_type": config.model_type,
        "config_hash": digest,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "rope": record,
        "max_position_embeddings": positions,  # Llama 4's capped at its first chunk, where milo is exact
        "dtype": str(dtype).removeprefix("torch."),
    }
    if not layout.uniform:  # each layer (a uniform model's: the grid and the RoPE record, `Layout.from_record`)
        identity["layers"] = kv_fields["layers"]
    return identity


def identity_layout(identity: dict):
    """The store layout a model's identity describes (`milo_store.layout.Layout.from_record`)."""
    from milo_store import Layout

    return Layout.from_record(identity, identity["rope"])


IDENTITY_FIELDS = ("config_hash", "num_layers", "num_kv_heads", "head_dim", "rope", "layers")  # what a store's K/V
# depend on ("layers": only where they are not all alike)


def check_compatible(store: MiloStore, identity: dict) -> None:
    """Refuse a store whose K/V another model (shape, RoPE, config) produced."""
    stored = store.meta.get("model") or {}
    wrong = [f"{k}: store {stored.get(k)!r} vs model {identity.get(k)!r}" for k in IDENTITY_FIELDS
             if stored.get(k) != identity.get(k)]
    if wrong:
        raise IncompatibleStoreError(f"{store.path} was built for another model ({stored.get('name')}): "
                                     + "; ".join(wrong))
