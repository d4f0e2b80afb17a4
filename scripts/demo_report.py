#!/usr/bin/env python
"""The end of scripts/demo.sh: a side-by-side table of the runs' summaries (dense vs TopKEF: final accuracy,
bytes handed to collectives, wall time), a PNG plot of test accuracy per epoch, and where TopKEF pays.

On one machine the workers talk over loopback, where communication costs almost nothing: there TopKEF's own work
(compression, its extra collectives) is all that shows, and it is slower than dense. The last block says where it
pays: the advisor (``python -m horovod_topk.advise``, horovod_topk/core/costmodel.py) predicts the same model's
step on 8 workers at 1 and 10 Gbit/s from the step times measured here -- dense's step as the compute time, and
TopKEF's step minus dense's as its extra work per step -- and finds the bandwidth below which TopKEF is faster
than both dense allreduce and Horovod's fp16 compression.

    python scripts/demo_report.py DIR        # reads DIR/*.json written by the examples' --summary
"""
from __future__ import annotations

import glob
import json
import os
import math
import sys
import textwrap
from typing import Any, Dict, List, Optional, Tuple

#: The cluster the advisor block describes: 8 workers, each on a link of these rates (bits per second).
WORKERS = 8
LINKS = (1e9, 10e9)


def table(runs: List[Dict[str, Any]]) -> str:
    rows = [("framework", "method", "final accuracy", "bytes to collectives (rank 0)", "vs dense", "wall time")]
    for r in runs:
        rows.append((r["framework"], r["method"], f"{r['final_accuracy']:.4f}", f"{r['bytes_sent'] / 1e6:.2f} MB",
                     "baseline" if r["bytes_sent"] >= r["bytes_dense"]
                     else f"{r['bytes_dense'] / max(r['bytes_sent'], 1):.1f}x less", f"{r['wall_s']:.1f} s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    frameworks = sorted({r["framework"] for r in runs}, reverse=True)
    fig, axes = plt.subplots(1, len(frameworks), figsize=(5.5 * len(frameworks), 4), squeeze=False)
    for ax, framework in zip(axes[0], frameworks):
        for r in (r for r in runs if r["framework"] == framework):
            epochs = [h["epoch"] for h in r["history"]]
            label = f"{r['method']} ({r['bytes_sent'] / 1e6:.1f} MB sent)"
            ax.plot(epochs, [h["accuracy"] for h in r["history"]], marker=".", label=label)
        ax.set_title(f"digits CNN, {framework}, 2 workers")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pairs(runs: List[Dict[str, Any]]) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """(dense run, TopKEF run) per framework, where both have step times and the model's tensors."""
    pairs = []
    for framework in sorted({r["framework"] for r in runs}, reverse=True):
        dense = [r for r in runs if r["framework"] == framework and r.get("ratio") is None and r.get("step_s")]
        topk = [r for r in runs if r["framework"] == framework and isinstance(r.get("ratio"), (int, float))
                and r.get("step_s") and r.get("tensors")]  # a fixed ratio: what the advisor predicts for
        if dense and topk:
            pairs.append((dense[0], topk[0]))
    return pairs


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.3g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.3g} Mbit/s"


def predict_steps(tensors: List[int], ratio: float, t_compute: float, t_extra: float,
                  bps: float) -> Dict[str, float]:
    """Predicted step time (s) of dense allreduce, fp16 and TopKEF (exchange="auto") on WORKERS workers."""
    from horovod_topk.advise import advise
    from horovod_topk.core.config import TopKConfig
    from horovod_topk.core.costmodel import Link

    rows, _ = advise([(f"t{i}", n) for i, n in enumerate(tensors)], WORKERS, Link(bps), t_compute,
                     TopKConfig(ratio=ratio), t_compress_s=t_extra)
    by_name = {name: pred for name, pred, _ in rows if pred is not None}
    return {"dense": by_name["dense allreduce"].t_step_s, "fp16": by_name["fp16 (Horovod)"].t_step_s,
            "topk": by_name[f"TopKEF {ratio:g} auto"].t_step_s}


def break_even(tensors: List[int], ratio: float, t_compute: float, t_extra: float) -> Optional[float]:
    """The link rate (bits/s) below which TopKEF's predicted step is shorter than both dense's and fp16's: None
    if it is shorter nowhere from 1 Mbit/s up, inf if it is shorter everywhere up to 1 Tbit/s."""
    def gain(bps: float) -> float:
        t = predict_steps(tensors, ratio, t_compute, t_extra, bps)
        return min(t["dense"], t["fp16"]) / t["topk"]

    lo, hi = math.log(1e6), math.log(1e12)
    if gain(math.exp(lo)) <= 1.0:
        return None
    if gain(math.exp(hi)) > 1.0:
        return math.inf
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(math.exp(mid)) > 1.0 else (lo, mid)
    return math.exp(lo)


def where_it_pays(runs: List[Dict[str, Any]]) -> str:
    """The advisor's block for each framework that has a dense and a TopKEF run (empty if none)."""
    pairs = _pairs(runs)
    if not pairs:
        return ""
    out = [f"Where TopKEF pays: this model on {WORKERS} workers, as the advisor predicts it from the step times "
           f"measured here",
           "(compute: dense's step here; TopKEF extra: its step minus dense's here, i.e. compression and its extra "
           "collectives)", ""]
    head = ("framework", "compute", "TopKEF extra", "link", "dense", "fp16", "TopKEF", "")
    rows = [head]
    verdicts, commands = [], []
    for dense, topk in pairs:
        t_compute = dense["step_s"]
        t_extra = max(0.0, topk["step_s"] - dense["step_s"])
        for i, bps in enumerate(LINKS):
            t = predict_steps(topk["tensors"], topk["ratio"], t_compute, t_extra, bps)
            best = min(t["dense"], t["fp16"])
            rival = "dense" if t["dense"] <= t["fp16"] else "fp16"
            verdict = (f"pays: {best / t['topk']:.2f}x faster than {rival}" if t["topk"] < best else "does not pay")
            rows.append((topk["framework"] if i == 0 else "", f"{t_compute * 1e3:.1f} ms" if i == 0 else "",
                         f"{t_extra * 1e3:.1f} ms" if i == 0 else "", _rate(bps), f"{t['dense'] * 1e3:.1f} ms",
                         f"{t['fp16'] * 1e3:.1f} ms", f"{t['topk'] * 1e3:.1f} ms", verdict))
        edge = break_even(topk["tensors"], topk["ratio"], t_compute, t_extra)
        if edge is None:
            where = "at no link speed (its extra work outweighs what it saves)"
        elif math.isinf(edge):
            where = f"at any link speed (its extra work measured here: {t_extra * 1e3:.1f} ms per step)"
        else:
            where = f"on links below ~{_rate(edge)} per worker"
        verdicts.append(f"{topk['framework']} {where}")
        commands.append(f"python -m horovod_topk.advise --tensors {' '.join(str(n) for n in topk['tensors'])} "
                        f"--workers {WORKERS} --bandwidth 1gbit --compute {t_compute * 1e3:.1f}ms "
                        f"--compress-time {t_extra * 1e3:.1f}ms --ratio {topk['ratio']:g}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    n_params = sum(pairs[0][1]["tensors"])
    out += [""] + textwrap.wrap(
        "The first table ran on one machine: over loopback, communication costs almost nothing, so it shows "
        "TopKEF's extra work and none of what it saves -- which is why TopKEF can be slower there. It pays where "
        "sending the gradients takes longer than that work: slow links, many workers, large models. This model "
        f"is small ({n_params:,} parameters, {n_params * 4 / 1e6:.1f} MB of gradients per step). For your own "
        "model and cluster see README, \"Will it pay?\"; this one at 1 Gbit/s in full:", 114)
    out += ["  " + commands[0], f"Where TopKEF pays for this model on {WORKERS} workers: " + "; ".join(verdicts) + "."]
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    directory = sys.argv[1]
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    if not runs:
        sys.exit(f"no run summaries (*.json) in {directory}")
    print(table(runs))
    png = os.path.join(directory, "demo.png")
    plot(runs, png)
    print(f"\nplot: {png}")
    block = where_it_pays(runs)
    if block:
        print()
        print(block)


if __name__ == "__main__":
    main()
