#!/usr/bin/env bash
# Builds llama.cpp's benchmark tools and its GGUF converter's venv, once, outside the repo
# (../shared/notes/peer-llamacpp-cpu.md): the llama-cpp-python sdist from PyPI carries the whole
# llama.cpp tree under vendor/llama.cpp, so PyPI is the only source needed.
#
#   bench/peer/llamacpp_build.sh PYTHON VERSION DIR
#
# DIR/src        the vendored llama.cpp tree (convert_hf_to_gguf.py, gguf-py)
# DIR/build/bin  llama-bench, llama-quantize, llama-batched-bench (+ their shared libraries)
# DIR/venv       the converter's own venv (torch 2.13.0 CPU, transformers, gguf-py of the tree)
# DIR/.stamp     written last; `make bench-peer` depends on it
#
# The compile takes ~11 minutes on 2 cores, so it runs at nice 19 and is never part of
# `make test`.
set -euo pipefail
PYTHON=$1 VERSION=$2 DIR=$3
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then  # the build's only system needs
    apt-get install -y -qq cmake g++ >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq cmake g++)
fi
mkdir -p "$DIR"
cd "$DIR"

if [ ! -d src ]; then
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist
    tar -xzf "sdist/llama_cpp_python-$VERSION.tar.gz"
    mv "llama_cpp_python-$VERSION/vendor/llama.cpp" src
    rm -f src/.git  # a submodule pointer into a .git the sdist lacks: only makes git calls fail
    rm -rf "llama_cpp_python-$VERSION"
fi

# GGML_NATIVE: -march=native, the same ISA our own kernels compile for. No server, tests,
# examples or HTTPS: only the three tools are built. -U__AMX_INT8__ leaves out ggml's AMX
# backend (its only guard is that macro) and keeps every AVX-512 / VNNI kernel and the CPU
# repack: on an AMX Xeon VM (2026-11-27) this version's AMX matmul died on its first tile load
# (SIGILL in tinygemm_kernel_amx for Q8_0, Q4_K_M and SmolLM2's Q4_1; SIGSEGV for Q4_0), as
# llama.cpp PR 26954 describes (tile config on the stack optimized away, tile permission asked
# on the main thread only). Harmless where -march=native has no AMX.
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__ \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF >cmake-configure.log
nice -n 19 cmake --build build -j 2 --target llama-bench llama-quantize llama-batched-bench >cmake-build.log

# The converter imports torch and transformers; torch 2.13.0 resolves to the local CPU wheel
# (the converter's own pin would pull a CUDA build from PyPI). transformers is pinned as the
# tree's requirements file pins it.
test -x venv/bin/python || "$PYTHON" -m venv venv
venv/bin/python -m pip install -q --upgrade pip
venv/bin/python -c "import torch" 2>/dev/null || venv/bin/python -m pip install -q "torch==2.13.0"
venv/bin/python -m pip install -q "transformers==4.57.6" "protobuf>=4.21,<5" sentencepiece safetensors ./src/gguf-py
touch .stamp
echo "llama.cpp $VERSION tools in $DIR/build/bin"
