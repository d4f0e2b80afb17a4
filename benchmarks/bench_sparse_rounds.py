#!/usr/bin/env python
"""The sparse allreduce's arithmetic (torch.sparse_rounds) per step of a whole model, one bucket against one
member at a time, in units of one elementwise pass over the model's gradients.

One process, one thread, on the CPU (or ``--device cuda``); P ranks are simulated: every rank's payload is a
random selection of k = ratio * N distinct entries per tensor, and the alltoall and allgather are done by hand
between the ranks' rounds (not timed). What is timed is one rank's work around the two collectives: sorting its
entries into per-owner blocks (phase 1), summing and keeping what it owns (phase 2), and writing the averaged
gradient and returning the unkept entries to the residual (phase 3). ``bucket`` runs the whole model as one
bucket (every phase a fixed number of operations); ``per tensor`` runs each tensor as a bucket of one (what
``bucket_bytes=0`` does). Best of --repeat, the two interleaved.

    python benchmarks/bench_sparse_rounds.py                          # ResNet-50 shapes, P = 4 and 8
    python benchmarks/bench_sparse_rounds.py --models gpt2-small-124M --workers 4
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from bench_compress import MODELS  # noqa: E402  (the same real layer shapes)
from horovod_topk.core.payload import PayloadLayout  # noqa: E402
from horovod_topk.torch.exchange import ExchangeRequest  # noqa: E402
from horovod_topk.torch.sparse_rounds import SparseRounds  # noqa: E402


class _Record:
    bytes_sent = 0


def _requests(shapes: List[tuple], ratio: float, world_size: int, rank: int, device: str) -> List[ExchangeRequest]:
    gen = torch.Generator().manual_seed(rank)
    out = []
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        k = max(1, int(numel * ratio))
        layout = PayloadLayout(k, 4)
        payload = torch.zeros(layout.nbytes, dtype=torch.uint8)
        payload[: 4 * k].view(torch.int32).copy_(torch.sort(torch.randperm(numel, generator=gen)[:k]).values)
        payload[layout.values_offset: layout.values_offset + 4 * k].view(torch.float32).copy_(
            torch.randn(k, generator=gen))
        out.append(ExchangeRequest(f"t{i}", payload.to(device), layout, torch.float32,
                                   torch.zeros(numel, device=device), (numel,), 1.0 / world_size, world_size, None,
                                   None, torch.zeros(numel, device=device), _Record()))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step_ms(buckets: List[List[List[ExchangeRequest]]], device: str) -> float:
    """One step of rank 0 over ``buckets`` (per bucket: every rank's requests), its three phases timed."""
    P = len(buckets[0])
    spent = 0.0
    for ranks in buckets:
        _sync(device)
        start = time.perf_counter()
        mine = SparseRounds(ranks[0])
        _sync(device)
        spent += time.perf_counter() - start
        others = [SparseRounds(reqs) for reqs in ranks[1:]]
        rounds = [mine, *others]
        received = [torch.cat([rounds[s].send[r] for s in range(P)]) for r in range(P)]
        _sync(device)
        start = time.perf_counter()
        owned = mine.owned(received[0])
        _sync(device)
        spent += time.perf_counter() - start
        gathered = torch.cat([owned, *[rounds[r].owned(received[r]) for r in range(1, P)]])
        _sync(device)
        start = time.perf_counter()
        rows = mine.gathered_rows(gathered)
        for i in range(len(ranks[0])):
            mine.apply(i, rows)
        _sync(device)
        spent += time.perf_counter() - start
    return spent * 1e3


def _best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50-25.6M"], choices=list(MODELS))
    parser.add_argument("--workers", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# torch {torch.__version__}, {args.device}, 1 thread, ratio {args.ratio}, best of {args.repeat}, "
          f"one rank's arithmetic per step, ms; {time.strftime('%Y-%m-%d')}")
    print("| model (tensors) | P | elementwise pass | bucket | per tensor | bucket / elementwise | "
          "per tensor / elementwise |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        shapes = MODELS[model]()
        numel = sum(math.prod(s) for s in shapes)
        x = torch.randn(numel, device=args.device)
        y = torch.randn(numel, device=args.device)

        def elementwise() -> float:
            _sync(args.device)
            start = time.perf_counter()
            x.add_(y)
            _sync(args.device)
            return (time.perf_counter() - start) * 1e3

        for world_size in args.workers:
            ranks = [_requests(shapes, args.ratio, world_size, r, args.device) for r in range(world_size)]
            bucket = [ranks]
            per_tensor = [[[reqs[i]] for reqs in ranks] for i in range(len(shapes))]
            _step_ms(bucket, args.device), _step_ms(per_tensor, args.device)  # warm-up: geometry caches
            times = {"e": [], "b": [], "t": []}
            for _ in range(args.repeat):
                times["e"].append(elementwise())
                times["b"].append(_step_ms(bucket, args.device))
                times["t"].append(_step_ms(per_tensor, args.device))
            e, b, t = (min(times[key]) for key in "ebt")
            print(f"| {model} ({len(shapes)}) | {world_size} | {e:.1f} | {b:.1f} | {t:.1f} | {b / e:.2f}x | "
                  f"{t / e:.2f}x |")


if __name__ == "__main__":
    main()
