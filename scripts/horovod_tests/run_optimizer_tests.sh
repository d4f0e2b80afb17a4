#!/usr/bin/env bash
# Horovod's own optimizer tests against TopKEF, on 2 workers, one horovodrun per test.
#
#   scripts/horovod_tests/run_optimizer_tests.sh HOROVOD_SRC [gloo|mpi] [class|ratio1|none]
#
# HOROVOD_SRC: a checkout of horovod/horovod at v0.28.1 (nothing of it is committed here). Every test of
# test/parallel/test_torch.py that builds hvd.DistributedOptimizer runs with TopKEF forced into it
# (force_topkef.py); "none" runs plain Horovod, the baseline. Prints one line per test and a count.
set -uo pipefail
SRC="${1:?usage: $0 HOROVOD_SRC [gloo|mpi] [class|ratio1|none]}"
CONTROLLER="${2:-gloo}"
MODE="${3:-class}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# ONLY="test_a test_b" runs a subset
ALL=(test_broadcast_state test_broadcast_state_options test_broadcast_state_no_grad test_force_allreduce
       test_model_parallelism test_delta_optimizer test_duplicate_names test_dynamic_requires_grad
       test_gradient_clipping test_synchronize_step_warning test_no_named_parameters test_missing_named_parameters
       test_optimizer_no_named_parameters test_sparse_embeddings test_optimizer_process_sets)
read -r -a TESTS <<<"${ONLY:-${ALL[*]}}"
FILE="$SRC/test/parallel/test_torch.py"
[[ -f "$FILE" ]] || { echo "no $FILE: give a checkout of horovod/horovod v0.28.1" >&2; exit 2; }
[[ "$CONTROLLER" == gloo || "$CONTROLLER" == mpi ]] || { echo "controller must be gloo or mpi" >&2; exit 2; }
# Horovod's test utilities import the `mock` package, which nothing else here needs
python -c 'import mock' 2>/dev/null || { echo "installing mock (Horovod's test/utils/common.py imports it)" >&2;
  python -m pip install -q mock >&2; }
declare -A COUNT=([passed]=0 [failed]=0 [skipped]=0)
for t in "${TESTS[@]}"; do
  log="$(mktemp)"
  FORCE_TOPKEF="$MODE" PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" timeout 600 \
    horovodrun -np 2 -H localhost:2 "--$CONTROLLER" \
    python -m pytest -q --color=no -p force_topkef -p no:cacheprovider "$FILE" -k "$t and not ${t}_" >"$log" 2>&1
  rc=$?
  if grep -q " passed" "$log" && ! grep -q " failed" "$log" && [[ $rc -eq 0 ]]; then
    if grep -q " skipped" "$log" && ! grep -q "[0-9] passed" "$log"; then outcome=skipped; else outcome=passed; fi
  elif grep -q " skipped" "$log" && [[ $rc -eq 0 ]]; then outcome=skipped
  else outcome=failed; fi
  COUNT[$outcome]=$((COUNT[$outcome] + 1))
  why=""
  [[ $outcome == failed ]] && why="  $(grep -m1 -E '(^|<stdout>:|<stderr>:)E +[A-Za-z]*Error' "$log" | sed 's/.*E  *//' |
                                      cut -c1-120)"
  printf '%-40s %s%s\n' "$t" "$outcome" "$why"
  rm -f "$log"
done
echo "controller $CONTROLLER, TopKEF $MODE: ${COUNT[passed]} passed, ${COUNT[failed]} failed, ${COUNT[skipped]} skipped"
