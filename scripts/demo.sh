#!/usr/bin/env bash
# Sets everything up if needed (scripts/setup.sh), then trains the digits CNN on 2 Horovod workers (Gloo) with
# TopKEF and, for comparison, with plain Horovod (dense allreduce), in PyTorch and in TensorFlow/Keras. Shows one
# line per epoch from rank 0, then a side-by-side table, a plot (PNG), and where TopKEF pays: the advisor's
# prediction for the same model on 8 workers at 1 and 10 Gbit/s from the step times measured here (on one
# machine, over loopback, TopKEF's own work shows and what it saves does not; scripts/demo_report.py). Every
# process's full output, framework logs included, goes to a log file per run in the output directory (DEMO_OUT,
# default: a new temporary one).
# Extra arguments go to every run (e.g. scripts/demo.sh --ratio 0.001 --epochs 10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
OUT="${DEMO_OUT:-$(mktemp -d -t horovod-topk-demo.XXXX)}"
mkdir -p "$OUT"
echo "output and logs: $OUT"

run() {  # run NAME TITLE SCRIPT [ARGS...]: rank 0's own lines, without the launcher's "[0]<stdout>:" tags
  local name=$1 title=$2 script=$3
  shift 3
  echo
  echo "== $title"
  if ! horovodrun -np 2 -H localhost:2 --gloo python "$script" --summary "$OUT/$name.json" "$@" \
      > >(tee "$OUT/$name.log" | sed -u -n -e 's/^\[0\]<stdout>://p') 2>>"$OUT/$name.log"; then
    echo "!! $title failed; last lines of $OUT/$name.log:" >&2
    tail -n 20 "$OUT/$name.log" >&2
    exit 1
  fi
}

run 1-torch-topkef "PyTorch, 2 workers, TopKEF" examples/digits_torch.py "$@"
run 2-torch-dense "PyTorch, 2 workers, dense allreduce (baseline)" examples/digits_torch.py --dense "$@"
run 3-keras-topkef "TensorFlow/Keras, 2 workers, TopKEF" examples/digits_keras.py "$@"
run 4-keras-dense "TensorFlow/Keras, 2 workers, dense allreduce (baseline)" examples/digits_keras.py --dense "$@"
sleep 0.2  # let the last tee/sed flush
echo
python scripts/demo_report.py "$OUT"
