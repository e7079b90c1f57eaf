#!/usr/bin/env bash
# autotune: launch the sglang engine with the configuration tuned by study sg-c1
# study: sg-c1 (trial 0), storage sqlite:////root/s2/sg-c1/study.db
# objective: throughput; workload code, concurrency 1, 128 requests, max_tokens 256
# validated 2026-12-05T03:12:09+0000: median of 2 benchmarks on fresh servers:
#   output tok/s 788.6 (95% CI 787.0..790.3, MAD 0.2%)
#   p95 e2e ms 334 (95% CI 334..335, MAD 0.1%)
#   p95 TTFT ms 17 (95% CI 17..18, MAD 1.9%)
#   p95 ITL ms 2.5 (95% CI 2.5..2.5, MAD 0.2%)
#   accept length 0.00 (95% CI 0.00..0.00, MAD 0.0%)
#   gain over the engine defaults: 1.00x
# hardware: 1x NVIDIA H200 (140.4 GiB), driver 580.159.04, CUDA 13.0 (profile h200-sxm)
# versions: autotune 0+unknown, optuna 5.1.0, torch 2.11.0+cu130, cuda 13.0, python 3.12.3, sglang 0.5.17
# model: /root/.cache/autotune/models/smollm2-135m-instruct-b179c9523d0e-hf (sha256 588887ab7c834f361acda9c8c1239e7580de40b45acb90839400e03bde7c5f1b)
# HOST, PORT and PYTHON may be set in the environment; script arguments are added to the engine's flags.
set -euo pipefail

PYTHON=${PYTHON:-/opt/torch/.venv/bin/python3}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}
export HF_HUB_OFFLINE=1

exec "$PYTHON" -m sglang.launch_server \
  --model-path /root/.cache/autotune/models/smollm2-135m-instruct-b179c9523d0e-hf \
  --host "$HOST" \
  --port "$PORT" \
  --enable-metrics \
  --tp-size 1 \
  --kv-cache-dtype auto \
  "$@"
