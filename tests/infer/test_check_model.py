"""`milo check-model`: the conformance checks on a model directory, as a user runs them before a long build.

Tiny random models saved as Hugging Face directories (`tests/infer/families.py`): a supported family passes
(exit 0, a deviation per layer), a deliberately wrong description fails (exit 1, naming the layer and the
check), a refused family is one line naming why (exit 2), before any weights load.
"""
import dataclasses
import json

import pytest

from milo_infer.cli.main import main as milo
from milo_infer.models import FAMILIES
from tests.infer import families


def saved(family: str, path):
    loaded = families.tiny_model(family)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return saved("qwen3", tmp_path_factory.mktemp("qwen3"))


def test_a_supported_model_passes_with_a_deviation_per_layer(qwen3_dir, capsys):
    assert milo(["check-model", qwen3_dir]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 and all(len(line.split()) == 6 for line in rows), out  # layer + five checks
    assert "PASS" in out.splitlines()[-1]


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "phi", "stablelm", "nemotron"])
def test_a_rotate_half_partial_rotary_family_passes_on_its_own_weights(family, tmp_path, capsys):
    """Issue 56's families, saved and loaded back as a user's directory (MiniMax-M2's config keeps its released
    rotary_dim field, StableLM's and Nemotron's layers get the engine's batch handed on once loaded)."""
    assert milo(["check-model", saved(family, tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["model_type"] == family


def test_json_names_each_layers_deviations_and_tolerance(qwen3_dir, capsys):
    assert milo(["check-model", qwen3_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["dtype"] == "float32" and report["tolerance"]["capture"] == 3e-5
    assert max(layer["capture keys"] for layer in report["layers"]) <= 1e-5


def test_a_wrong_description_fails_naming_the_layer(qwen3_dir, monkeypatch, capsys):
    monkeypatch.setitem(FAMILIES, "qwen3", dataclasses.replace(FAMILIES["qwen3"], keys=("k_proj",)))  # k_norm dropped
    assert milo(["check-model", qwen3_dir]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("FAIL") and "layer 0 capture keys" in last, last


def test_bfloat16_is_checked_against_its_own_tolerance(qwen3_dir, capsys):
    assert milo(["check-model", qwen3_dir, "--dtype", "bfloat16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16" and report["tolerance"]["capture"] > 1e-5


def test_a_refused_family_is_one_line_naming_why(tmp_path, capsys):
    from transformers import AutoConfig

    AutoConfig.for_model("falcon_h1").save_pretrained(tmp_path)  # a config, no weights: refused before loading
    assert milo(["check-model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hybrid linear attention" in err, err


def test_too_few_demonstrations_for_two_blocks_is_an_input_error(qwen3_dir, capsys):
    assert milo(["check-model", qwen3_dir, "--shots", "3", "--block-size", "2"]) == 2
    assert "at least 4 demonstrations" in capsys.readouterr().err


def test_gemma4_passes_with_its_shared_layers_named(tmp_path, capsys):
    """Its per-layer shapes, K = V and proportional RoPE checked layer by layer; the layers attending another's K/V
    have nothing of their own to check and say so."""
    assert milo(["check-model", saved("gemma4_text", tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"] and rows[2][1:5] == ["shared"] * 4, rows


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_an_mla_model_passes_with_its_latent_as_keys(family, tmp_path, capsys):
    """An MLA layer's one unit [rope key | latent] is checked as its keys; it has no values of its own."""
    assert milo(["check-model", saved(family, tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["model_type"] == family
    assert all("capture keys" in layer and "capture values" not in layer for layer in report["layers"])


def test_a_kimi_k2_checkpoint_is_checked_as_deepseek_v3(tmp_path, capsys):
    """Kimi K2's config.json names its own type and remote code; its architecture is DeepSeek V3's."""
    directory = saved("deepseek_v3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert milo(["check-model", directory, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["model_type"] == "deepseek_v3"


def mistral3_dir(path, tie: bool) -> str:
    """A tiny Mistral 3 checkpoint (a Pixtral vision tower wrapping the tiny Mistral), saved as transformers saves
    it: its text model is what milo judges, loads and checks."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=16, image_size=32, patch_size=16)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(Mistral3Config(text_config=families.config("mistral"),
                                                            vision_config=vision, tie_word_embeddings=tie))
    model.save_pretrained(path)
    families.tiny_model("mistral").tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tie", [False, True])
def test_a_checkpoint_wrapping_a_text_model_is_checked_as_its_text_model(tie, tmp_path, capsys):
    from transformers import Mistral3ForConditionalGeneration

    from milo_infer.models import load_model

    path = mistral3_dir(tmp_path / "mistral3", tie)
    loaded, whole = load_model(path), Mistral3ForConditionalGeneration.from_pretrained(path)
    assert loaded.identity["model_type"] == "mistral"
    ours, theirs = loaded.model.state_dict(), whole.state_dict()
    assert torch_equal(ours["lm_head.weight"], theirs["lm_head.weight"])  # no head left at its random init
    assert all(torch_equal(tensor, theirs[f"model.language_model.{name.removeprefix('model.')}"])
               for name, tensor in ours.items() if name.startswith("model."))
    assert milo(["check-model", path]) == 0
    assert "PASS" in capsys.readouterr().out.splitlines()[-1]


def test_a_wrapped_text_model_missing_a_weight_is_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    path = mistral3_dir(tmp_path / "mistral3", tie=False)
    weights = tmp_path / "mistral3" / "model.safetensors"
    dropped = "layers.1.self_attn.k_proj.weight"
    save_file({name: t for name, t in load_file(weights).items() if not name.endswith(dropped)}, weights,
              metadata={"format": "pt"})
    capsys.readouterr()
    assert milo(["check-model", path]) == 2
    err = capsys.readouterr().err  # transformers' progress bar, then milo's one line
    assert "Traceback" not in err and "text model's weights are not all in the checkpoint" in err.splitlines()[-1], err


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_a_hybrid_passes_with_its_linear_layers_states_checked(tmp_path, capsys):
    """Qwen3.5's Gated DeltaNet layers (issue 61): each block's stored pair carries the model's own state across it,
    its conv tail is the model's last inputs, and the query's logits follow from the composed states."""
    assert milo(["check-model", saved("qwen3_5_text", tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and [row[1] for row in rows] == ["linear"] * 3 + [rows[3][1]], out
    assert all(float(row[6]) <= 3e-5 for row in rows[:3]) and rows[3][6] == "-", out  # the state column
    assert "PASS" in out.splitlines()[-1]
