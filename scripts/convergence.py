#!/usr/bin/env python
"""Does TopKEF reach the accuracy of dense training? Real data, 2 Horovod workers, same seeds and schedule.

Tasks (no synthetic data, no downloads):
  digits          scikit-learn's handwritten digits, the CNN of examples/digits_torch.py: test accuracy
  digits-noniid   the same, but worker 0 trains only on digits 0-4 and worker 1 only on 5-9
  charlm          a byte-level GRU language model on the Python standard library's own source files (the *.py
                  files of this interpreter's stdlib directory, sorted, first 2 MB; last 10% held out):
                  validation loss and perplexity
Methods: dense allreduce, hvd.Compression.fp16, TopKEF ratio 0.01, TopKEF ratio 0.001 with sparsity warm-up.

Each run is its own `horovodrun -np 2` job writing one JSON file; finished runs are skipped, so an interrupted
study resumes where it stopped. One line per finished run ([k/N] ...), then a table (mean ± half range over
seeds) and one loss-curve plot per task.

    python scripts/convergence.py                                  # everything, 3 seeds (about 15 minutes here)
    python scripts/convergence.py --tasks digits --seeds 0 --out /tmp/conv
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["digits", "digits-noniid", "charlm"]
METHODS = ["dense", "fp16", "topk0.01", "topk0.001-warmup"]
#: Measured on request (--methods), not part of the default table.
EXTRA_METHODS = ["topk0.01-guard3"]


def compression_for(method: str, warmup_steps: int):
    import horovod.torch as hvd

    from horovod_topk.torch import TopKEF

    return {
        "dense": hvd.Compression.none,
        "fp16": hvd.Compression.fp16,
        "topk0.01": TopKEF(ratio=0.01),
        "topk0.001-warmup": TopKEF(ratio=0.001, warmup_steps=warmup_steps),
        "topk0.01-guard3": TopKEF(ratio=0.01, spike_guard=3.0),
    }[method]


def digits_run(method: str, seed: int, noniid: bool, epochs: int = 30, batch: int = 32, lr: float = 0.05) -> dict:
    import horovod.torch as hvd
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from digits_data import load_split
    from digits_torch import DigitsCNN

    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_split(seed, 0, 1))
    if noniid:  # each worker sees a different half of the classes
        mine = (y_train < 5) if hvd.rank() == 0 else (y_train >= 5)
        x_train, y_train = x_train[mine], y_train[mine]
    else:
        x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_train, x_test = x_train[:, None], x_test[:, None]
    steps = int(hvd.allreduce(torch.tensor(len(x_train) // batch), op=hvd.Min, name="steps"))
    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression_for(method, warmup_steps=3 * steps))
    gen = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    curve, metric = [], []
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=gen)
        total = 0.0
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        curve.append(hvd.allreduce(torch.tensor(total / steps), name="loss").item())
        with torch.no_grad():
            metric.append((model(x_test).argmax(1) == y_test).float().mean().item())
    return {"metric": "test accuracy", "final": metric[-1], "curve": curve, "metric_curve": metric}


def charlm_data(size: int = 2_000_000):
    import torch

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py")))[:size]
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:], f"{stdlib}/*.py (first {len(text)} bytes)"


def charlm_run(method: str, seed: int, steps: int = 400, batch: int = 16, seq: int = 128) -> dict:
    import horovod.torch as hvd
    import torch
    from torch import nn

    class CharGRU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 64)
            self.gru = nn.GRU(64, 256, batch_first=True)
            self.out = nn.Linear(256, 256)

        def forward(self, x):
            return self.out(self.gru(self.embed(x))[0])

    torch.manual_seed(seed)
    train, valid, source = charlm_data()
    model = CharGRU()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=compression_for(method, warmup_steps=steps // 4))
    gen = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    vgen = torch.Generator().manual_seed(12345)
    vstarts = torch.randint(0, len(valid) - seq - 1, (32,), generator=vgen)
    vx = torch.stack([valid[i:i + seq] for i in vstarts])
    vy = torch.stack([valid[i + 1:i + seq + 1] for i in vstarts])

    def validate() -> float:
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(vx).reshape(-1, 256), vy.reshape(-1)).item()

    curve, metric = [], []
    total = 0.0
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=gen)
        x = torch.stack([train[i:i + seq] for i in starts])
        y = torch.stack([train[i + 1:i + seq + 1] for i in starts])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        total += loss.item()
        if step % 50 == 0:
            curve.append(hvd.allreduce(torch.tensor(total / 50), name="loss").item())
            metric.append(validate())
            total = 0.0
    return {"metric": "validation loss", "final": metric[-1], "perplexity": math.exp(metric[-1]), "curve": curve,
            "metric_curve": metric, "corpus": source}


def worker(task: str, method: str, seed: int, out: Path) -> None:
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    start = time.perf_counter()
    result = charlm_run(method, seed) if task == "charlm" else digits_run(method, seed, task == "digits-noniid")
    result.update(task=task, method=method, seed=seed, seconds=time.perf_counter() - start)
    if hvd.rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)  # atomic: a killed run leaves no half-written result behind


def summarize(out_dir: Path, tasks, methods, seeds, plot: bool) -> None:
    print("| task | metric | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for task in tasks:
        cells, metric = [], ""
        for method in methods:
            runs = [json.loads((out_dir / f"{task}-{method}-{s}.json").read_text()) for s in seeds]
            finals = [r["final"] for r in runs]
            metric = runs[0]["metric"]
            mean, half = sum(finals) / len(finals), (max(finals) - min(finals)) / 2
            cells.append(f"{mean:.4f} ± {half:.4f}")
        print(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for task in tasks:
            fig, ax = plt.subplots(figsize=(6, 4))
            for method in methods:
                curves = [json.loads((out_dir / f"{task}-{method}-{s}.json").read_text())["curve"] for s in seeds]
                mean = [sum(v) / len(v) for v in zip(*curves)]
                ax.plot(range(1, len(mean) + 1), mean, label=method)
            ax.set_yscale("log")
            ax.set_xlabel("epoch" if task != "charlm" else "x50 steps")
            ax.set_ylabel("training loss (mean over seeds)")
            ax.set_title(f"{task}: 2 workers")
            ax.legend()
            path = ROOT / "docs" / f"convergence_{task}.png"
            path.parent.mkdir(exist_ok=True)
            fig.savefig(path, dpi=110, bbox_inches="tight")
            print(f"plot: {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", default=str(ROOT / "results" / "convergence"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("TASK", "METHOD", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = Path(args.out)
    if args.worker:
        task, method, seed = args.worker
        worker(task, method, int(seed), out_dir / f"{task}-{method}-{seed}.json")
        return
    runs = [(t, m, s) for t in args.tasks for m in args.methods for s in args.seeds]
    for n, (task, method, seed) in enumerate(runs, 1):
        path = out_dir / f"{task}-{method}-{seed}.json"
        if not path.exists():
            subprocess.run(["horovodrun", "-np", "2", "-H", "localhost:2", sys.executable, __file__,
                            "--worker", task, method, str(seed), "--out", str(out_dir)],
                           check=True, capture_output=True, text=True)
        r = json.loads(path.read_text())
        print(f"[{n}/{len(runs)}] {task:<14} {method:<17} seed {seed}: {r['metric']} {r['final']:.4f} "
              f"({r['seconds']:.0f} s)", flush=True)
    summarize(out_dir, args.tasks, args.methods, args.seeds, plot=not args.no_plot)


if __name__ == "__main__":
    main()
