#!/usr/bin/env python
"""The end of scripts/demo.sh: a side-by-side table of the runs' summaries (dense vs TopKEF: final accuracy,
bytes handed to collectives, wall time) and a PNG plot of test accuracy per epoch.

    python scripts/demo_report.py DIR        # reads DIR/*.json written by the examples' --summary
"""
from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any, Dict, List


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


if __name__ == "__main__":
    main()
