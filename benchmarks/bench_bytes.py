#!/usr/bin/env python
"""Bytes per worker per step: dense, fp16, TopKEF allgather and TopKEF sparse_allreduce, measured on the test bed
and predicted by the cost model of horovod_topk.core.exchange.

Measured: scripts/testbed.sh runs P workers on P network-namespace hosts (the real mpirun launch path); each
worker trains the MLP of benchmarks/bench_e2e.py (2.1M parameters; --model textcnn: embedding + convolutions) a few
steps per method and reads its host link's tx counter (bytes sent, which include TCP/IP headers and Horovod's negotiation) around them. Predicted: the sum
over the model's tensors of core.exchange.exchange_nbytes for the route each tensor takes (dense tensors: a ring
allreduce). Timing is not measured: only bytes.

    python benchmarks/bench_bytes.py --workers 2 4 8            # needs root: measured table (+ model)
    python benchmarks/bench_bytes.py --model-only --plot docs/bytes_vs_workers.png   # model table to P = 1024
    python benchmarks/bench_bytes.py --model textcnn --workers 2 4 8 --plot docs/bytes_vs_workers_textcnn.png
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
METHODS = ["dense", "fp16", "allgather", "sparse_allreduce"]
RATIO = 0.01
MODELS = ["mlp", "textcnn"]


def build_model(name: str):
    """``mlp``: the bench_e2e MLP (512-1024-1024-512-10 linear layers, 2.1M parameters). ``textcnn``: a model with
    an embedding and convolution weights, whose Top-K entries cluster (the embedding's gradient lives only in the
    rows of the tokens seen; conv filters differ in scale): an 8192 x 128 token embedding, three 1-D convolutions
    (128->256->256->256, width 5), max-pooling over time and a 256 x 10 head; 1.9M parameters."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512),
                             nn.ReLU(), nn.Linear(512, 10))

    class TextCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8192, 128)
            self.convs = nn.Sequential(nn.Conv1d(128, 256, 5, padding=2), nn.ReLU(), nn.Conv1d(256, 256, 5, padding=2),
                                       nn.ReLU(), nn.Conv1d(256, 256, 5, padding=2), nn.ReLU())
            self.head = nn.Linear(256, 10)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.convs(self.embed(tokens).transpose(1, 2)).amax(dim=2))

    return TextCNN()


def batch_for(name: str, gen):
    import torch

    if name == "mlp":
        return torch.randn(32, 512, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    # Zipf-like token frequencies: a few hundred tokens make most of a batch, as in text
    tokens = (-600.0 * torch.rand(32, 64, generator=gen).log()).long().clamp(max=8191)
    return tokens, torch.randint(0, 10, (32,), generator=gen)


def tensor_sizes(name: str) -> List[int]:
    return [p.numel() for p in build_model(name).parameters()]


def predicted(method: str, world_size: int, model: str = "mlp") -> Tuple[float, List[Tuple[int, str, float]]]:
    """(bytes per worker per step, per tensor (numel, route, bytes)) of ``method`` on ``model``."""
    from horovod_topk.core import TopKConfig, plan_tensor
    from horovod_topk.core.exchange import dense_nbytes, exchange_nbytes

    rows = []
    for numel in tensor_sizes(model):
        if method in ("dense", "fp16"):
            rows.append((numel, method, dense_nbytes(world_size, numel, 2 if method == "fp16" else 4)))
            continue
        plan = plan_tensor("w", numel, True, TopKConfig(ratio=RATIO, exchange=method), world_size=world_size,
                           sparse_available=True)
        k = plan.k or 0
        rows.append((numel, plan.exchange, exchange_nbytes(plan.exchange, world_size, numel, k, 4, 4)))
    return sum(r[2] for r in rows), rows


def worker(steps: int, model_name: str) -> None:
    import horovod.torch as hvd
    import torch

    from horovod_topk.torch import TopKEF

    hvd.init()
    counter = Path("/sys/class/net/eth0/statistics/tx_bytes")
    for method in METHODS:
        model = build_model(model_name)
        compression = {"dense": hvd.Compression.none, "fp16": hvd.Compression.fp16}.get(method)
        if compression is None:
            compression = TopKEF(ratio=RATIO, exchange=method)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=compression)
        gen = torch.Generator().manual_seed(hvd.rank())

        def step() -> None:
            opt.zero_grad()
            x, y = batch_for(model_name, gen)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step()  # first step: agreement check and Horovod's negotiation of new names
        hvd.allreduce(torch.zeros(1), name=f"bytes.start.{method}")
        tx0 = int(counter.read_text())
        for _ in range(steps):
            step()
        tx = (int(counter.read_text()) - tx0) / steps
        hvd.allreduce(torch.zeros(1), name=f"bytes.end.{method}")
        per_host = hvd.allgather_object(tx)
        exchange = getattr(compression, "_sparse_allreduce", None)
        if exchange is not None and hvd.rank() == 0:  # how often phase 2 did not wait for synchronize()
            print(f"PHASE2 early={exchange.phase2_started_early} "
                  f"in_synchronize={exchange.phase2_started_in_synchronize}", flush=True)
        if hvd.rank() == 0:
            mean = sum(per_host) / len(per_host)
            print(f"BYTES method={method} P={hvd.size()} tx_per_step_mean={mean:.0f} "
                  f"tx_per_step_max={max(per_host):.0f}", flush=True)


def measure(world_sizes: List[int], steps: int, model: str) -> Dict[Tuple[int, str], float]:
    results = {}
    for p in world_sizes:
        cmd = [str(ROOT / "scripts" / "testbed.sh"), "run", str(p), "--", sys.executable,
               str(Path(__file__).resolve()), "--worker", "--steps", str(steps), "--model", model]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        found = re.findall(r"BYTES method=(\S+) P=(\d+) tx_per_step_mean=(\d+)", out.stdout)
        if out.returncode != 0 or len(found) != len(METHODS):
            sys.exit(f"P={p} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        for method, _, tx in found:
            results[(p, method)] = float(tx)
    return results


def model_table(world_sizes: List[int], model: str) -> None:
    print("| P | " + " | ".join(METHODS) + " | sparse_allreduce / (2.2 k 8), largest tensor |")
    print("|---|" + "---|" * (len(METHODS) + 1))
    for p in world_sizes:
        cells = [f"{predicted(m, p, model)[0] / 1e6:.3f} MB" for m in METHODS]
        _, rows = predicted("sparse_allreduce", p, model)
        numel, route, nbytes = max(rows, key=lambda r: r[0])
        k = -(-int(RATIO * numel * 1e9) // int(1e9))
        cells.append(f"{nbytes / (2.2 * k * 8):.3f} ({route})")
        print(f"| {p} | " + " | ".join(cells) + " |")


def plot(path: str, measured: Dict[Tuple[int, str], float], model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = [2 ** i for i in range(1, 11)]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method in METHODS:
        line, = ax.plot(ps, [predicted(method, p, model)[0] / 1e6 for p in ps], label=f"{method} (model)")
        points = [(p, tx / 1e6) for (p, m), tx in sorted(measured.items()) if m == method]
        if points:
            ax.plot(*zip(*points), "o", color=line.get_color(), label=f"{method} (test bed)")
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xlabel("workers P"), ax.set_ylabel("MB sent per worker per step")
    params = sum(tensor_sizes(model)) / 1e6
    ax.set_title(f"{model} ({params:.1f}M parameters), ratio {RATIO} (exchange forced; auto takes the cheapest)")
    ax.legend(fontsize=7)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model-only", action="store_true")
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "bytes_vs_workers.png"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.model)
        return
    measured: Dict[Tuple[int, str], float] = {}
    if not args.model_only:
        if os.geteuid() != 0:
            sys.exit("bench_bytes needs root for the network namespaces of scripts/testbed.sh")
        measured = measure(args.workers, args.steps, args.model)
        print("| P | method | measured tx per host per step | model | measured / model |")
        print("|---|---|---|---|---|")
        for (p, method), tx in measured.items():
            model = predicted(method, p, args.model)[0]
            print(f"| {p} | {method} | {tx / 1e6:.3f} MB | {model / 1e6:.3f} MB | {tx / model:.2f} |")
        print()
    model_table([2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], args.model)
    if args.plot:
        plot(args.plot, measured, args.model)


if __name__ == "__main__":
    main()
