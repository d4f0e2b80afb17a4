#!/usr/bin/env python
"""End-to-end step time and scaling efficiency on the multi-host test bed (scripts/testbed.sh).

P workers (--workers, default 2) on P network-namespace hosts, each joined to the switch by a link shaped to each
bandwidth, the real launch path (mpirun with a host list). For each P, bandwidth and method (dense allreduce,
Horovod's fp16 compression, TopKEF at rho = 0.01 and 0.001, and on request TopKEF with either exchange forced) it
measures the mean step time T_step, the efficiency E = T_compute / T_step (T_compute: the
same step without any communication, measured in the same worker), and the bytes the host's link really sent per
step (its tx counter) next to what stats() says this rank handed to collectives. Prints a table, writes a plot of
step time versus bandwidth and, with --json, the rows for `python -m horovod_topk.advise --check` and
benchmarks/time_to_target.py.

The default model (--model mlp): an MLP of 2.1M parameters (8.4 MB of float32 gradients), chosen so that a dense ring allreduce of its
gradients takes several times its compute on this machine (~20x at 100 Mbit/s, ~2x at 1 Gbit/s).

    python benchmarks/bench_e2e.py                      # needs root; runs scripts/testbed.sh (about 3 minutes)
    python benchmarks/bench_e2e.py --rates 100mbit 1gbit --steps 10 --plot results/e2e.png
    python benchmarks/bench_e2e.py --workers 4 --methods dense fp16 topk0.01-allgather topk0.01-sparse_allreduce \
        --json results/e2e_p4.json --plot docs/e2e_step_time_p4.png
    python benchmarks/bench_e2e.py --workers 4 --model charlm --methods dense topk0.01-allgather topk0.01-sparse_allreduce
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["dense", "fp16", "topk0.01", "topk0.001"]
#: The two exchanges of a compressed tensor, forced (exchange="auto" weighs bytes and collectives and keeps these
#: models' tensors on the allgather up to P = 4 at least: docs/how-it-works.md, "Exchanges"): measured on request.
EXTRA_METHODS = ["topk0.01-allgather", "topk0.01-sparse_allreduce", "topk0.03", "topk0.1", "auto", "auto-update",
                 "update0.01",
                 "update-calibrated0.01", "compact0.1", "update-compact-calibrated0.1",
                 "update-compact-calibrated0.023"]
MODELS = ["mlp", "digits", "charlm", "gptlm", "deep"]


def build_model(name: str):
    """(model, optimizer factory, batch function): the step that is timed. ``mlp`` is the bandwidth-bound MLP of
    the table in docs/performance.md; ``digits`` and ``charlm`` are the CNN and the GRU language model of
    benchmarks/convergence.py with their own optimizer and batch size, so that their step times multiply their
    steps to target (benchmarks/time_to_target.py); ``deep`` is 100 small layers (learning rate 0), whose step is
    mostly the hooks' work per tensor."""
    import horovod.torch as hvd
    import torch

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(hvd.rank())
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10))
        data = [(torch.randn(64, 512, generator=gen), torch.randint(0, 10, (64,), generator=gen)) for _ in range(4)]
        return (model, lambda params: torch.optim.SGD(params, lr=0.01), lambda i: data[i % 4],
                lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    if name == "deep":  # 200 small tensors: a step where the host's cost per tensor is most of the hooks' work
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(100)])
        data = [torch.randn(8, 64, generator=gen) for _ in range(4)]
        return (model, lambda params: torch.optim.SGD(params, lr=0.0), lambda i: data[i % 4],
                lambda m, b: m(b).sum())
    if name == "digits":
        sys.path.insert(0, str(ROOT / "examples"))
        from digits_torch import DigitsCNN

        model = DigitsCNN()
        data = [(torch.randn(32, 1, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen))
                for _ in range(4)]
        return (model, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), lambda i: data[i % 4],
                lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from lm_tasks import make_task

    task = make_task(name)
    model, _, _ = task.build(0, 100)
    data = [task.batch(gen) for _ in range(4)]
    return model, lambda params: torch.optim.Adam(params, lr=3e-3), lambda i: data[i % 4], task.loss


def compression_for(method: str):
    import horovod.torch as hvd

    from horovod_topk.torch import TopKEF

    if method in ("dense", "fp16"):
        return {"dense": hvd.Compression.none, "fp16": hvd.Compression.fp16}[method]
    if method in ("auto", "auto-update"):  # ratio="auto" with its defaults (budget 0.1), gradient or update mode
        return TopKEF(ratio="auto", target="update" if method == "auto-update" else "gradient")
    if method.startswith(("update", "compact")):  # benchmarks/convergence.py's names for the same settings
        # update mode: each rank's own optimizer steps, its update travels; "calibrated" is the default for Adam
        # (its noise-share sketch added); "compact": 16-bit indices and float8 values, 3 bytes per entry
        ratio = float(method.lstrip("abcdefghijklmnopqrstuvwxyz-"))
        encoding = dict(index_bits=16, value_dtype="float8") if "compact" in method else {}
        if not method.startswith("update"):
            return TopKEF(ratio=ratio, target="gradient", **encoding)
        return TopKEF(ratio=ratio, target="update", second_moment="calibrated" if "calibrated" in method else "local",
                      **encoding)
    ratio, _, exchange = method[len("topk"):].partition("-")
    return TopKEF(ratio=float(ratio), exchange=exchange or "auto", target="gradient")  # gradient mode, named


def worker(method: str, steps: int, warmup: int, model_name: str) -> None:
    import horovod.torch as hvd
    import torch

    from horovod_topk.torch import TopKEF

    hvd.init()
    torch.set_num_threads(1)
    model, make_opt, batch, loss_fn = build_model(model_name)

    def local_step(opt):
        b = batch(local_step.i)
        local_step.i += 1
        opt.zero_grad()
        loss_fn(model, b).backward()
        opt.step()
    local_step.i = 0

    plain = make_opt(model.parameters())  # T_compute: the same step, no communication
    for _ in range(warmup):
        local_step(plain)
    t_compute = float("inf")
    for _ in range(3):  # best of three: the machine is shared, and E must not flatter the compressed runs
        start = time.perf_counter()
        for _ in range(steps):
            local_step(plain)
        t_compute = min(t_compute, (time.perf_counter() - start) / steps)

    compression = compression_for(method)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if method.startswith("auto"):  # past the first decision and the check after it: the density chosen's step
        from horovod_topk.core.autodensity import CHECK_STEPS, FIRST_DECISION

        warmup = max(warmup, FIRST_DECISION + CHECK_STEPS + 2)
    for _ in range(warmup):
        local_step(opt)
    counter = Path("/sys/class/net/eth0/statistics/tx_bytes")
    hvd.allreduce(torch.zeros(1), name="e2e.start")
    before = compression.stats() if isinstance(compression, TopKEF) else None
    tx0, start = int(counter.read_text()), time.perf_counter()
    for _ in range(steps):
        local_step(opt)
    hvd.allreduce(torch.zeros(1), name="e2e.end")
    t_step = (time.perf_counter() - start) / steps
    tx = (int(counter.read_text()) - tx0) / steps
    reported = None
    if isinstance(compression, TopKEF):
        s = compression.stats()  # what this rank handed to collectives per timed step
        reported = (s["bytes_sent"] - before["bytes_sent"]) / steps
    rows = hvd.allgather_object((t_compute, t_step, tx, reported))
    if hvd.rank() == 0:
        mean = [sum(v) / len(v) if None not in v else None for v in zip(*rows)]
        tensors = [[n, p.numel()] for n, p in model.named_parameters()]
        print(f"E2E method={method} t_compute={mean[0]:.5f} t_step={mean[1]:.5f} tx_per_step={mean[2]:.0f} "
              f"reported_per_step={mean[3] if mean[3] is not None else 'NA'}", flush=True)
        print("E2E tensors=" + json.dumps(tensors), flush=True)
        if method.startswith("auto"):
            last = compression.stats()["auto"]["last"]
            print("E2E auto=" + json.dumps({"ratio": compression.auto.ratio, "reason": last.get("reason"),
                                            "predicted_s": last.get("predicted_s"),
                                            "bandwidth_bps": last.get("bandwidth_bps"),
                                            "latency_s": last.get("latency_s"), "compute_s": last.get("compute_s"),
                                            "measured_step_s": last.get("measured_step_s")}), flush=True)


def parse_rate(rate: str) -> float:
    """'100mbit' -> 1e8 bits per second (tc's units)."""
    m = re.fullmatch(r"([\d.]+)(kbit|mbit|gbit)", rate.lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit, e.g. 100mbit")
    return float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]


def run_one(workers: int, rate: str, method: str, steps: int, warmup: int, model: str) -> dict:
    cmd = [str(ROOT / "scripts" / "testbed.sh"), "run", str(workers), "--rate", rate, "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", method, "--model", model,
           "--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    num = r"([0-9.e+-]+)"  # explicit: mpirun's output tags may follow a value directly
    text = out.stdout + out.stderr
    m = re.search(rf"E2E method=(\S+) t_compute={num} t_step={num} tx_per_step={num} "
                  rf"reported_per_step=([0-9.e+-]+|NA)", text)
    t = re.search(r"E2E tensors=(\[.*?\]\])", text)
    a = re.search(r"E2E auto=(\{.*\})", text)
    if out.returncode != 0 or m is None or t is None:
        sys.exit(f"P={workers} {rate} {method} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    ratio, _, exchange = method[len("topk"):].partition("-") if method.startswith("topk") else (None, "", None)
    return {"workers": workers, "rate": rate, "rate_bps": parse_rate(rate), "method": method,
            "ratio": float(ratio) if ratio else None,
            "exchange": (exchange or "auto") if ratio else None,
            "t_compute_s": float(m.group(2)), "t_step_s": float(m.group(3)), "tx_bytes_per_step": float(m.group(4)),
            "handed_bytes_per_step": None if m.group(5) == "NA" else float(m.group(5)),
            "tensors": json.loads(t.group(1)), "auto": json.loads(a.group(1)) if a else None}


def run_all(workers_list, rates, methods, steps, warmup, model, plot, json_path):
    rows = []
    for workers in workers_list:
        for rate in rates:
            for method in methods:
                row = run_one(workers, rate, method, steps, warmup, model)
                rows.append(row)
                print(f"  P={workers} {rate:>8} {method:<26} step {row['t_step_s'] * 1e3:8.1f} ms",
                      file=sys.stderr, flush=True)
    print(f"model: {model} ({sum(n for _, n in rows[0]['tensors']) / 1e6:.2f}M parameters)")
    print("| P | bandwidth | method | T_compute (ms) | T_step (ms) | E = T_compute / T_step | link tx per host and step"
          " | TopKEF stats(): handed to collectives per step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rep = f"{r['handed_bytes_per_step'] / 1e6:.3f} MB" if r["handed_bytes_per_step"] is not None else "–"
        shown = r["method"] if not r.get("auto") else (
            f"{r['method']} (chose {'dense' if r['auto']['ratio'] is None else r['auto']['ratio']})")
        print(f"| {r['workers']} | {r['rate']} | {shown} | {r['t_compute_s'] * 1e3:.1f} | "
              f"{r['t_step_s'] * 1e3:.1f} | {r['t_compute_s'] / r['t_step_s']:.0%} | "
              f"{r['tx_bytes_per_step'] / 1e6:.3f} MB | {rep} |")
    if json_path:
        # read by `python -m horovod_topk.advise --check` and benchmarks/time_to_target.py
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"model": model, "tensors": rows[0]["tensors"], "grad_bytes": 4,
                                               "rows": [{k: v for k, v in r.items() if k != "tensors"}
                                                        for r in rows]}, indent=1))
        print(f"\njson: {json_path}")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(workers_list), figsize=(6 * len(workers_list), 4), squeeze=False)
        for ax, workers in zip(axes[0], workers_list):
            xs = [parse_rate(r) / 1e6 for r in rates]
            for method in methods:
                ax.plot(xs, [next(r["t_step_s"] for r in rows if (r["workers"], r["rate"], r["method"]) ==
                                  (workers, rate, method)) * 1e3 for rate in rates], marker="o", label=method)
            ax.plot(xs, [next(r["t_compute_s"] for r in rows if (r["workers"], r["rate"]) == (workers, rate)) * 1e3
                         for rate in rates], "k--", label="compute only")
            ax.set_xscale("log"), ax.set_yscale("log")
            ax.set_xlabel("link bandwidth (Mbit/s)"), ax.set_ylabel("step time (ms)")
            ax.set_title(f"{workers} workers, {model}, test bed links")
            ax.legend(fontsize=8)
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120, bbox_inches="tight")
        print(f"plot: {plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2], help="test-bed hosts, one worker each")
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS)
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--json", help="also write the rows as JSON (for advise --check and time_to_target.py)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--plot", default=str(ROOT / "docs" / "e2e_step_time.png"))
    parser.add_argument("--worker", choices=METHODS + EXTRA_METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.model)
    else:
        if os.geteuid() != 0:
            sys.exit("bench_e2e needs root for the network namespaces of scripts/testbed.sh")
        for rate in args.rates:
            try:
                parse_rate(rate)
            except ValueError as e:
                parser.error(str(e))
        run_all(args.workers, args.rates, args.methods, args.steps, args.warmup, args.model, args.plot, args.json)


if __name__ == "__main__":
    main()
