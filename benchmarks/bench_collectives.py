#!/usr/bin/env python
"""What one allreduce of a given size costs through Horovod and through torch.distributed (Gloo) on the same link,
side by side in one job: how much of a step's exposed communication is the collective library's, not the bytes'.

Horovod reduces over MPI when mpirun starts it and over Gloo when ``horovodrun --gloo`` does; the test bed starts
either (``scripts/testbed.sh run N [--gloo]``). Per size: one tensor alone, and the same bytes as 40 tensors in
flight together (as a step's per-tensor allreduces are: Horovod fuses them, torch.distributed runs them in turn).
A barrier before each timed call, the median of 6 after 2, rank 0's clock.

    scripts/testbed.sh run 4 --rate 100mbit -- .venv/bin/python benchmarks/bench_collectives.py
    scripts/testbed.sh run 4 --rate 100mbit --gloo -- .venv/bin/python benchmarks/bench_collectives.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, List


def median_ms(run: Callable[[], None], barrier: Callable[[], None], rounds: int = 8, skip: int = 2) -> float:
    times: List[float] = []
    for _ in range(rounds):
        barrier()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[skip:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", nargs="+", type=float, default=[0.004, 0.87, 1.75, 3.5],
                        help="sizes in MiB of float32 (0.87 / 1.75 / 3.5: the small transformer's gradients in "
                             "int8, fp16, float32)")
    parser.add_argument("--master", default="10.77.0.1:29533", help="torch.distributed's rendezvous (host:port)")
    parser.add_argument("--iface", default="eth0", help="the interface torch.distributed's Gloo uses")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.iface)

    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    hvd.init()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=hvd.rank(), world_size=hvd.size())

    def barrier() -> None:
        hvd.allreduce(torch.zeros(1), name="collectives.barrier")
        dist.barrier()

    rows = []
    for mib in args.mib:
        numel = max(1, int(mib * 2 ** 20 / 4))
        whole = torch.randn(numel)
        parts = [torch.randn(numel // 40 + 1) for _ in range(40)]

        def hvd_parts() -> None:
            handles = [hvd.allreduce_async(p, name=f"collectives.{numel}.{i}") for i, p in enumerate(parts)]
            for handle in handles:
                hvd.synchronize(handle)

        def dist_parts() -> None:
            for work in [dist.all_reduce(p, async_op=True) for p in parts]:
                work.wait()

        rows.append((mib, median_ms(lambda: hvd.allreduce(whole, name=f"collectives.{numel}"), barrier),
                     median_ms(lambda: dist.all_reduce(whole), barrier), median_ms(hvd_parts, barrier),
                     median_ms(dist_parts, barrier)))
    if hvd.rank() == 0:
        print(f"{hvd.size()} workers, Horovod over {'Gloo' if hvd.gloo_enabled() and not hvd.mpi_enabled() else 'MPI'}")
        print("| MiB | Horovod, one tensor (ms) | torch.distributed, one (ms) | Horovod, 40 tensors (ms) | "
              "torch.distributed, 40 (ms) |")
        print("|---|---|---|---|---|")
        for mib, h1, d1, h40, d40 in rows:
            print(f"| {mib:g} | {h1:.1f} | {d1:.1f} | {h40:.1f} | {d40:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
