#!/usr/bin/env bash
# Builds a Horovod wheel from PyPI's sdist against the frameworks installed in a given Python environment.
#   usage: build_horovod.sh PYTHON VERSION OUT_DIR
#
# Horovod 0.28.1 as shipped does not compile here (see the patches below); we patch a copy unpacked in a
# temporary directory, never Horovod's installed files, and leave the built wheel in OUT_DIR for reuse.
set -euo pipefail
PY="$1"; VERSION="$2"; OUT="$3"
log() { printf '[build_horovod] %s\n' "$*" >&2; }

# A GPU build without nvcc would compile for minutes and then fail in CMake: stop first, saying what is missing.
if [[ -n "${HOROVOD_GPU_OPERATIONS:-}" && ! -x "${HOROVOD_CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
  log "HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS needs nvcc in ${HOROVOD_CUDA_HOME:-/usr/local/cuda}/bin (set HOROVOD_CUDA_HOME)"
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log "fetching the horovod==$VERSION sdist"
"$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$work"
tar -xzf "$work"/horovod-"$VERSION".tar.gz -C "$work"
src="$work/horovod-$VERSION"

# patch FILE PATTERN REPLACEMENT: a sed substitution that must change the file, or the build stops here
# (a silently skipped patch would surface much later as a confusing compile error).
patch() {
  local file="$src/$1" before
  before="$(sha256sum "$file")"
  sed -i "$2" "$file"
  [[ "$(sha256sum "$file")" != "$before" ]] || { log "patch '$2' did not apply to $1"; exit 1; }
}
# torch >= 2.1 headers need C++17; gloo must use the same standard or linking fails on
# gloo::rendezvous::Store::kDefaultTimeout (multiple definition).
patch CMakeLists.txt 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/'
patch horovod/torch/CMakeLists.txt 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/'
patch third_party/gloo/CMakeLists.txt 's/-std=c++11/-std=c++17/'
# TensorFlow 2.21 no longer ships tensorflow/compiler/xla/client/xla_builder.h; this drops only Horovod's
# optional XLA collectives (HOROVOD_ENABLE_XLA_OPS), not the regular TensorFlow ops.
patch horovod/tensorflow/CMakeLists.txt '/xla_mpi_ops.cc/d'

log "building (PyTorch, TensorFlow, MPI, Gloo${HOROVOD_GPU_OPERATIONS:+, $HOROVOD_GPU_OPERATIONS}; this takes a while on 2 cores)"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=gloo
# GPU builds (docker/Dockerfile.gpu sets HOROVOD_GPU_OPERATIONS=NCCL): CUDA kernels and NCCL collectives, linked
# against the distribution's shared libnccl (libnccl2/libnccl-dev). Horovod's default list of compute capabilities
# starts at 3.5, which CUDA 12's nvcc no longer accepts: Volta (7.0) to Hopper (9.0) instead, overridable.
if [[ -n "${HOROVOD_GPU_OPERATIONS:-}" ]]; then
  export HOROVOD_GPU="${HOROVOD_GPU:-CUDA}" HOROVOD_NCCL_LINK="${HOROVOD_NCCL_LINK:-SHARED}"
  export HOROVOD_CUDA_HOME="${HOROVOD_CUDA_HOME:-/usr/local/cuda}"
  export HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-70,75,80,86,89,90}"
  log "GPU build: $HOROVOD_GPU_OPERATIONS collectives, CUDA in $HOROVOD_CUDA_HOME, compute capabilities $HOROVOD_BUILD_CUDA_CC_LIST"
fi
export MAKEFLAGS="-j$(nproc)"
mkdir -p "$OUT"
( cd "$src" && "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" . ) >"$work/build.log" 2>&1 || {
  tail -n 60 "$work/build.log" >&2; log "Horovod build failed"; exit 1; }
cp "$work"/dist/horovod-*.whl "$OUT"/
log "built $(ls "$OUT")"
