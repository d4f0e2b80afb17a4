#!/usr/bin/env bash
# Sets everything up if needed (scripts/setup.sh), then runs the whole test suite:
#   1. single-process tests (core, framework adapters) with pytest;
#   2. the multi-worker tests in tests/parallel_torch, tests/parallel_tf and tests/parallel_keras3 on 2 real Horovod workers, once with
#      the Gloo controller and once with MPI (horovodrun -np 2 -H localhost:2 --gloo / --mpi).
# Ends with one line "N passed, N failed, N skipped" summed over all runs (rank 0's view of the parallel ones).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh" || exit 1
source "$ROOT/scripts/env.sh"
cd "$ROOT"
# No GPU here: the Triton kernels (horovod_topk/torch/triton_select.py) run under Triton's interpreter. It must be
# set before anything imports Triton (its own library functions are made for one mode at import).
export TRITON_INTERPRET=1

reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
status=0

echo "== single-process tests"
python -m pytest tests --ignore=tests/parallel_torch --ignore=tests/parallel_tf --ignore=tests/parallel_keras3 -q -p no:cacheprovider --color=no --junitxml="$reports/unit.xml" "$@" || status=1

# One process per worker holds one framework's Horovod: each framework's suite runs in its own job.
# Each test is named as it starts and its line written at once (-v, unbuffered): a worker that dies takes its
# buffered output with it, and the log must still say which test it was in. Horovod's Gloo context gives up on a
# peer that has not answered for HOROVOD_GLOO_TIMEOUT_SECONDS (30 by default) and the job fails (one worker stopped
# for 40 s: Horovod shut down at 30, carried on at 300); two workers on a shared 2-core machine may be descheduled
# that long, so the runs wait 300 s, and `timeout` still turns a real hang into a failure.
export PYTHONUNBUFFERED=1 HOROVOD_GLOO_TIMEOUT_SECONDS="${HOROVOD_GLOO_TIMEOUT_SECONDS:-300}"
for suite in parallel_torch parallel_tf parallel_keras3; do
  for controller in gloo mpi; do
    echo "== multi-worker tests: horovodrun -np 2 --$controller pytest tests/$suite"
    # The rank goes into each report's name; `timeout` turns an unexpected hang into a failure.
    timeout 1200 horovodrun -np 2 -H localhost:2 "--$controller" \
      sh -c "exec python -m pytest tests/$suite -v -p no:cacheprovider --color=no \
             --junitxml=$reports/$suite-$controller-rank\${HOROVOD_RANK:-\$OMPI_COMM_WORLD_RANK}.xml $*" \
      || status=1
  done
done

python - "$reports" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
passed = failed = skipped = 0
files = [f for f in sorted(glob.glob(sys.argv[1] + "/*.xml")) if "-rank" not in f or f.endswith("-rank0.xml")]
for f in files:
    for suite in ET.parse(f).getroot().iter("testsuite"):
        t, fl, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        passed += t - fl - e - s; failed += fl + e; skipped += s
print(f"{passed} passed, {failed} failed, {skipped} skipped")
PY
exit $status
