#!/usr/bin/env python
"""Measurements of TopKEF under faults and long runs, on real Horovod workers (digits CNN of examples/).

Run each under Horovod with 2 workers; rank 0 prints a table:

    horovodrun -np 2 -H localhost:2 python benchmarks/fault_study.py spike     # a 100x gradient spike on one rank
    horovodrun -np 2 -H localhost:2 python benchmarks/fault_study.py noniid    # per-worker residual norms, IID vs not
    horovodrun -np 2 -H localhost:2 python benchmarks/fault_study.py soak --steps 10000   # memory and time drift

spike   at step S0 rank 0's gradient is scaled to 100x its mean norm over its previous 50 steps, for one step. For dense Horovod and for TopKEF with the
        options given, it prints the residual norm relative to its level before the spike, how many steps it took
        to come back within 2x of that level, the ratio residual norm / gradient norm, and the test accuracy just
        before, 20 and 100 steps after the spike and at the end.
noniid  each worker trains on its own half of the classes (digits 0-4 / 5-9) or on an IID shard; every 100 steps
        each worker's residual norm and its ratio to that worker's gradient norm.
soak    a long run: RSS, registry size and the mean step time over the first and last 10% of the steps, and the
        sizes the registry had during the run (a collective name collision would make Horovod fail the step).
"""
from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from pathlib import Path
from typing import Dict, List

import horovod.torch as hvd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from digits_data import load_split  # noqa: E402
from digits_torch import DigitsCNN  # noqa: E402

from horovod_topk.torch import TopKEF  # noqa: E402


def _data(seed: int, noniid: bool):
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_split(seed, 0, 1))
    if noniid:
        mine = (y_train < 5) if hvd.rank() == 0 else (y_train >= 5)
        x_train, y_train = x_train[mine], y_train[mine]
    else:
        x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    return x_train[:, None], y_train, x_test[:, None], y_test


class Run:
    """One training run of the digits CNN, step by step, with the gradient norm of each step recorded."""

    def __init__(self, compression, seed: int = 0, noniid: bool = False, batch: int = 32, lr: float = 0.05):
        torch.manual_seed(seed)
        self.x, self.y, self.x_test, self.y_test = _data(seed, noniid)
        self.model = DigitsCNN()
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.compression = compression
        self.opt = hvd.DistributedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=lr * hvd.size(), momentum=0.9),
            named_parameters=self.model.named_parameters(), compression=compression)
        self.batch = batch
        self.gen = torch.Generator().manual_seed(seed * 100 + hvd.rank())
        self.order = torch.empty(0, dtype=torch.long)
        self.grad_sq = 0.0
        for p in self.model.parameters():  # this rank's own gradient, before Horovod's hooks reduce it
            p.register_hook(self._record)

    def _record(self, grad: torch.Tensor) -> torch.Tensor:
        self.grad_sq += float(grad.double().pow(2).sum())
        return grad

    def step(self, spike_norm: float = 0.0) -> float:
        """One step; with ``spike_norm`` > 0 this rank's gradient is scaled to have that L2 norm (a spike)."""
        if len(self.order) < self.batch:
            self.order = torch.randperm(len(self.x), generator=self.gen)
        idx, self.order = self.order[: self.batch], self.order[self.batch:]
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx])
        if spike_norm > 0:  # measure the gradient first (autograd.grad does not trigger Horovod's hooks)
            grads = torch.autograd.grad(loss, list(self.model.parameters()), retain_graph=True)
            loss = loss * (spike_norm / max(1e-12, math.sqrt(sum(float(g.pow(2).sum()) for g in grads))))
        self.grad_sq = 0.0
        loss.backward()
        self.opt.step()
        return math.sqrt(self.grad_sq)

    def residual_norm(self) -> float:
        return self.compression.stats()["residual_norm"] if isinstance(self.compression, TopKEF) else 0.0

    def accuracy(self) -> float:
        with torch.no_grad():
            return (self.model(self.x_test).argmax(1) == self.y_test).float().mean().item()


def _options(text: str) -> Dict[str, object]:
    """"ratio=0.01,value_dtype=float16" -> {"ratio": 0.01, "value_dtype": "float16"} (numbers become numbers)"""
    out: Dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        for kind in (int, float, str):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                continue
    return out


def spike(args: argparse.Namespace) -> None:
    variants = {"dense": None, **{f"topk({v})": _options(v) for v in args.topk}}
    rows = []
    for label, options in variants.items():
        compression = hvd.Compression.none if options is None else TopKEF(**options)
        run = Run(compression, seed=args.seed)
        before_norms: List[float] = []
        ratio_before: List[float] = []
        acc = {}
        peak, back_at, norms_after = 0.0, None, []
        grad_norms: List[float] = []
        for t in range(args.steps):
            spiking = t == args.spike_step and hvd.rank() == 0
            # the spike: 100x the mean gradient norm of this rank's last 50 steps
            gnorm = run.step(100.0 * sum(grad_norms[-50:]) / len(grad_norms[-50:]) if spiking else 0.0)
            grad_norms.append(gnorm)
            rnorm = run.residual_norm()
            if args.spike_step - 50 <= t < args.spike_step:
                before_norms.append(rnorm)
                ratio_before.append(rnorm / max(gnorm, 1e-12))
            if t == args.spike_step - 1:
                acc["before"] = run.accuracy()
            if t > args.spike_step:
                norms_after.append(rnorm)
            if t in (args.spike_step + 20, args.spike_step + 100):
                acc[f"+{t - args.spike_step}"] = run.accuracy()
        acc["end"] = run.accuracy()
        level = sum(before_norms) / len(before_norms) if before_norms and before_norms[0] else 0.0
        if level:
            peak = max(norms_after) / level
            back_at = next((i + 1 for i, n in enumerate(norms_after) if n <= 2 * level), None)
        rows.append((label, level, peak, back_at, sum(ratio_before) / max(1, len(ratio_before)), acc))
    if hvd.rank() == 0:
        print(f"# spike: rank 0's gradient at 100x its recent mean norm at step {args.spike_step} of {args.steps}; "
              f"rank 0's view; seed {args.seed}")
        print("| method | residual norm before | peak after / before | steps back to <= 2x before | "
              "residual/grad norm before | acc before | acc +20 | acc +100 | acc end |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, level, peak, back_at, ratio, acc in rows:
            print(f"| {label} | {level:.3g} | {peak:.1f}x | {back_at if back_at is not None else '-'} | "
                  f"{ratio:.2f} | {acc['before']:.4f} | {acc['+20']:.4f} | {acc['+100']:.4f} | {acc['end']:.4f} |")


def noniid(args: argparse.Namespace) -> None:
    table: Dict[int, List[float]] = {}
    labels = []
    for split in ("iid", "noniid"):
        run = Run(TopKEF(**_options(args.topk[0])), seed=args.seed, noniid=split == "noniid")
        for t in range(args.steps):
            gnorm = run.step()
            if (t + 1) % args.every == 0:
                mine = torch.tensor([run.residual_norm(), run.residual_norm() / max(gnorm, 1e-12)])
                both = hvd.allgather(mine[None], name=f"noniid.{split}.{t}")
                table.setdefault(t + 1, []).extend(both.reshape(-1).tolist())
        labels += [f"{split} r0 |r|", f"{split} r0 |r|/|g|", f"{split} r1 |r|", f"{split} r1 |r|/|g|"]
        table.setdefault(-1, []).append(run.accuracy())
    if hvd.rank() == 0:
        print(f"# residual norm per worker, TopKEF({args.topk[0]}), seed {args.seed}; rank r0 trains on digits 0-4 "
              f"and r1 on 5-9 when non-IID")
        print("| step | " + " | ".join(labels) + " |")
        print("|---|" + "---|" * len(labels))
        for t in sorted(k for k in table if k > 0):
            print(f"| {t} | " + " | ".join(f"{v:.3g}" for v in table[t]) + " |")
        print(f"\ntest accuracy at the end: IID {table[-1][0]:.4f}, non-IID {table[-1][1]:.4f}")


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def soak(args: argparse.Namespace) -> None:
    compressor = TopKEF(**_options(args.topk[0]))
    run = Run(compressor, seed=args.seed)
    tenth = max(1, args.steps // 10)
    times: List[float] = []
    registry_sizes = set()
    marks = {}
    for t in range(args.steps):
        start = time.perf_counter()
        run.step()
        times.append(time.perf_counter() - start)
        if t == tenth - 1:
            marks["early"] = (_rss_mib(), len(compressor.registry))
        registry_sizes.add(len(compressor.registry))
    marks["end"] = (_rss_mib(), len(compressor.registry))
    stats = compressor.stats()
    first = sum(times[:tenth]) / tenth * 1e3
    last = sum(times[-tenth:]) / tenth * 1e3
    mine = torch.tensor([marks["early"][0], marks["end"][0], first, last,
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    both = hvd.allgather(mine[None], name="soak.summary")
    if hvd.rank() == 0:
        print(f"# soak: {args.steps} steps of the digits CNN, TopKEF({args.topk[0]}), 2 workers, seed {args.seed}")
        print("| rank | RSS after 10% (MiB) | RSS at end (MiB) | peak RSS (MiB) | step ms, first 10% | step ms, last 10% |")
        print("|---|---|---|---|---|---|")
        for r, row in enumerate(both.tolist()):
            print(f"| {r} | {row[0]:.1f} | {row[1]:.1f} | {row[4]:.1f} | {row[2]:.2f} | {row[3]:.2f} |")
        print(f"\nregistry: {marks['early'][1]} tensors after 10%, {marks['end'][1]} at the end "
              f"(sizes seen during the run: {sorted(registry_sizes)}); steps counted {stats['steps']}; "
              f"compression ratio {stats['compression_ratio']:.1f}x; test accuracy {run.accuracy():.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=["spike", "noniid", "soak"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--spike-step", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topk", nargs="+", default=["ratio=0.01"],
                        help="TopKEF options per variant, e.g. ratio=0.01 ratio=0.01,spike_guard=3")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    if args.steps is None:
        args.steps = {"spike": 900, "noniid": 900, "soak": 10_000}[args.study]
    {"spike": spike, "noniid": noniid, "soak": soak}[args.study](args)


if __name__ == "__main__":
    main()
