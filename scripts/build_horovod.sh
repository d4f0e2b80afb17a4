#!/usr/bin/env bash
# Builds a Horovod wheel from PyPI's sdist against the frameworks installed in a given Python environment.
#   usage: build_horovod.sh PYTHON VERSION OUT_DIR
#
# Horovod 0.28.1 as shipped does not compile here (see the patches below); we patch a copy unpacked in a
# temporary directory, never Horovod's installed files, and leave the built wheel in OUT_DIR for reuse.
set -euo pipefail
PY="$1"; VERSION="$2"; OUT="$3"
log() { printf '[build_horovod] %s\n' "$*" >&2; }

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

log "building (PyTorch, TensorFlow, MPI, Gloo; this takes a while on 2 cores)"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=gloo
# HOROVOD_GPU_OPERATIONS (NCCL in docker/Dockerfile.gpu) passes through from the environment when set.
export MAKEFLAGS="-j$(nproc)"
mkdir -p "$OUT"
( cd "$src" && "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" . ) >"$work/build.log" 2>&1 || {
  tail -n 60 "$work/build.log" >&2; log "Horovod build failed"; exit 1; }
cp "$work"/dist/horovod-*.whl "$OUT"/
log "built $(ls "$OUT")"
