#!/usr/bin/env python
"""What ratio="auto"'s dense routes cost the host per step, against one elementwise pass over the same values.

The fp16 route (torch.half_route) and the int8 route (torch.int8_route) each make one pass over a tensor before its
allreduce (compensate with the residual, round, keep what was not sent) and the int8 route one after it (read the
summed words back); on the CPU both are the fused kernels of csrc/. Timed on one thread, interleaved round by round
(best of the rounds per column), for tensors of the given sizes:

    python benchmarks/bench_dense_routes.py --numel 870000 25600000 --world-size 4
"""
from __future__ import annotations

import argparse
import time

import torch


def best_ms(fn, reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, nargs="+", default=[870_000, 25_600_000])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from horovod_topk.torch import kernels
    from horovod_topk.torch.half_route import to_half
    from horovod_topk.torch.int8_route import from_int8, to_int8

    torch.set_num_threads(1)
    fused = kernels.load() is not None
    world_size, scale = args.world_size, 1.0 / args.world_size
    print(f"torch {torch.__version__}, one thread, fused kernels: {'yes' if fused else 'no (torch operations)'}, "
          f"P = {world_size}, best of {args.rounds} interleaved rounds")
    print("| values | elementwise pass ms | fp16 send ms | int8 send ms | int8 receive ms | fp16 / pass | "
          "int8 (send + receive) / pass |")
    print("|---|---|---|---|---|---|---|")
    for numel in args.numel:
        torch.manual_seed(0)
        grad, residual = torch.randn(numel), torch.randn(numel) * 1e-3
        half_out = torch.empty(numel, dtype=torch.float16)
        words, _, delta = to_int8(grad, residual.clone(), scale, world_size, 3.0)
        summed, out = words * world_size, torch.empty(numel)
        summed[-1] = 0
        reps = max(3, int(2e7 // numel))
        columns = {
            "pass": lambda: residual.add_(grad, alpha=0.0),
            "fp16": lambda: to_half(grad, residual, scale, world_size, half_out),
            "int8 send": lambda: to_int8(grad, residual, scale, world_size, 3.0),
            "int8 receive": lambda: from_int8(summed, numel, world_size, delta, out),
        }
        best = {name: float("inf") for name in columns}
        for _ in range(args.rounds):
            for name, fn in columns.items():
                fn()  # warm
                best[name] = min(best[name], best_ms(fn, reps))
        unit = best["pass"]
        print(f"| {numel:,} | {unit:.2f} | {best['fp16']:.2f} | {best['int8 send']:.2f} | "
              f"{best['int8 receive']:.2f} | {best['fp16'] / unit:.2f}x | "
              f"{(best['int8 send'] + best['int8 receive']) / unit:.2f}x |")


if __name__ == "__main__":
    main()
