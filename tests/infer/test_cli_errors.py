"""Input and environment errors of the CLIs are one line (or, for a closed pipe, silence), never a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import milo_infer.cli
from milo_infer.cli.main import main as milo
from milo_store import CompressionConfig, Layout
from milo_store.synthetic import build_synthetic_store

ROOT = Path(__file__).resolve().parents[2]


def no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the device was checked")


def test_an_absent_cuda_device_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"  # never there
    monkeypatch.setattr(milo_infer.cli, "load_model", no_model)
    assert milo(["query", str(tmp_path / "store"), "a query", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"milo query: --device {device}: not usable here"), err


@pytest.mark.parametrize("command", ["ls", "stat"])
def test_a_closed_pipe_ends_the_command_quietly(tmp_path, command):
    """`milo-store ls STORE | head -1`: the reader is gone; no BrokenPipeError traceback, no 'Exception ignored'."""
    store = build_synthetic_store(tmp_path / "s", Layout(2, 2, 16), [10, 12, 9], CompressionConfig(ratio=0.5))
    read, write = os.pipe()
    os.close(read)  # every write the command makes meets a closed pipe
    try:
        done = subprocess.run([sys.executable, "-m", "milo_store.cli.main", command, str(store)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


@pytest.mark.parametrize("model_type, overrides, reason", [
    ("jamba", {}, "hybrid linear attention"),
    ("gemma3", {}, "the multimodal Gemma 3 (gemma3)"),
    ("deepseek_v32", {}, "DeepSeek Sparse Attention"),
    ("hunyuan_v1_dense", {}, "its query and key RMSNorms follow RoPE"),
])
def test_build_on_a_refused_family_is_one_line_naming_why(model_type, overrides, reason, tmp_path, capsys):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **overrides).save_pretrained(tmp_path / "model")  # no weights: refused first
    code = milo(["build", "--model", str(tmp_path / "model"), "--corpus", str(ROOT / "milo_infer/tasks/data/demo_corpus.jsonl"),
                 "--out", str(tmp_path / "store")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and reason in err, err
    assert not (tmp_path / "store").exists()


def model_folder(path, model_type: str | None = None, raw: dict | None = None) -> str:
    """A model folder with a config and no weights: transformers' default config of ``model_type``, or ``raw``."""
    import json

    from transformers import AutoConfig

    path.mkdir()
    if raw is not None:
        (path / "config.json").write_text(json.dumps(raw))
    else:
        AutoConfig.for_model(model_type).save_pretrained(path)
    return str(path)


def model_commands(model: str, tmp_path) -> dict[str, list[str]]:
    """`milo check-model`, `milo build` and `milo serve` (on a store it mounts first) of ``model``."""
    store = tmp_path / "served"
    if not store.exists():
        build_synthetic_store(store, Layout(2, 2, 16), [10, 12], CompressionConfig(ratio=0.5))
    corpus = str(ROOT / "milo_infer/tasks/data/demo_corpus.jsonl")
    return {"check-model": ["check-model", model],
            "build": ["build", "--model", model, "--corpus", corpus, "--out", str(tmp_path / "store")],
            "serve": ["serve", str(store), "--model", model, "--device", "cpu"]}


@pytest.mark.parametrize("model_type, reason", [
    ("hunyuan_v1_moe", "depends on m and n, not on m - n alone"),
    ("gemma3", "image tokens attend bidirectionally"),  # refused as a whole, wrapper and all
])
def test_a_refused_family_is_one_line_from_every_command_that_loads_a_model(model_type, reason, tmp_path, capsys):
    model = model_folder(tmp_path / "model", model_type)
    for command, argv in model_commands(model, tmp_path).items():
        code = milo(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and reason in err and model in err, (command, err)
        assert err.startswith(f"milo {command}: "), err


def test_a_config_or_model_file_transformers_cannot_read_is_one_line_naming_the_model(tmp_path, capsys):
    from transformers import LlamaConfig

    unknown = model_folder(tmp_path / "unknown", raw={"model_type": "no_such_family"})
    broken = tmp_path / "broken"  # a supported config, weights that are not a safetensors file
    LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    for model, said in ((unknown, "transformers cannot read its config.json"),
                        (str(broken), "transformers cannot load its weights")):
        for command, argv in model_commands(model, tmp_path).items():
            code = milo(argv)
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1 and said in err and model in err, (command, err)
