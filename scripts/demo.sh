#!/usr/bin/env bash
# Sets everything up if needed (scripts/setup.sh), then trains the digits CNN on 2 Horovod workers with TopKEF
# and, for comparison, with plain Horovod (dense allreduce), first in PyTorch, then in TensorFlow/Keras. Extra
# arguments go to both example scripts
# (e.g. scripts/demo.sh --ratio 0.001 --epochs 10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
echo "== PyTorch, 2 workers, TopKEF"
horovodrun -np 2 -H localhost:2 python examples/digits_torch.py "$@"
echo "== PyTorch, 2 workers, dense allreduce (baseline)"
horovodrun -np 2 -H localhost:2 python examples/digits_torch.py --dense "$@"
echo "== TensorFlow/Keras, 2 workers, TopKEF"
horovodrun -np 2 -H localhost:2 python examples/digits_keras.py "$@"
echo "== TensorFlow/Keras, 2 workers, dense allreduce (baseline)"
horovodrun -np 2 -H localhost:2 python examples/digits_keras.py --dense "$@"
