#!/usr/bin/env python
"""Where update mode's step goes, per rank: wall-clock timers around each phase of TopKEF(target="update").

Builds bench_e2e.py's model and compressor for METHOD (its method names), trains --warmup steps, then times --steps
steps and prints, for every rank, the milliseconds per step of: forward + backward, ``step()``, and inside it the
non-finite agreement (the count and its allreduce, which carries the computed second moment's sums), the local
step (Adam; the sketches' own allreduce only where the gradients changed after synchronize()), the exchange and
apply, and the waits of update mode's small allreduces. Run on the test bed (one worker per host):

    scripts/testbed.sh run 4 --rate 100mbit -- python benchmarks/profile_update_step.py update-compact-calibrated0.023
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Dict

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(cls: type, name: str, label: str, totals: Dict[str, float]) -> None:
    """Replace ``cls.name`` by a wrapper that adds its wall-clock time to ``totals[label]``."""
    original: Callable = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", help="a bench_e2e.py method in update mode, e.g. update-compact-calibrated0.023")
    parser.add_argument("--model", default="gptlm")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()

    import horovod.torch as hvd
    import torch

    import bench_e2e
    from horovod_topk.torch import local_updates, update_mode

    totals: Dict[str, float] = {}
    timed(update_mode.UpdateStep, "_agree_finite", "of it: non-finite agreement (count + allreduce)", totals)
    timed(local_updates.LocalUpdates, "compute", "of it: local step", totals)
    timed(update_mode.UpdateStep, "_exchange_and_apply", "of it: exchange and apply", totals)
    timed(update_mode.UpdateStep, "_allreduce_sum", "of all: waits of the small allreduces", totals)
    hvd.init()
    torch.set_num_threads(1)
    model, make_opt, batch, loss_fn = bench_e2e.build_model(args.model)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   compression=bench_e2e.compression_for(args.method))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    step_number = 0

    def step() -> None:
        nonlocal step_number
        b = batch(step_number)
        step_number += 1
        opt.zero_grad()
        start = time.perf_counter()
        loss_fn(model, b).backward()
        middle = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        totals["forward + backward"] = totals.get("forward + backward", 0.0) + middle - start
        totals["step()"] = totals.get("step()", 0.0) + end - middle

    for _ in range(args.warmup):
        step()
    totals.clear()
    hvd.allreduce(torch.zeros(1), name="profile.start")
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = (time.perf_counter() - start) / args.steps
    rows = hvd.allgather_object({label: 1e3 * value / args.steps for label, value in totals.items()})
    if hvd.rank() == 0:
        order = ["forward + backward", "step()", "of it: non-finite agreement (count + allreduce)", "of it: local step",
                 "of it: exchange and apply", "of all: waits of the small allreduces"]
        print(f"{args.method}, {args.model}: step {1e3 * elapsed:.1f} ms (rank 0), {hvd.size()} workers")
        print("| phase | " + " | ".join(f"rank {r}" for r in range(len(rows))) + " |")
        print("|---|" + "---|" * len(rows))
        for label in order:
            print(f"| {label} | " + " | ".join(f"{row.get(label, 0.0):.1f}" for row in rows) + " |")


if __name__ == "__main__":
    main()
