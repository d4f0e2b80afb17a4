#!/usr/bin/env python
"""What ``optimizer.synchronize()`` of a whole model costs on 2 (or more) Horovod workers, in units of one
elementwise pass over the model's gradients.

One ``horovodrun`` job (Gloo, loopback, one thread per worker) holds the model's parameters once and one
``hvd.DistributedOptimizer`` per method over them. Each round, for every method in turn: fresh gradients are copied
in (not timed), the ranks meet at a barrier, and ``synchronize()`` is timed (the slowest rank's time); one
elementwise pass (``r.add_(g)`` over every gradient, each rank on its own, both ranks at once after a barrier as in
``synchronize()``: the mean of ELEMENTWISE_PASSES back to back) is timed in the same round. Methods
alternate within each round, so that the machine's noise hits them alike; the table shows the median over rounds
after the warm-up rounds (first steps run the rank agreement checks and allocate residuals).

    python benchmarks/bench_sync.py                                   # ResNet-50 and GPT-2 small shapes, 2 workers
    python benchmarks/bench_sync.py --models resnet50-25.6M --rounds 7
    python benchmarks/bench_sync.py --models resnet50-25.6M --methods topk --rounds 30 --phases   # where it goes
    python benchmarks/bench_sync.py --workers 4 --models resnet50-25.6M \\
        --methods topk-allgather topk-sparse_allreduce topk-allgather-per-tensor topk-sparse_allreduce-per-tensor

Methods: ``dense`` (Horovod's allreduce), ``topk`` (TopKEF at --ratio, buckets on, exchange="auto"),
``topk-per-tensor`` (buckets off: one selection and one collective per tensor), and either of those with the
exchange forced (``topk-allgather``, ``topk-sparse_allreduce``, ``...-per-tensor``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_compress import MODELS  # noqa: E402  (the same real layer shapes)
from horovod_topk.core.buckets import DEFAULT_BUCKET_BYTES  # noqa: E402

#: One elementwise pass is timed as the mean of this many back to back, after a barrier: the ranks leave a barrier
#: up to a few ms apart, and over a single ~10 ms pass that decided whether the two ranks' passes shared the memory
#: (~13 ms each) or not (~8 ms), which moved the unit by 1.6x between runs.
ELEMENTWISE_PASSES = 4

METHODS = ["dense", "topk", "topk-per-tensor", "topk-allgather", "topk-allgather-per-tensor",
           "topk-sparse_allreduce", "topk-sparse_allreduce-per-tensor"]


def _compression(method: str, ratio: float, bucket_bytes: int):
    import horovod.torch as hvd
    from horovod_topk.torch import TopKEF

    if method == "dense":
        return hvd.Compression.none
    options: Dict[str, object] = {"ratio": ratio, "bucket_bytes": bucket_bytes}
    name = method[len("topk"):]
    if name.endswith("-per-tensor"):
        options["bucket_bytes"] = 0
        name = name[: -len("-per-tensor")]
    if name:
        options["exchange"] = name.lstrip("-")
    return TopKEF(**options)


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    from phase_timer import PhaseTimer, summary

    timer = PhaseTimer()
    if args.phases:
        timer.install()
    hvd.init()
    torch.set_num_threads(1)
    shapes = MODELS[args.model]()
    gen = torch.Generator().manual_seed(1 + hvd.rank())
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizers = {}
    for method in args.methods:
        compression = _compression(method, args.ratio, args.bucket_bytes)
        optimizers[method] = (hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named,
                                                       compression=compression), compression)
    residuals = [torch.zeros_like(g) for g in grads]
    times: Dict[str, List[float]] = {m: [] for m in args.methods}
    phases: Dict[str, List[Dict[str, float]]] = {m: [] for m in args.methods}
    elementwise: List[float] = []

    def slowest(seconds: float) -> float:
        return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="bench_sync.max"))

    for round_ in range(args.warmup + args.rounds):
        for method, (opt, _) in optimizers.items():
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            hvd.allreduce(torch.zeros(1), name="bench_sync.barrier")
            started = time.perf_counter()
            opt.synchronize()
            took = slowest(time.perf_counter() - started)
            rows = timer.take()
            if round_ >= args.warmup:
                times[method].append(took)
                phases[method].extend(rows)
        hvd.allreduce(torch.zeros(1), name="bench_sync.barrier")  # both ranks' passes share the memory, as in sync
        started = time.perf_counter()
        for _ in range(ELEMENTWISE_PASSES):
            for r, g in zip(residuals, grads):
                r.add_(g)
        took = slowest(time.perf_counter() - started) / ELEMENTWISE_PASSES
        if round_ >= args.warmup:
            elementwise.append(took)
    if hvd.rank() == 0:
        stats = {m: c.stats() for m, (_, c) in optimizers.items() if hasattr(c, "stats")}
        steps = args.warmup + args.rounds
        print("RESULT " + json.dumps({
            "model": args.model, "workers": hvd.size(), "ratio": args.ratio,
            "tensors": len(shapes), "numel": sum(g.numel() for g in grads),
            "elementwise_ms": [1000 * t for t in elementwise],
            "sync_ms": {m: [1000 * t for t in ts] for m, ts in times.items()},
            "bytes_per_step": {m: s["bytes_sent"] / steps for m, s in stats.items()},
            "buckets": {m: s.get("buckets") for m, s in stats.items()},
            "exchanges": {m: s["exchanges"] for m, s in stats.items()},
            "phases_rank0": {m: summary(rows) for m, rows in phases.items() if rows},
        }), flush=True)
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50-25.6M", "gpt2-small-124M"], choices=list(MODELS))
    parser.add_argument("--methods", nargs="+", default=["dense", "topk", "topk-per-tensor"], choices=METHODS)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES,
                        help="TopKEF's bucket_bytes for the bucketed methods (default: its own, 25 MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--phases", action="store_true",
                        help="also time rank 0's synchronize() by phase (phase_timer.py): selection kernels, adding "
                             "back, Horovod's waits, the rest")
    parser.add_argument("--json", help="also write the raw rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    rows = []
    for model in args.models:
        command = ["horovodrun", "-np", str(args.workers), "-H", f"localhost:{args.workers}", "--gloo",
                   sys.executable, __file__, "--worker", "--model", model, "--ratio", str(args.ratio),
                   "--bucket-bytes", str(args.bucket_bytes),
                   "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--methods", *args.methods,
                   *(["--phases"] if args.phases else [])]
        out = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        lines = [l for l in out.stdout.splitlines() if "RESULT " in l]
        if out.returncode != 0 or not lines:
            sys.exit(f"worker job failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows.append(json.loads(lines[0].split("RESULT ", 1)[1]))
    import torch

    print(f"# torch {torch.__version__}, {args.workers} workers (Gloo, loopback), 1 thread each, ratio "
          f"{args.ratio}, median of {args.rounds} rounds after {args.warmup}; ms; {time.strftime('%Y-%m-%d')}")
    print("| model (tensors) | method | synchronize() | elementwise pass | synchronize / elementwise | "
          "bytes handed to collectives per step | collectives |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        unit = statistics.median(row["elementwise_ms"])
        for method, ts in row["sync_ms"].items():
            sync = statistics.median(ts)
            sent = row["bytes_per_step"].get(method)
            sent_text = f"{sent / 1e6:.2f} MB" if sent is not None else "dense"
            buckets = row["buckets"].get(method)
            how = (f"{buckets['collectives']} bucket(s) of {buckets['tensors']} tensors" if buckets
                   else ", ".join(f"{n} {e}" for e, n in (row["exchanges"].get(method) or {}).items()) or "Horovod")
            print(f"| {row['model']} ({row['tensors']}) | {method} | {sync:.1f} | {unit:.1f} | {sync / unit:.2f}x | "
                  f"{sent_text} | {how} |")
    if args.phases:
        print("\nRank 0's synchronize() by phase (medians over rounds, ms; phase_timer.py):")
        print("| model | method | synchronize() | selection kernels | adding back | Horovod's waits | rest (Python) |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            for method, p in row["phases_rank0"].items():
                print(f"| {row['model']} | {method} | {p['synchronize']:.1f} | {p['select']:.1f} | "
                      f"{p['add back']:.1f} | {p['wait']:.1f} | {p['rest']:.1f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
