#!/usr/bin/env python
"""What update mode costs against gradient mode: step time and memory, 2 Horovod workers on this machine.

Update mode (TopKEF(target="update")) steps the optimizer before anything travels, so its exchange cannot overlap
backward the way gradient mode's per-tensor collectives do, and it computes an update per parameter (float32) each
step. This prints, side by side in one run (methods alternate over --rounds, each in its own `horovodrun -np 2`
job): the mean step time after warm-up, the persistent state (optimizer state + TopKEF's residuals and first
moments, counted tensor by tensor) and the peak resident memory of rank 0, for dense Horovod, TopKEF in gradient
mode, and update mode with each rank's own, the shared and the calibrated second moment (the last also with every
update in its own collectives: bucket_bytes=0). Model: an MLP of --width and --depth (4 hidden layers, ~4.2M
parameters at 1024; many small layers show what per-tensor collectives cost) trained with AdamW.

    python benchmarks/bench_update_mode.py                      # about 2 minutes
    python benchmarks/bench_update_mode.py --width 2048 --rounds 3 --steps 30
    python benchmarks/bench_update_mode.py --width 256 --depth 48 --methods gradient0.01 update-calibrated0.01 \
        update-calibrated0.01-per-tensor --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["dense", "gradient0.01", "update0.01", "update-shared0.01", "update-calibrated0.01",
           "update-calibrated0.01-per-tensor"]


def worker(method: str, width: int, depth: int, steps: int, warmup: int, bucket_bytes: Optional[int]) -> None:
    import horovod.torch as hvd
    import torch

    from horovod_topk.torch import TopKEF

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    compression = {
        "dense": hvd.Compression.none,
        "gradient0.01": TopKEF(ratio=0.01, target="gradient"),
        "update0.01": TopKEF(ratio=0.01, target="update", second_moment="local"),  # each rank's own AdamW
        "update-calibrated0.01": TopKEF(ratio=0.01, target="update", second_moment="calibrated",
                                        **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes})),
        "update-shared0.01": TopKEF(ratio=0.01, target="update", second_moment="shared"),
        # the same with every update in its own collectives (the buckets' gain is the difference)
        "update-calibrated0.01-per-tensor": TopKEF(ratio=0.01, target="update", second_moment="calibrated",
                                                   bucket_bytes=0),
    }[method]
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), compression=compression)
    gen = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(64, width, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    times = []
    for step in range(warmup + steps):
        hvd.allreduce(torch.zeros(1), name="bench.barrier")  # steps start together on both ranks
        started = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    tensors = [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    stats = getattr(compression, "stats", None)
    registry = getattr(compression, "registry", None)
    if registry is not None:
        tensors += [t for _, r in registry for t in (r.residual, r.momentum) if t is not None]
    result = {
        "method": method,
        "step_ms": 1000 * mean(times),
        "state_mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6,
        "params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bytes_per_step": (stats()["bytes_sent"] / (warmup + steps)) if callable(stats) else None,
    }
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers (2 tensors each)")
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="update-calibrated0.01's bucket_bytes (default: TopKEF's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.depth, args.steps, args.warmup, args.bucket_bytes)
        return
    runs: dict = {m: [] for m in args.methods}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(args.rounds):
        for method in args.methods:
            out = subprocess.run(
                ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, __file__, "--worker", method,
                 "--width", str(args.width), "--depth", str(args.depth),
                 *(["--bucket-bytes", str(args.bucket_bytes)] if args.bucket_bytes is not None else []), "--steps", str(args.steps), "--warmup", str(args.warmup)],
                capture_output=True, text=True, env=env, check=True, stdin=subprocess.DEVNULL).stdout
            line = next(l for l in out.splitlines() if "RESULT " in l)
            runs[method].append(json.loads(line.split("RESULT ", 1)[1]))
    base = mean(r["step_ms"] for r in runs["gradient0.01"]) if "gradient0.01" in runs else None
    first = runs[args.methods[0]][0]
    print(f"MLP width {args.width}, {args.depth} hidden layers: parameters {first['params_mb']:.1f} MB, AdamW, 2 workers (Gloo, loopback), "
          f"{args.steps} steps after {args.warmup}, {args.rounds} rounds alternating")
    print("| method | step time, ms (per round) | vs gradient mode | persistent state, MB | peak RSS rank 0, MB | "
          "bytes handed to collectives per step |")
    print("|---|---|---|---|---|---|")
    for method, rows in runs.items():
        step = mean(r["step_ms"] for r in rows)
        ratio = f"{step / base:.2f}x" if base else ""
        sent = rows[0]["bytes_per_step"]
        sent_text = f"{sent / 1e3:.0f} kB" if sent is not None else "dense"
        per_round = ", ".join(f"{r['step_ms']:.1f}" for r in rows)
        print(f"| {method} | {step:.1f} ({per_round}) | {ratio} | "
              f"{rows[0]['state_mb']:.1f} | {max(r['peak_rss_mb'] for r in rows):.0f} | {sent_text} |")


if __name__ == "__main__":
    main()
