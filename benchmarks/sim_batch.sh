#!/usr/bin/env bash
# Run many benchmarks/compression_sim.py screens at once, e.g. on a GPU host (many small models share one GPU well):
#
#   python benchmarks/lm_tasks.py --save .gpu/corpus.bin          # this machine's text, so the task is the same there
#   OUT=results/sim-batch bash benchmarks/sim_batch.sh JOBS 14 470 --device cuda
#
# JOBS: one screen per line, compression_sim.py's arguments (e.g. "--task gptlm --steps 1200 --seeds 0 --methods
# dense"). PARALLEL screens run at a time; none starts after DEADLINE_S seconds and each is stopped a minute after
# it (a lease on a shared machine is finite). Results: $OUT/sim/*.json (packed into $OUT/sim.tgz with --pack),
# one line per finished screen in $OUT/log.txt, failures named there too. The remaining arguments go to every
# screen. HOROVOD_TOPK_CORPUS defaults to .gpu/corpus.bin when that file exists.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs_file=$1; parallel=$2; deadline=$3; shift 3
pack=0
if [ "${1:-}" = "--pack" ]; then pack=1; shift; fi
OUT=${OUT:-results/sim-batch}
mkdir -p "$OUT/sim"
if [ -z "${HOROVOD_TOPK_CORPUS:-}" ] && [ -f .gpu/corpus.bin ]; then export HOROVOD_TOPK_CORPUS=$PWD/.gpu/corpus.bin; fi
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
start=$(date +%s)
while read -r line; do
  case "$line" in ""|"#"*) continue ;; esac
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do sleep 1; done
  elapsed=$(( $(date +%s) - start ))
  if [ "$elapsed" -gt "$deadline" ]; then echo "deadline: not started: $line" >> "$OUT/log.txt"; continue; fi
  # shellcheck disable=SC2086  # a line is a list of arguments
  ( timeout $(( deadline + 60 - elapsed )) "$PYTHON" benchmarks/compression_sim.py --out "$OUT/sim" "$@" $line \
      < /dev/null >> "$OUT/log.txt" 2>> "$OUT/err.txt" || echo "FAILED($?): $line" >> "$OUT/log.txt" ) &
done < "$jobs_file"
wait
echo "elapsed $(( $(date +%s) - start )) s" >> "$OUT/log.txt"
if [ "$pack" = 1 ]; then tar czf "$OUT/sim.tgz" -C "$OUT" sim && rm -r "$OUT/sim"; fi
