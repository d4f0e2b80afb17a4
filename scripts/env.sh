# Sourced by the scripts: the project's Python environment and the settings every Horovod run here needs.
# shellcheck shell=bash
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${VIRTUAL_ENV:-}" || "$VIRTUAL_ENV" == "$_root/.venv" ]]; then
  source "$_root/.venv/bin/activate"
fi
# mpirun refuses to start as root without these (containers and CI run as root).
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Two workers share two cores: one compute thread each avoids oversubscription.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# A collective that some rank never joins becomes an error after this long instead of a hang.
export HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS:-120}"
# TensorFlow's start-up chatter (oneDNN, CUDA probing) hides test output.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
unset _root
# Keras 2 (tf-keras) behind tf.keras: Horovod 0.28.1's TensorFlow wrappers fail on Keras 3 variables
# ("'Variable' object has no attribute 'ref'"). See docs/tensorflow.md.
export TF_USE_LEGACY_KERAS="${TF_USE_LEGACY_KERAS:-1}"
