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
    ("qwen3_next", {}, "hybrid linear attention"),
    ("gemma3", {}, "the multimodal Gemma 3 (gemma3)"),
    ("deepseek_v3", {}, "multi-head latent attention"),
    ("hunyuan_v1_dense", {}, "its key norm follows RoPE"),
    ("stablelm", {}, "partial rotary embedding with rotate-half pairs"),
])
def test_build_on_a_refused_family_is_one_line_naming_why(model_type, overrides, reason, tmp_path, capsys):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **overrides).save_pretrained(tmp_path / "model")  # no weights: refused first
    code = milo(["build", "--model", str(tmp_path / "model"), "--corpus", str(ROOT / "milo_infer/tasks/data/demo_corpus.jsonl"),
                 "--out", str(tmp_path / "store")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and reason in err, err
    assert not (tmp_path / "store").exists()
