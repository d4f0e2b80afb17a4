#!/usr/bin/env python
"""What ratio="auto"'s dense and fp16 routes cost a training step against Horovod's own, side by side in one job.

Separate jobs of the same step on this shared 2-core machine differ by more than the 5% the step-time bar allows
(benchmarks/bench_e2e.py runs one 10-step job per method: the transformer's fp16 step at 1 Gbit/s took 434.0 ms in its
job and 443.9-465.4 ms stepped in turn here, the same day), so this benchmark steps one model per method in turn within
one job, a barrier before each step, and reports each method's median step (the slowest rank's) after the warm-up,
and its median backward (the slowest rank's, the gradients' hooks and what they launch included): the step up to
where the optimizer starts waiting for the exchanges.
Methods:

- ``dense``: Horovod's allreduce; ``fp16``: Horovod's ``Compression.fp16``;
- ``auto-dense``, ``auto-fp16``, ``auto-int8``, ``auto-0.01``: ``TopKEF(ratio="auto")`` holding that choice for the
  whole run: the route auto executes once it has chosen dense, fp16, int8 or that density (its planning per tensor, its error-feedback
  pass, its step stamps), without its decisions, whose window and probes would time the other methods' steps in
  between;
- ``topk0.01``: TopKEF at ratio 0.01, for reference.

``--held-bucket-bytes A B ...`` steps each ``auto-fp16`` / ``auto-int8`` method once per cap of its route's buckets
(core.buckets.HELD_BUCKET_BYTES; 0: one allreduce per tensor), labelled ``auto-fp16@256K`` etc.

Run it on the test bed's shaped links (one worker per host) or on localhost:

    scripts/testbed.sh run 4 --rate 1gbit -- .venv/bin/python benchmarks/bench_auto_routes.py --model gptlm
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_auto_routes.py --model mlp --steps 60
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

METHODS = ["dense", "fp16", "auto-dense", "auto-fp16", "auto-int8", "auto-0.01", "topk0.01"]


def hold(auto, held: str, steps: int) -> None:
    """ratio="auto"'s state ``auto`` (core.autodensity.AutoDensity) held at ``held`` ("dense", "fp16", "int8" or a
    density) for ``steps`` steps: no decision is due, so no window or probe runs."""
    from horovod_topk.core.autodensity import HALF, INT8

    held_choices = {"fp16": HALF, "int8": INT8, "dense": None}
    auto.ratio = held_choices[held] if held in held_choices else float(held)
    auto.next_decision = steps + 1


def compression_for(method: str, steps: int):
    import horovod.torch as hvd

    from horovod_topk.torch import TopKEF

    if method in ("dense", "fp16"):
        return {"dense": hvd.Compression.none, "fp16": hvd.Compression.fp16}[method]
    if method.startswith("auto-"):
        compression = TopKEF(ratio="auto", target="gradient")
        hold(compression.auto, method[len("auto-"):], steps)
        return compression
    return TopKEF(ratio=float(method[len("topk"):]), target="gradient")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gptlm", choices=["mlp", "digits", "charlm", "gptlm", "deep"])
    parser.add_argument("--methods", nargs="+", default=["dense", "fp16", "auto-dense", "auto-fp16"],
                        choices=METHODS)
    parser.add_argument("--steps", type=int, default=90, help="steps per method, warm-up included")
    parser.add_argument("--warmup", type=int, default=40, help="steps per method not counted")
    parser.add_argument("--held-bucket-bytes", type=int, nargs="+", default=None,
                        help="caps of the fp16 / int8 routes' buckets to compare (default: the library's)")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")

    import horovod.torch as hvd
    import torch

    import horovod_topk.core.buckets as core_buckets
    from horovod_topk.core.exchange import DENSE_HALF, DENSE_INT8
    import horovod_topk.torch  # noqa: F401  (wraps hvd.DistributedOptimizer before the first call looks it up)
    from bench_e2e import build_model

    hvd.init()
    torch.set_num_threads(1)
    runs = []
    labelled = []
    for method in args.methods:
        caps = args.held_bucket_bytes if method in ("auto-fp16", "auto-int8") and args.held_bucket_bytes else [None]
        labelled += [(method if cap is None else f"{method}@{cap // 1024}K", method, cap) for cap in caps]
    default_caps = dict(core_buckets.HELD_BUCKET_BYTES)
    for label, method, cap in labelled:  # one model per method: each optimizer's hooks see only its own gradients
        core_buckets.HELD_BUCKET_BYTES.update(default_caps)  # read when the optimizer is wrapped
        if cap is not None:
            core_buckets.HELD_BUCKET_BYTES[{"auto-fp16": DENSE_HALF, "auto-int8": DENSE_INT8}[method]] = cap
        model, make_opt, batch, loss_fn = build_model(args.model)
        opt = hvd.DistributedOptimizer(make_opt(model.parameters()), compression=compression_for(method, args.steps),
                                       named_parameters=[(f"{label}.{n}", p) for n, p in model.named_parameters()])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        runs.append((label, model, opt, batch, loss_fn, []))
    for step in range(args.steps):
        for method, model, opt, batch, loss_fn, times in runs:
            hvd.allreduce(torch.zeros(1), name="routes.barrier")
            started = time.perf_counter()
            opt.zero_grad()
            loss_fn(model, batch(step)).backward()
            backward = time.perf_counter() - started  # the gradients' hooks (and what they launch) included
            opt.step()
            took = time.perf_counter() - started
            times.append(hvd.allreduce(torch.tensor([took, backward]), op=hvd.Max,
                                       name=f"routes.max.{method}").tolist())
    if hvd.rank() != 0:
        return
    medians = {method: statistics.median(t[0] for t in times[args.warmup:]) for method, _, _, _, _, times in runs}
    baseline = min((medians[m] for m in ("dense", "fp16") if m in medians), default=None)
    print(f"model {args.model}, {hvd.size()} workers, {args.steps - args.warmup} steps per method after "
          f"{args.warmup}, methods in turn")
    print("| method | median step (ms) | mean (ms) | / faster of dense, fp16 | median backward (ms) |")
    print("|---|---|---|---|---|")
    for method, _, _, _, _, times in runs:
        counted = times[args.warmup:]
        ratio = f"{medians[method] / baseline:.3f}" if baseline else "–"
        backward = statistics.median(t[1] for t in counted)
        print(f"| {method} | {medians[method] * 1e3:.1f} | {statistics.mean(t[0] for t in counted) * 1e3:.1f} | "
              f"{ratio} | {backward * 1e3:.1f} |")


if __name__ == "__main__":
    main()
