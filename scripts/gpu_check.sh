#!/usr/bin/env bash
# What this project runs on a GPU machine (torch with CUDA, no Horovod): the device path's tests, CUDA ones
# included, and the device benchmarks. Logs go to $OUT (or ./gpu-logs).
#   bash scripts/gpu_check.sh [pytest args...]
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
{ date -u; nvidia-smi -L; "$py" -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } 2>&1 | tee "$out/env.log"
"$py" -m pytest -q -p no:cacheprovider tests/pytorch/test_device_select.py tests/pytorch/test_triton_select.py \
  tests/pytorch/test_bucket_select.py "$@" 2>&1 | tee "$out/tests.log"
"$py" benchmarks/bench_compress.py --device cuda --repeat 10 2>&1 | tee "$out/bench.log"
# a training step's compression overhead through the DDP hook, in a real backward pass: per bucket (grouped
# kernels) against member by member
"$py" benchmarks/bench_bucket_step.py --device cuda --repeat 50 2>&1 | tee "$out/bucket_step.log"
"$py" benchmarks/bench_triton_kernels.py 2>&1 | grep -v -i warn | tee "$out/kernels.log"
