#!/usr/bin/env bash
# autotune: launch the sglang engine with the configuration tuned by study tuner-sglang-c4
# study: tuner-sglang-c4 (trial 0), storage sqlite:////root/g2/studies/tuner-sglang-c4/study.db
# objective: throughput; workload code, concurrency 4, 16 requests, max_tokens 256
# validated 2026-12-05T09:24:41+0000: median of 2 benchmarks on fresh servers:
#   output tok/s 1512.4 (95% CI 1497.8..1527.1, MAD 1.0%)
#   p95 e2e ms 713 (95% CI 698..728, MAD 2.1%)
#   p95 TTFT ms 101 (95% CI 96..106, MAD 4.9%)
#   p95 ITL ms 4.4 (95% CI 4.3..4.5, MAD 2.3%)
#   accept length 0.00 (95% CI 0.00..0.00, MAD 0.0%)
#   gain over the engine defaults: 1.00x
# hardware: 1x NVIDIA H100 80GB HBM3 (79.6 GiB), driver 580.159.04, CUDA 13.0 (profile h100-sxm5)
# versions: autotune 0+unknown, optuna 5.1.0, torch 2.11.0+cu130, cuda 13.0, python 3.12.3, sglang 0.5.17, llamacpp 11434
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
