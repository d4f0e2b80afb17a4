#!/usr/bin/env python
"""Plot simulator screens (benchmarks/compression_sim.py results): validation loss against steps and against bytes
handed to collectives, mean over the seeds found, one line per method.

    python benchmarks/plot_sim.py results/sim-gpu/sim --task gptlm --steps 3600 --out docs/sim_gptlm-3600.png

Bytes are the run's ``bytes_fraction`` of dense's, spread evenly over its steps (every method here sends the same
bytes each step), in units of dense's bytes per step: dense's line is then the number of steps.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List


def load(directory: Path, task: str, steps: int, workers: int, variant: str = "") -> Dict[str, List[dict]]:
    runs: Dict[str, List[dict]] = defaultdict(list)
    for path in sorted(directory.glob(f"{task}{variant}-{steps}-*-p{workers}.json")):
        if "-diag" in path.name:
            continue
        run = json.loads(path.read_text())
        runs[run["method"]].append(run)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--task", default="gptlm")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--variant", default="", help="the tag compression_sim puts after the task in its file "
                        "names, e.g. --variant=-cuda (a GPU run) or --variant=-wd0 (--weight-decay 0)")
    parser.add_argument("--methods", nargs="*", help="only these (simulator specs); default: all found")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ylim", type=float, nargs=2, metavar=("LOW", "HIGH"),
                        help="the loss axis (default: up to 2.6): a narrow range shows the ends of converged runs")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(args.directory, args.task, args.steps, args.workers, args.variant)
    if not runs:
        raise SystemExit(f"no {args.task} runs of {args.steps} steps at P={args.workers} in {args.directory}")
    fig, (by_steps, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, group in runs.items():
        if args.methods and method not in args.methods:
            continue
        evals = group[0]["evals"]
        mean = [sum(r["valid"][i] for r in group) / len(group) for i in range(len(evals))]
        fraction = group[0]["bytes_fraction"]
        label = f"{method} ({100 * fraction:.2f}% of dense's bytes, {len(group)} seeds)"
        by_steps.plot(evals, mean, label=label)
        by_bytes.plot([e * fraction for e in evals], mean, label=label)
    by_steps.set_xlabel("step")
    by_bytes.set_xlabel("bytes handed to collectives, in dense steps' worth")
    by_bytes.set_xscale("log")
    for ax in (by_steps, by_bytes):
        ax.set_ylabel("validation loss")
        ax.set_ylim(*(args.ylim or (None, min(ax.get_ylim()[1], 2.6))))
        ax.grid(alpha=0.3)
    by_steps.legend(fontsize=8)
    fig.suptitle(f"{args.task}, {args.steps} steps, {args.workers} workers (simulator), mean over seeds")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
