"""PyTorch DDP: TopKEF's communication hook against DDP's own allreduce, the fp16 hook and the PowerSGD hook, in
the same job: bytes on the wire per step and rank, step time, and (on the language-model tasks) validation loss.

    python benchmarks/ddp_study.py --task gptlm --workers 2 --steps 400 --seeds 0 1 2 \
        --methods dense topk0.01 topkc0.027 powersgd1 --json results/ddp_gptlm.json
    python benchmarks/ddp_study.py --task mlp --workers 4 --steps 10 --methods dense fp16 topk0.01 powersgd1
    scripts/testbed.sh run 4 --rate 100mbit -- python benchmarks/ddp_study.py --task mlp --steps 10 \
        --master 10.77.0.1 --methods dense fp16 topk0.01 powersgd1       # one worker per test-bed host (root)

Methods: ``dense`` (DDP without a hook), ``fp16`` (torch's fp16_compress_hook), ``topk<ratio>`` (TopKEFState, 8-byte
entries), ``topkc<ratio>`` (TopKEFState with the compact encoding: 16-bit indices and float8 values, 3 bytes an
entry, so 0.027 costs about what 0.01 costs in 8-byte entries), ``topks<ratio>`` (the sparse allreduce for every
compressed tensor; ``topk`` lets the cost model choose), ``auto`` (TopKEFState(ratio="auto"): the density chosen
from the job's measurements; time it with ``--warmup 26`` or more, after its first decision and the check one
window later), ``auto-dense``, ``auto-fp16``, ``auto-int8`` (``ratio="auto"`` held at that choice for the whole run:
the route it executes once chosen, without its decisions), ``powersgd<rank>`` (torch's PowerSGD hook, error
feedback and warm start on, dense for the first 2 steps as its default ``start_powerSGD_iter`` requires).

Workers are real torch.distributed processes (Gloo) on this machine's loopback; the bytes are what the loopback
interface carried during the timed steps (/proc/net/dev, every rank's traffic) divided by the number of workers,
so they include Gloo's own framing, and every method is measured by the same counter. Started by mpirun (the test
bed: ``--master`` is rank 0's address), each worker counts what its own eth0 sent, averaged over the workers. Tasks: ``gptlm`` and
``charlm`` (benchmarks/lm_tasks.py: real text, the user's AdamW/Adam and schedule), ``digits`` (the demo's CNN,
SGD with momentum; the row also has the test accuracy), ``mlp`` (a 4-layer MLP of
``--width``, random data: time and bytes only). Every worker shares this machine's cores: step times are
compute-bound here and only their ratios mean something.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def sent_bytes(iface: str) -> int:
    """Bytes ``iface`` sent since it came up (in this process's network namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == iface:
            return int(rest.split()[8])
    raise RuntimeError(f"no interface {iface!r} in /proc/net/dev")


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MLPTask:
    """Random data: for time and bytes, not for loss."""

    def __init__(self, width: int) -> None:
        self.width = width

    def build(self, seed: int, steps: int) -> Tuple[nn.Module, Any, Any]:
        torch.manual_seed(seed)
        model = MLP(self.width)
        return model, torch.optim.Adam(model.parameters(), 1e-3), None

    def batch(self, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)

    @staticmethod
    def loss(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    def validate(self, model: nn.Module) -> float:
        return float("nan")


class DigitsTask:
    """The demo's digits CNN (examples/): each worker's shard of scikit-learn's digits, SGD with momentum at the
    demo's rate; ``--steps`` counts optimizer steps. Validation: cross-entropy on the held-out split (``accuracy``
    in the row too)."""

    def __init__(self, rank: int, world_size: int) -> None:
        from digits_data import load_split

        self.rank, self.world_size = rank, world_size
        self.load_split = load_split

    def build(self, seed: int, steps: int) -> Tuple[nn.Module, Any, Any]:
        from digits_model import DigitsCNN

        x, y, xt, yt = self.load_split(seed, self.rank, self.world_size)
        self.x, self.y = torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y)
        self.xt, self.yt = torch.from_numpy(xt).unsqueeze(1), torch.from_numpy(yt)
        torch.manual_seed(seed)
        model = DigitsCNN()
        return model, torch.optim.SGD(model.parameters(), lr=0.05 * self.world_size, momentum=0.9), None

    def batch(self, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.x), (32,), generator=gen)
        return self.x[idx], self.y[idx]

    @staticmethod
    def loss(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    def validate(self, model: nn.Module) -> float:
        with torch.no_grad():
            logits = model(self.xt)
            self.accuracy = float((logits.argmax(1) == self.yt).float().mean())
            return float(nn.functional.cross_entropy(logits, self.yt))


def register(method: str, ddp: nn.Module, steps: int) -> Any:
    """Install ``method``'s hook on ``ddp`` for a run of ``steps``; returns its state (or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from horovod_topk.torch.ddp import TopKEFState, topk_ef_hook

    if method == "dense":
        return None
    if method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if method == "auto":
        state = TopKEFState(ratio="auto")
    elif method.startswith("auto-"):  # auto held at one choice for the whole run (bench_auto_routes.hold)
        from bench_auto_routes import hold

        state = TopKEFState(ratio="auto", target="gradient")
        hold(state.auto, method[len("auto-"):], steps)
    elif method.startswith("topkc"):
        state = TopKEFState(ratio=float(method[5:]), index_bits=16, value_dtype="float8")
    elif method.startswith("topks"):
        state = TopKEFState(ratio=float(method[5:]), exchange="sparse_allreduce")
    elif method.startswith("topk"):
        state = TopKEFState(ratio=float(method[4:]))
    elif method.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(method[8:]),
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    else:
        raise ValueError(f"unknown method {method!r}")
    ddp.register_comm_hook(state, topk_ef_hook)
    return state


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str, iface: str = "lo") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    if args.task == "mlp":
        task: Any = MLPTask(args.width)
    elif args.task == "digits":
        task = DigitsTask(rank, world_size)
    else:
        from lm_tasks import make_task

        task = make_task(args.task)
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            model, opt, sched = task.build(seed, args.steps)
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
            state = register(method, ddp, args.steps)
            gen = torch.Generator().manual_seed(1000 * seed + rank)
            timed_from = min(args.warmup, args.steps - 1)
            evals: List[int] = []
            curve: List[float] = []
            train_seconds: List[float] = []
            training = evaluating = 0.0  # wall time of the steps alone; of the evaluations within the timed steps
            for step in range(args.steps):
                if step == timed_from:
                    dist.barrier()
                    wire, started, evaluating = sent_bytes(iface), time.perf_counter(), 0.0
                began = time.perf_counter()
                opt.zero_grad()
                task.loss(ddp, task.batch(gen)).backward()
                opt.step()
                if sched is not None:
                    sched.step()
                training += time.perf_counter() - began
                if args.eval_every and (step + 1) % args.eval_every == 0:
                    began = time.perf_counter()
                    evals.append(step + 1)
                    train_seconds.append(training)
                    curve.append(task.validate(model))
                    evaluating += time.perf_counter() - began
            dist.barrier()
            seconds, wire = time.perf_counter() - started - evaluating, sent_bytes(iface) - wire
            if iface == "lo":  # every rank's traffic: this rank's share
                wire /= world_size
            else:  # this rank's own link: the mean over ranks
                total = torch.tensor([float(wire)], dtype=torch.float64)
                dist.all_reduce(total)
                wire = float(total) / world_size
            timed = args.steps - timed_from
            row = {"method": method, "seed": seed, "ms_per_step": 1000 * seconds / timed,
                   "wire_bytes_per_step_rank": wire / timed, "valid_loss": task.validate(model),
                   "parameters": sum(p.numel() for p in model.parameters())}
            if hasattr(task, "accuracy"):
                row["accuracy"] = task.accuracy
            if evals:  # the validation loss every --eval-every steps and the training time (no evaluations) to it
                row.update(evals=evals, metric_curve=curve, train_seconds=train_seconds)
            if hasattr(state, "stats"):
                stats = state.stats()
                row["hook_compression_ratio"] = stats["compression_ratio"]
                row["exchanges"] = stats["exchanges"]
                if "auto" in stats:
                    row["auto_ratio"] = stats["auto"]["ratio"]
                    row["auto_last"] = stats["auto"]["last"]
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def table(rows: List[Dict[str, Any]], workers: int, task: str, steps: int) -> str:
    by_method: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        by_method.setdefault(row["method"], []).append(row)
    dense_bytes = statistics.mean(r["wire_bytes_per_step_rank"] for r in by_method.get("dense", rows))
    dense_loss = statistics.mean(r["valid_loss"] for r in by_method["dense"]) if "dense" in by_method else None
    lines = [f"task {task}, {workers} workers (Gloo), {steps} steps, parameters "
             f"{rows[0]['parameters']:,}",
             "| method | wire KB / step / rank | of dense | ms / step | validation loss (mean ± half-range) | vs dense |",
             "|---|---|---|---|---|---|"]
    for method, rs in by_method.items():
        kb = statistics.mean(r["wire_bytes_per_step_rank"] for r in rs) / 1e3
        ms = statistics.mean(r["ms_per_step"] for r in rs)
        losses = [r["valid_loss"] for r in rs]
        mean, half = statistics.mean(losses), (max(losses) - min(losses)) / 2
        loss = "n/a" if mean != mean else f"{mean:.4f} ± {half:.4f}"
        versus = "" if dense_loss is None or mean != mean else f"{100 * (mean / dense_loss - 1):+.1f}%"
        if "accuracy" in rs[0]:
            accuracies = [r["accuracy"] for r in rs]
            versus += (f" (accuracy {statistics.mean(accuracies):.4f} ± "
                       f"{(max(accuracies) - min(accuracies)) / 2:.4f})")
        if "auto_ratio" in rs[0]:
            method += " (chose " + ", ".join(str(r["auto_ratio"] or "dense") for r in rs) + ")"
        lines.append(f"| {method} | {kb:,.1f} | {1e3 * kb / dense_bytes:.2%} | {ms:.1f} | {loss} | {versus} |")
    return "\n".join(lines)


def target_table(rows: List[Dict[str, Any]]) -> str:
    """Time to dense's loss per method (rows with --eval-every): the target is 1.01 x the mean over seeds of dense's
    last validation loss, as benchmarks/convergence.py's; each run's time is its own training clock (evaluations
    excluded) at its first evaluation at or under the target."""
    dense = [r for r in rows if r["method"] == "dense" and r.get("metric_curve")]
    if not dense:
        return ""
    target = 1.01 * statistics.mean(r["metric_curve"][-1] for r in dense)
    lines = [f"time to 1.01 x dense's validation loss ({target:.4f}), training clock of each run",
             "| method | steps to target (per seed) | time to target (per seed) | mean ± half-range |", "|---|---|---|---|"]
    by_method: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        if row.get("metric_curve"):
            by_method.setdefault(row["method"], []).append(row)
    for method, rs in by_method.items():
        steps, times = [], []
        for r in rs:
            hit = next((i for i, loss in enumerate(r["metric_curve"]) if loss <= target), None)
            steps.append("–" if hit is None else str(r["evals"][hit]))
            times.append(None if hit is None else r["train_seconds"][hit])
        reached = [t for t in times if t is not None]
        summary = (f"{statistics.mean(reached):.1f} ± {(max(reached) - min(reached)) / 2:.1f} s"
                   if len(reached) == len(times) else f"not reached on {len(times) - len(reached)} seed(s)")
        per_seed = ", ".join("–" if t is None else f"{t:.1f}" for t in times)
        lines.append(f"| {method} | {', '.join(steps)} | {per_seed} s | {summary} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="gptlm", choices=["gptlm", "charlm", "digits", "mlp"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones start")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--width", type=int, default=1024, help="MLP width (--task mlp)")
    parser.add_argument("--methods", nargs="+", default=["dense", "fp16", "topk0.01", "powersgd1"])
    parser.add_argument("--eval-every", type=int, default=0,
                        help="validate every N steps (language models): each row then has the curve and the "
                             "training time to each point, for a time to the target (evaluations excluded)")
    parser.add_argument("--json", default="")
    parser.add_argument("--master", default="127.0.0.1", help="rank 0's address")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's own). PowerSGD on Gloo needs the model in one "
                             "bucket: its hook issues collectives from completion callbacks, which race with the "
                             "next bucket's on Gloo (a collective size mismatch here; pytorch/pytorch#58467)")
    args = parser.parse_args()
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # one worker per test-bed host, started by mpirun
        rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        out = f"/tmp/ddp_study_rows.{os.getpid()}.json"
        worker(rank, size, 29533, args, out, iface="eth0")
        if rank == 0:
            rows = json.loads(Path(out).read_text())
            Path(out).unlink()
            print(table(rows, size, args.task, args.steps))
            print(target_table(rows))
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(worker, args=(args.workers, port, args, out), nprocs=args.workers, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    print(table(rows, args.workers, args.task, args.steps))
    print(target_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
