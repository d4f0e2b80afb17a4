#!/usr/bin/env python
"""What TopKEF adds to a training step through the DDP hook, per bucket: a real backward pass over a model of the
given layer shapes, in one process (torch.distributed with world size 1: Gloo on the CPU, NCCL on a GPU), so the
collectives cost next to nothing and the difference to DDP's own allreduce is the compression's work.

    python benchmarks/bench_bucket_step.py                                   # CPU: ResNet-50 and GPT-2 small shapes
    python benchmarks/bench_bucket_step.py --device cuda --repeat 50        # GPU: grouped against member by member

Each step: a loss whose backward pass produces every parameter's gradient (sum of parameter x fixed random
tensor: autograd, DDP's hooks and buckets as in training, with compute that stays small next to the
compression's), then DDP's reduction. Timed: ``loss.backward()`` to the end of DDP's reduction (on a GPU, with
``torch.cuda.synchronize()`` after it), median of ``--repeat`` steps after 3 warm-up steps. Methods, interleaved
step by step so that the machine's noise hits them alike:
``dense`` (DDP's allreduce), ``topk`` (TopKEFState at --ratio: on a GPU the bucket's allgather members selected by one
run of the grouped kernels, torch.bucket_select), ``topk-alone`` (the same, each member selected on its own; on the
CPU the same as ``topk``: the fused kernel runs per member there). One elementwise pass (``r.add_(g)`` over every
gradient) is timed in the same steps, as the unit the CPU numbers are given in.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_compress import MODELS  # noqa: E402  (the same real layer shapes)

from horovod_topk.torch import bucket_select  # noqa: E402
from horovod_topk.torch.ddp import TopKEFState, topk_ef_hook  # noqa: E402

METHODS = ["dense", "topk", "topk-alone"]


class Shapes(torch.nn.Module):
    """Parameters of the given shapes; ``forward`` makes a scalar whose gradient is a fixed tensor per parameter."""

    def __init__(self, shapes: List[tuple], device: torch.device) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=gen).to(device) * 0.01) for s in shapes])
        self.directions = [torch.randn(s, generator=gen).to(device) for s in shapes]

    def forward(self) -> torch.Tensor:
        return sum((w * d).sum() for w, d in zip(self.weights, self.directions))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model_name: str, device: torch.device, ratio: float, repeat: int, methods: List[str]) -> Dict[str, float]:
    shapes = MODELS[model_name]()
    models: Dict[str, DDP] = {}
    for method in methods:
        module = Shapes(shapes, device)
        ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
        if method != "dense":
            ddp.register_comm_hook(TopKEFState(ratio=ratio, named_parameters=module.named_parameters()),
                                   topk_ef_hook)
        models[method] = ddp
    residuals = [torch.zeros(s, device=device) for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    groupable = bucket_select.groupable
    times: Dict[str, List[float]] = {m: [] for m in methods + ["elementwise"]}

    def elementwise() -> None:
        for r, g in zip(residuals, grads):
            r.add_(g)

    runs: Dict[str, Callable[[], None]] = {"elementwise": elementwise}
    for method, ddp in models.items():
        def step(ddp: DDP = ddp, alone: bool = method == "topk-alone") -> None:
            bucket_select.groupable = (lambda *args: False) if alone else groupable
            try:
                ddp.zero_grad(set_to_none=False)
                ddp().backward()
            finally:
                bucket_select.groupable = groupable
        runs[method] = step
    for i in range(3 + repeat):
        for name, fn in runs.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if i >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50-25.6M", "gpt2-small-124M"], choices=sorted(MODELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    methods = args.methods or (METHODS if device.type == "cuda" else ["dense", "topk"])
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
              f", ratio {args.ratio}, median of {args.repeat} steps ({time.strftime('%Y-%m-%d')})")
        print("| model | " + " | ".join(f"{m} ms" for m in methods) + " | elementwise ms | "
              + " | ".join(f"{m} - dense ms" for m in methods if m != "dense") + " |")
        print("|---" * (1 + 2 * len(methods)) + "|")
        for name in args.models:
            r = measure(name, device, args.ratio, args.repeat, methods)
            over = [f"{r[m] - r['dense']:.2f}" + (f" ({(r[m] - r['dense']) / r['elementwise']:.2f}x elem.)"
                                                   if device.type == "cpu" else "")
                    for m in methods if m != "dense"]
            print(f"| {name} | " + " | ".join(f"{r[m]:.2f}" for m in methods) + f" | {r['elementwise']:.2f} | "
                  + " | ".join(over) + " |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
