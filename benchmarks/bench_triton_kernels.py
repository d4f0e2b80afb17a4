#!/usr/bin/env python
"""Per-kernel GPU time of the grouped Triton selection (horovod_topk/torch/triton_select.py) on ResNet-50's weight
shapes at ratio 0.01, the tuning table's source (the constants at the top of triton_select.py); needs CUDA.

    python benchmarks/bench_triton_kernels.py                       # the tuned values
    python benchmarks/bench_triton_kernels.py --scan-block 1024 4096 --few 256 1024

It also times all-zero gradients (every entry ties with the k-th: the worst case for the histogram rounds)
against torch.topk over the same tensors.
"""
from __future__ import annotations

import argparse
import math
import runpy
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from horovod_topk.core import PayloadLayout
from horovod_topk.torch import triton_select as ts


def per_kernel_ms(run, repeat: int = 5) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            run()
        torch.cuda.synchronize()
    times = {e.key.strip("_").replace("_kernel", ""): e.device_time_total / repeat / 1000
             for e in prof.key_averages() if e.key.startswith("_")}
    return " ".join(f"{k}={v:.3f}" for k, v in sorted(times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scan-block", nargs="+", type=int, default=[ts.SCAN_BLOCK])
    parser.add_argument("--few", nargs="+", type=int, default=[ts.FEW])
    args = parser.parse_args()
    shapes = runpy.run_path(str(Path(__file__).with_name("bench_compress.py")))["resnet50_shapes"]()
    numels = [math.prod(s) for s in shapes]
    ks = [max(1, math.ceil(0.01 * n)) for n in numels]
    layouts = tuple(PayloadLayout(k, 4) for k in ks)
    grad = torch.randn(sum(numels), device="cuda")
    residual = torch.zeros_like(grad)
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, ResNet-50 weights ({sum(numels):,} in "
          f"{len(numels)} tensors), ratio 0.01, kernels alone (gradients already in one buffer); ms")
    # the first call in a process compiles the kernels (Triton caches them on disk for the next process)
    first = ts.GroupLayout(tuple(numels), layouts, grad.device)
    started = time.perf_counter()
    ts.compensate_and_select(grad, residual, first, torch.float32)
    ts.accumulate([torch.zeros(first.nbytes, dtype=torch.uint8, device=grad.device)], first, torch.float32, 1.0,
                  torch.empty_like(grad))
    torch.cuda.synchronize()
    print(f"first call (compiles, or loads from Triton's cache): {time.perf_counter() - started:.1f} s")
    for scan in args.scan_block:
        for few in args.few:
            ts.SCAN_BLOCK, ts.FEW = scan, few
            group = ts.GroupLayout(tuple(numels), layouts, grad.device)
            run = lambda: ts.compensate_and_select(grad, residual, group, torch.float32)  # noqa: E731
            run()
            print(f"scan block {scan}, few {few}: compress {do_bench(run):.3f} | {per_kernel_ms(run)}", flush=True)
    zeros, zero_residual = torch.zeros_like(grad), torch.zeros_like(grad)
    run = lambda: ts.compensate_and_select(zeros, zero_residual, group, torch.float32)  # noqa: E731
    run()
    topk = do_bench(lambda: [torch.topk(x.abs(), k, sorted=False) for x, k in zip(zeros.split(numels), ks)])
    print(f"all-zero gradients: compress {do_bench(run):.3f}, torch.topk {topk:.3f}")


if __name__ == "__main__":
    main()
