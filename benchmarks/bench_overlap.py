#!/usr/bin/env python
"""How much of TopKEF's communication starts while backward still runs, with buckets and per tensor: 2 (or more)
Horovod workers (Gloo, loopback, one thread each) train an MLP of ``--depth`` layers of ``--width`` (24 x 1024:
25M parameters in 48 tensors, ResNet-50's size) on random data.

    python benchmarks/bench_overlap.py
    python benchmarks/bench_overlap.py --depth 12 --width 2048 --steps 8

Per step and method: backward() (on the CPU the selection runs inside it, in Horovod's hooks), then
synchronize() (what is left of the collectives and the adding back after backward returned: the exposed part),
and every allgather TopKEF launches (time and bytes, recorded by wrapping Horovod's ``allgather_async``): the
share of the payload bytes launched before backward returned, and how long before its end the first one left.
Methods run interleaved, step by step, so that the machine's noise hits them alike; medians over the steps after
2 warm-up steps (the first runs the rank agreement checks), slowest rank.
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
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_sync import _compression  # noqa: E402  (the same methods)

METHODS = ["dense", "topk", "topk-per-tensor"]
WARMUP = 2


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import horovod.torch.mpi_ops as mpi_ops
    import torch

    hvd.init()
    torch.set_num_threads(1)
    launches: List[Tuple[float, int]] = []
    allgather_async = mpi_ops.allgather_async

    def recorded(tensor: Any, *a: Any, **kw: Any) -> Any:
        launches.append((time.perf_counter(), tensor.numel() * tensor.element_size()))
        return allgather_async(tensor, *a, **kw)

    mpi_ops.allgather_async = recorded  # TopKEF imports it from there at each launch

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: List[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)

    jobs = {}
    for method in args.methods:
        model = mlp()
        compression = _compression(method, args.ratio, args.bucket_bytes)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters(), compression=compression)
        jobs[method] = (model, opt)
    gen = torch.Generator().manual_seed(hvd.rank())
    rows: Dict[str, Dict[str, List[float]]] = {m: {"backward": [], "exposed": [], "early": [], "lead": []}
                                               for m in args.methods}

    def slowest(value: float) -> float:
        return float(hvd.allreduce(torch.tensor([value]), op=hvd.Max, name="bench_overlap.max"))

    for step in range(WARMUP + args.steps):
        x = torch.randn(args.batch, args.width, generator=gen)
        for method, (model, opt) in jobs.items():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            hvd.allreduce(torch.zeros(1), name="bench_overlap.barrier")
            launches.clear()
            started = time.perf_counter()
            loss.backward()
            ended = time.perf_counter()
            opt.synchronize()
            done = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
            sent = sum(b for _, b in launches)
            early = sum(b for t, b in launches if t < ended) / sent if sent else float("nan")
            lead = ended - min(t for t, _ in launches) if launches else float("nan")
            measured = {"backward": slowest(ended - started), "exposed": slowest(done - ended),
                        "early": early, "lead": lead}
            if step >= WARMUP:
                for key, value in measured.items():
                    rows[method][key].append(value)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"rows": rows, "workers": hvd.size(),
                                      "numel": sum(p.numel() for p in jobs[args.methods[0]][0].parameters()),
                                      "tensors": len(list(jobs[args.methods[0]][0].parameters()))}), flush=True)
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=METHODS,
                        choices=METHODS + ["topk-allgather", "topk-allgather-per-tensor", "topk-sparse_allreduce",
                                           "topk-sparse_allreduce-per-tensor"])
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-bytes", type=int, default=25 * 1024 * 1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = ["horovodrun", "-np", str(args.workers), "-H", f"localhost:{args.workers}", "--gloo", sys.executable,
               __file__, "--worker", "--ratio", str(args.ratio), "--depth", str(args.depth), "--width",
               str(args.width), "--batch", str(args.batch), "--bucket-bytes", str(args.bucket_bytes), "--steps",
               str(args.steps), "--methods", *args.methods]
    out = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    lines = [line for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode != 0 or not lines:
        sys.exit(f"worker job failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(lines[0].split("RESULT ", 1)[1])
    import torch

    print(f"# torch {torch.__version__}, {result['workers']} workers (Gloo, loopback), 1 thread each, MLP "
          f"{args.depth} x {args.width} ({result['numel'] / 1e6:.1f}M parameters, {result['tensors']} tensors), "
          f"batch {args.batch}, ratio {args.ratio}, median of {args.steps} steps; {time.strftime('%Y-%m-%d')}")
    print("| method | backward() ms | synchronize() after it ms | step ms | payload bytes launched during backward "
          "| first launch before backward's end ms |")
    print("|---|---|---|---|---|---|")
    for method, row in result["rows"].items():
        backward, exposed = statistics.median(row["backward"]), statistics.median(row["exposed"])
        early = [v for v in row["early"] if v == v]
        lead = [v for v in row["lead"] if v == v]
        print(f"| {method} | {backward * 1e3:.1f} | {exposed * 1e3:.1f} | {(backward + exposed) * 1e3:.1f} | "
              + (f"{statistics.median(early):.0%}" if early else "–") + " | "
              + (f"{statistics.median(lead) * 1e3:.1f}" if lead else "–") + " |")


if __name__ == "__main__":
    main()
