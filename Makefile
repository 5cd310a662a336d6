VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench

$(VENV)/.ready: pyproject.toml tools/setup_env.sh
	bash tools/setup_env.sh

setup: $(VENV)/.ready

demo: $(VENV)/.ready
	$(PY) -m milo_infer.evaluation.demo

test: $(VENV)/.ready
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.ready
	$(PY) tools/bench_store.py
