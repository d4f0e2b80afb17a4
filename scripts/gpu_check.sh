#!/usr/bin/env bash
# What this project runs on a GPU machine (torch with CUDA, no Horovod), most important first, each step under its
# own time limit so that one slow step cannot starve the rest: the training step through the DDP hook (layer shapes,
# then real networks), the device path's tests with torch's sync debug mode and the DDP hook on NCCL against the
# CPU, the sparse allreduce's arithmetic, then the kernel benchmarks. Logs go to $OUT (or ./gpu-logs).
#   bash scripts/gpu_check.sh [pytest args...]
#   GPU_CHECK_ONLY="tests bucket_step" bash scripts/gpu_check.sh      # only these steps (their logs' names), so that
#                                                                   # a short device lease spends its time on them
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/topk-ext}
py=${PYTHON:-python3}
limit=${GPU_CHECK_STEP_LIMIT:-150}
step() { local log=$1; shift
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" ${log%.log} "* ]]; then return 0; fi
  echo "== $*" | tee "$out/$log"; timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee -a "$out/$log"; }
{ date -u; nvidia-smi -L; "$py" -c "import torch, triton; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__)"; } 2>&1 | tee "$out/env.log"
# a training step's compression overhead through the DDP hook, in a real backward pass: per bucket (grouped
# kernels) against member by member, and how often one step makes the host wait
step bucket_step.log "$py" benchmarks/bench_bucket_step.py --device cuda --repeat 30
step bucket_step_real.log "$py" benchmarks/bench_bucket_step.py --device cuda --repeat 20 --real-batch 16
step tests.log "$py" -m pytest -q -p no:cacheprovider tests/pytorch/test_device_select.py \
  tests/pytorch/test_triton_select.py tests/pytorch/test_bucket_select.py tests/ddp/test_ddp_cuda.py \
  tests/pytorch/test_ddp_auto_clock.py "$@"
step sparse_rounds.log "$py" benchmarks/bench_sparse_rounds.py --device cuda --models resnet50-25.6M gpt2-small-124M \
  --workers 4 8 --repeat 5
step bench.log "$py" benchmarks/bench_compress.py --device cuda --repeat 10
step kernels.log "$py" benchmarks/bench_triton_kernels.py
