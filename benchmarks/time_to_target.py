#!/usr/bin/env python
"""Time to reach dense's final loss on a shaped link: what a user of a slow network actually waits for.

Combines two measurements taken separately (each needs the whole machine):
  - steps to target, from benchmarks/convergence.py's runs (3 seeds, P workers): for a language model the first
    evaluation at which the validation loss is at or below 1.01 x dense's final validation loss (mean over seeds);
    for digits the first epoch whose training loss (averaged over workers) is at or below 1.01 x dense's final
    training loss;
  - the step time of the same model, P workers and method on the test bed's shaped links, from
    `benchmarks/bench_e2e.py --model ... --json FILE`.
Time to target = steps to target x step time. Why a product and not one timed training run per link: a timed run
of every method to convergence on every link is hours of this 2-core machine, while the step time does not depend
on the step's data; the product is exact as long as the step time is steady, which bench_e2e's 10-step means
assume as well.

    python benchmarks/time_to_target.py --task charlm --workers 4 --e2e results/e2e_charlm_p4.json
    python benchmarks/time_to_target.py --task digits --workers 4 --e2e results/e2e_digits_p4.json
    python benchmarks/time_to_target.py --task gptlm --workers 4 --e2e results/e2e_auto_gptlm_p4.json \
        --rates 100mbit --methods dense fp16 auto        # auto's runs: convergence.py --methods auto@100mbit

ratio="auto" decides from the link, so its runs are on the test bed at each rate (convergence.py --methods
auto@<rate>) and their time to the target is measured in the run. ``--bed-methods dense fp16 auto`` takes dense's
and fp16's the same way (convergence.py --methods dense@<rate> fp16@<rate>): one clock for every row, where the
product with another job's step time differs by the bed's job-to-job spread (~10%); "vs dense" is then against
dense's run on the bed. When every method ran on the bed, no bench_e2e JSON is needed: ``--e2e`` may be left out
(``--methods`` and ``--rates`` then say what to show), and ``--target-from dense@100mbit`` takes the target from
dense's runs on the bed (a dense step is the same arithmetic on any link: the same losses as on localhost).

    python benchmarks/time_to_target.py --task charlm --workers 4 --convergence results/conv-p4-half \
        --methods dense fp16 auto --rates 100mbit --bed-methods dense fp16 auto --target-from dense@100mbit
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from convergence import LM_BUDGETS, OVERRUN, result_name, steps_to_target  # noqa: E402


def digits_steps_to_target(run: dict, target: float, steps_per_epoch: int) -> Optional[int]:
    """Steps to the first epoch whose mean training loss is at or below ``target`` (None: never)."""
    for epoch, loss in enumerate(run["curve"], 1):
        if loss <= target:
            return epoch * steps_per_epoch
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=["digits", "digits-keras", "charlm", "gptlm"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--budget", default="short", choices=["short", "converged"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--e2e", help="JSON written by benchmarks/bench_e2e.py --json for this model (needed unless "
                                      "every method is a --bed-methods one)")
    parser.add_argument("--target-from", default="dense",
                        help="the runs whose final loss sets the target (default: dense's on localhost)")
    parser.add_argument("--convergence", default=str(ROOT / "results" / "convergence"))
    parser.add_argument("--methods", nargs="+", help="only these methods of the e2e JSON (dense is needed)")
    parser.add_argument("--rates", nargs="+", help="only these rates of the e2e JSON (e.g. 100mbit)")
    parser.add_argument("--bed-methods", nargs="+", default=["auto", "auto-update"],
                        help="methods whose runs are <method>@<rate> on the test bed, timed in the run")
    parser.add_argument("--steps-per-epoch", type=int,
                        help="digits: optimizer steps per epoch at this P (default: 1437 training images / P / 32)")
    args = parser.parse_args()
    if args.e2e:
        e2e = json.loads(Path(args.e2e).read_text())
    elif args.methods and args.rates and set(args.methods) <= set(args.bed_methods):
        # every row timed in its own run on the bed: no step times from another job
        e2e = {"model": args.task, "rows": [{"workers": args.workers, "rate": rate, "method": method,
                                             "t_step_s": float("nan")} for rate in args.rates
                                            for method in args.methods]}
    else:
        parser.error("--e2e is needed unless --methods and --rates are given and every method is in --bed-methods")
    rows = [r for r in e2e["rows"] if r["workers"] == args.workers and (not args.rates or r["rate"] in args.rates)]
    if not rows:
        parser.error(f"{args.e2e} has no rows for {args.workers} workers")
    methods: List[str] = [m for m in dict.fromkeys(r["method"] for r in rows) if not args.methods or m in args.methods]
    rates: List[str] = [r for r in dict.fromkeys(r["rate"] for r in rows) if not args.rates or r in args.rates]
    conv = Path(args.convergence)
    runs: Dict[str, List[dict]] = {}
    bed = [m for m in methods if m in args.bed_methods]
    # dense's runs on localhost set the target (one per table, whatever the link); the bed's runs are timed
    wanted = list(dict.fromkeys([args.target_from] + [m for m in methods if m not in bed]
                                + [f"{m}@{rate}" for m in bed for rate in rates]))
    for method in wanted:
        paths = [conv / result_name(args.task, method, s, args.budget, args.workers) for s in args.seeds]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            parser.error(f"no convergence run for {method}: {', '.join(missing)} (run benchmarks/convergence.py "
                         f"--workers {args.workers} --tasks {args.task} --methods {method})")
        runs[method] = [json.loads(p.read_text()) for p in paths]

    if args.task.startswith("digits"):  # digits, digits-keras: the same data, split and schedule
        # digits_data's 80% split of 1797 images, split over the workers, batch 32 (convergence.py records it too)
        spe = args.steps_per_epoch or runs[args.target_from][0].get("steps_per_epoch") or (1437 // args.workers) // 32
        target = 1.01 * sum(r["curve"][-1] for r in runs[args.target_from]) / len(runs[args.target_from])
        reach = {m: [digits_steps_to_target(r, target, spe) for r in rs] for m, rs in runs.items()}
        limit = len(runs[args.target_from][0]["curve"]) * spe
        what = f"training loss <= {target:.4f} (1.01 x dense's final, mean over seeds)"
    else:
        target = 1.01 * sum(r["final"] for r in runs[args.target_from]) / len(runs[args.target_from])
        reach = {m: [steps_to_target(r, target) for r in rs] for m, rs in runs.items()}
        limit = int(OVERRUN * LM_BUDGETS[args.task][args.budget])
        what = f"validation loss <= {target:.4f} (1.01 x dense's final, mean over seeds)"

    def timed_in_run(key: str) -> Optional[float]:
        """Mean over seeds of the run's own training time to the target (None unless every seed reached it)."""
        if not all(reach[key]) or "train_seconds" not in runs[key][0]:
            return None
        times = [r["train_seconds"][r["evals"].index(x)] for r, x in zip(runs[key], reach[key])]
        return sum(times) / len(times)

    print(f"{args.task}, {args.workers} workers, target {what} ({args.target_from}'s runs); step times from "
          f"{args.e2e or 'the runs themselves'} ({e2e['model']})"
          + (f"; {', '.join(bed)}: runs on the test bed, timed in the run" if bed else ""))
    print("| bandwidth | method | steps to target (per seed) | step time (ms) | time to target | vs dense |")
    print("|---|---|---|---|---|---|")
    for rate in rates:
        step_s = {r["method"]: r["t_step_s"] for r in rows if r["rate"] == rate}
        if "dense" in bed:
            dense_time = timed_in_run(f"dense@{rate}")
        else:
            dense_steps = [x for x in reach["dense"] if x]
            dense_time = sum(dense_steps) / len(dense_steps) * step_s["dense"] if dense_steps else None
        for method in methods:
            on_bed = method in bed
            key = f"{method}@{rate}" if on_bed else method
            per_seed = ", ".join(str(x) if x else "-" for x in reach[key])
            shown, step = method, step_s[method]
            t = timed_in_run(key) if on_bed else None
            if on_bed:
                chosen = sorted({str(r.get("auto", {}).get("ratio")) for r in runs[key] if "auto" in r})
                shown += (f" (chose {'/'.join(chosen).replace('None', 'dense')}; " if chosen else " (") + "timed in the run)"
                if t is not None:  # the run's own step time, for the column
                    step = t / (sum(reach[key]) / len(reach[key]))
            if all(reach[key]):
                t = t if t is not None else sum(reach[key]) / len(reach[key]) * step
                cell = f"{t:.1f} s"
                rel = f"{t / dense_time:.2f}x" if dense_time else "–"
            else:
                t = limit * step
                cell, rel = f"not reached in {limit} steps (> {t:.1f} s)", "–"
            print(f"| {rate} | {shown} | {per_seed} | {step * 1e3:.1f} | {cell} | {rel} |")

if __name__ == "__main__":
    main()
