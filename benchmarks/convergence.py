#!/usr/bin/env python
"""Does TopKEF reach the accuracy of dense training? Real data, 2 Horovod workers (--workers P: more), same seeds
and schedule.

Tasks (no synthetic data, no downloads):
  digits          scikit-learn's handwritten digits, the CNN of examples/digits_torch.py: test accuracy
  digits-noniid   the same, but worker 0 trains only on digits 0-4 and worker 1 only on 5-9
  digits-keras    the digits task in TensorFlow (examples/digits_keras.py's CNN, Keras model.fit), on request
  charlm, gptlm   byte-level language models on the Python standard library's own source (benchmarks/lm_tasks.py):
                  a GRU with Adam, and a small decoder-only transformer with AdamW, warm-up and cosine decay.
                  Two budgets (--budget short|converged, steps in LM_BUDGETS); validation loss, steps to reach 1.01x
                  dense's final validation loss (compressed methods run 1.5x the budget to find it), bytes handed to
                  collectives
Methods: dense allreduce, hvd.Compression.fp16, TopKEF ratio 0.01, TopKEF ratio 0.001 with sparsity warm-up, and the
compact encoding at the same bytes (ratio 0.025 and 0.0025 with index_bits=16, value_dtype="float8").

Each run is its own `horovodrun -np P` job writing one JSON file; finished runs are skipped, so an interrupted
study resumes where it stopped. One line per finished run ([k/N] ...), then a table (mean ± half range over
seeds) and one loss-curve plot per task.

    python benchmarks/convergence.py                                  # everything, 3 seeds (about 15 minutes here)
    python benchmarks/convergence.py --tasks digits --seeds 0 --out /tmp/conv
    python benchmarks/convergence.py --workers 4 --tasks digits charlm \
        --methods dense topk0.01-allgather topk0.01-sparse_allreduce        # the two exchanges at P = 4
    python benchmarks/convergence.py --workers 4 --tasks gptlm --methods auto@100mbit   # on the test bed (root)
    python benchmarks/convergence.py --workers 4 --tasks digits-keras --methods dense topk0.01@100mbit auto@100mbit
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["digits", "digits-noniid", "charlm", "gptlm"]
#: Run on request (--tasks), not part of the default table: the digits task in TensorFlow (Keras 2 through
#: Horovod's Keras DistributedOptimizer, model.fit), for the time to the target of its front end.
EXTRA_TASKS = ["digits-keras"]
#: The methods digits-keras runs (KERAS_COMPRESSION): its baselines and TopKEF's fixed and automatic densities.
KERAS_METHODS = ("dense", "fp16", "topk0.01", "topk0.03", "topk0.1", "auto", "auto-cost0")
METHODS = ["dense", "fp16", "topk0.01", "topk0.001-warmup", "compact0.025", "compact0.0025-warmup"]
#: Measured on request (--methods), not part of the default table.
EXTRA_METHODS = ["topk0.01-guard3", "topk0.0267", "topk0.01-allgather", "topk0.01-sparse_allreduce",
                 "update0.01", "update-shared0.01", "update-calibrated0.01", "update0.0115", "update-compact0.025", "topk0.03", "topk0.1",
                 "compact0.1", "update-compact0.1", "update-compact-calibrated0.1",
                 "update-compact-calibrated0.023", "update-compact-calibrated0.03"]


#: ratio="auto" decides from the link it measures, so its runs go on the test bed (scripts/testbed.sh) at the rate
#: in the method's name; the other methods' steps do not depend on the link and run on localhost. "auto" in gradient
#: mode, "auto-update" in update mode (what target="auto" picks for Adam/AdamW: the product's default path there),
#: "auto-cost0" in gradient mode with sparsity_cost=0 (the density chosen by step time alone).
#: "dense@<rate>", "fp16@<rate>" and the fixed ratios' "topk<ratio>@<rate>": the baselines on the same bed, so that
#: their training time is measured in the run the same way as auto's (time_to_target.py --bed-methods), not
#: multiplied from another job's step time.
BED_RATES = ("100mbit", "1gbit", "10gbit")
AUTO_METHODS = [f"{method}@{rate}" for method in ("auto", "auto-update", "auto-cost0", "dense", "fp16", "topk0.01",
                                                  "topk0.03", "topk0.1") for rate in BED_RATES]


def testbed_rate(method: str) -> Optional[str]:
    """The shaped rate a ``<method>@<rate>`` run needs (AUTO_METHODS), None for the others."""
    return method.partition("@")[2] or None if method in AUTO_METHODS else None


def compression_for(method: str, warmup_steps: int):
    import horovod.torch as hvd

    from horovod_topk.torch import TopKEF

    # gradient mode named, not left to target="auto" (which would exchange updates for the language models' Adam):
    # these methods are the gradient-mode rows of the tables; update mode only where the name says so
    if testbed_rate(method) and method.startswith("auto"):  # "auto-cost0": choosing by step time alone
        return TopKEF(ratio="auto", target="update" if method.startswith("auto-update") else "gradient",
                      **({"sparsity_cost": 0.0} if method.startswith("auto-cost0") else {}))
    method = method.partition("@")[0]  # dense@<rate>, fp16@<rate>: the baselines on the bed
    return {
        "dense": hvd.Compression.none,
        "fp16": hvd.Compression.fp16,
        "topk0.01": TopKEF(ratio=0.01, target="gradient"),
        "topk0.001-warmup": TopKEF(ratio=0.001, warmup_steps=warmup_steps, target="gradient"),
        "topk0.01-guard3": TopKEF(ratio=0.01, spike_guard=3.0, target="gradient"),
        # 16-bit indices + float8 values: 3 bytes per entry, so ratio 0.025 sends 0.075 bytes per parameter, a
        # little less than ratio 0.01 with 8-byte entries (0.08): the same budget, 2.5x the entries
        "compact0.025": TopKEF(ratio=0.025, index_bits=16, value_dtype="float8", target="gradient"),
        "compact0.0025-warmup": TopKEF(ratio=0.0025, index_bits=16, value_dtype="float8", warmup_steps=warmup_steps,
                                       target="gradient"),
        # the entries of compact0.025's budget, at 8 bytes each (2.7x its bytes)
        "topk0.0267": TopKEF(ratio=0.0267, target="gradient"),
        # the two exchanges forced (exchange="auto" weighs bytes and collectives: docs/how-it-works.md, "Exchanges")
        "topk0.01-allgather": TopKEF(ratio=0.01, exchange="allgather", target="gradient"),
        # update mode: each rank's optimizer update travels (each rank's own optimizer; or Adam/AdamW under the
        # shared block second moment, or the calibrated one), at the bytes of topk0.01 and compact0.025
        "update0.01": TopKEF(ratio=0.01, target="update", second_moment="local"),
        "update-shared0.01": TopKEF(ratio=0.01, target="update", second_moment="shared"),
        "update-calibrated0.01": TopKEF(ratio=0.01, target="update", second_moment="calibrated"),
        # each rank's own second moment at the bytes of update-calibrated0.01 (its sketch included)
        "update0.0115": TopKEF(ratio=0.0115, target="update", second_moment="local"),
        "update-compact0.025": TopKEF(ratio=0.025, index_bits=16, value_dtype="float8", target="update",
                                      second_moment="local"),
        # the compact encoding at ratio 0.1 (0.3 bytes per parameter, 8% of dense's float32): gradient mode, update
        # mode with each rank's own second moment, and update mode's default for Adam (the calibrated one)
        "compact0.1": TopKEF(ratio=0.1, index_bits=16, value_dtype="float8", target="gradient"),
        "update-compact0.1": TopKEF(ratio=0.1, index_bits=16, value_dtype="float8", target="update",
                                    second_moment="local"),
        "update-compact-calibrated0.1": TopKEF(ratio=0.1, index_bits=16, value_dtype="float8", target="update",
                                               second_moment="calibrated"),
        # update mode's default with the compact encoding at just under 3% of dense's bytes, its sketch included:
        # 0.023 on the transformer, 0.03 on the GRU (what fits in 3% on each model: compression_sim's byte count)
        "update-compact-calibrated0.023": TopKEF(ratio=0.023, index_bits=16, value_dtype="float8", target="update",
                                                 second_moment="calibrated"),
        "update-compact-calibrated0.03": TopKEF(ratio=0.03, index_bits=16, value_dtype="float8", target="update",
                                                second_moment="calibrated"),
        "topk0.01-sparse_allreduce": TopKEF(ratio=0.01, exchange="sparse_allreduce", target="gradient"),
        "topk0.03": TopKEF(ratio=0.03, target="gradient"),
        "topk0.1": TopKEF(ratio=0.1, target="gradient"),
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
    # The learning rate of 2 workers (2 x lr) at every P: Horovod's linear scaling (lr x P) diverged at P = 4 with
    # dense allreduce (seed 2: test accuracy 0.10), and the study compares methods, not batch sizes.
    compression = compression_for(method, warmup_steps=3 * steps)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * 2, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    gen = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    curve, metric, seconds, step_seconds = [], [], [], []
    training = 0.0  # wall time of the steps alone (the epoch's loss allreduce and the test pass excluded)
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=gen)
        total = 0.0
        started = time.perf_counter()
        for s in range(steps):
            began = time.perf_counter()
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += loss.item()
            step_seconds.append(time.perf_counter() - began)
        training += time.perf_counter() - started
        seconds.append(training)
        curve.append(hvd.allreduce(torch.tensor(total / steps), name="loss").item())
        with torch.no_grad():
            metric.append((model(x_test).argmax(1) == y_test).float().mean().item())
    # evals / train_seconds: the step count and training time at the end of each epoch, as the language models
    # record them at each evaluation (time_to_target.py times a bed run's steps to the target from them)
    return {"metric": "test accuracy", "final": metric[-1], "curve": curve, "metric_curve": metric,
            "steps_per_epoch": steps, "evals": [steps * (e + 1) for e in range(epochs)], "train_seconds": seconds,
            "step_seconds": step_seconds,  # each step's wall time on this rank: where a method's time goes
            **({"auto": compression.stats()["auto"]} if getattr(compression, "auto", None) is not None else {})}


def keras_compression(method: str):
    """The Horovod Keras compression of a digits-keras method (KERAS_METHODS, with or without "@<rate>")."""
    import horovod.tensorflow.keras as hvd

    from horovod_topk.tensorflow import TopKEF

    base = method.partition("@")[0]
    if base not in KERAS_METHODS:
        raise SystemExit(f"digits-keras runs {', '.join(KERAS_METHODS)} (with or without @<rate>), not {method!r}")
    if base in ("dense", "fp16"):
        return hvd.Compression.none if base == "dense" else hvd.Compression.fp16
    if base.startswith("auto"):
        return TopKEF(ratio="auto", target="gradient", **({"sparsity_cost": 0.0} if base == "auto-cost0" else {}))
    return TopKEF(ratio=float(base[len("topk"):]), target="gradient")


def digits_keras_run(method: str, seed: int, epochs: int = 30, batch: int = 32, lr: float = 0.05) -> dict:
    """digits_run's task, schedule and record in TensorFlow: the Keras CNN of examples/digits_keras.py, SGD with
    momentum at 2 x lr (digits_run's rate at every P), this worker's shard, model.fit through Horovod's Keras
    DistributedOptimizer; the epoch's mean training loss averaged over workers, the training time without the
    evaluations, and each step's wall time."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Horovod 0.28.1's Keras wrapper needs Keras 2
    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    sys.path.insert(0, str(ROOT / "examples"))
    from digits_data import load_split
    from digits_keras import digits_cnn

    hvd.init()
    if hvd.rank() == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    tf.keras.utils.set_random_seed(seed)
    x_train, y_train, x_test, y_test = load_split(seed, hvd.rank(), hvd.size())
    x_train, x_test = x_train[..., None], x_test[..., None]
    steps = int(hvd.allreduce(tf.constant(len(x_train) // batch), op=hvd_tf.Min, name="steps"))
    compression = keras_compression(method)
    model = digits_cnn()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr * 2, momentum=0.9), compression=compression)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    record = {"curve": [], "metric_curve": [], "train_seconds": [], "step_seconds": []}

    class Record(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_started = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            record["step_seconds"].append(time.perf_counter() - self.began)

        def on_epoch_end(self, epoch, logs=None):
            trained = time.perf_counter() - self.epoch_started  # the epoch's steps, before the loss and the test
            record["train_seconds"].append(trained + (record["train_seconds"][-1] if record["train_seconds"] else 0.0))
            record["curve"].append(float(hvd.allreduce(tf.constant(float(logs["loss"])), name="loss")))
            record["metric_curve"].append(float((model.predict(x_test, verbose=0).argmax(1) == y_test).mean()))

    model.fit(x_train, y_train, batch_size=batch, epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Record()])
    auto = getattr(compression, "auto", None)
    return {"metric": "test accuracy", "final": record["metric_curve"][-1], "steps_per_epoch": steps,
            "evals": [steps * (e + 1) for e in range(epochs)], "framework": f"tensorflow {tf.__version__}",
            **record, **({"auto": compression.stats()["auto"]} if auto is not None else {}), "rank": hvd.rank()}


#: Language-model budgets in steps: "short" (the study's original 400-step charlm budget) and "converged" (dense's
#: validation loss changes < 1% over the last 20% of the steps; checked by summarize and printed with the table).
#: gptlm's cosine schedule keeps its loss falling to the end of any budget (2.2% over the last 20% at 1,200 steps,
#: 1.2% at 3,600, 1.1% at 4,800, simulator, 3 seeds): 3,600 is taken as converged because 4,800 ends only 0.4%
#: lower (docs/convergence.md, "The transformer, screened on a GPU"). The real-worker gptlm table of 2026-11-23 used 1,200.
LM_BUDGETS = {"charlm": {"short": 400, "converged": 1600}, "gptlm": {"short": 400, "converged": 3600}}
#: Compressed methods run this much longer than the budget, to find their steps to dense's target loss.
OVERRUN = 1.5


def lm_run(task_name: str, method: str, seed: int, budget: str) -> dict:
    """One language-model run (benchmarks/lm_tasks.py) on real Horovod workers. Runs the budget, or 1.5x the budget
    for a compressed method (the learning-rate schedule is the budget's; past it the rate stays at its floor), with
    a validation point every budget/40 steps and the bytes this rank handed to collectives at each point."""
    import horovod.torch as hvd
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from lm_tasks import make_task

    task = make_task(task_name)
    budget_steps = LM_BUDGETS[task_name][budget]
    base = method.partition("@")[0]  # dense@<rate>: dense, on the test bed
    steps = budget_steps if base in ("dense", "fp16") else int(OVERRUN * budget_steps)
    every = max(10, budget_steps // 40)
    model, base_opt, sched = task.build(seed, budget_steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = compression_for(method, warmup_steps=budget_steps // 4)
    opt = hvd.DistributedOptimizer(base_opt, named_parameters=model.named_parameters(), compression=compression)
    dense_bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    wire_bytes_per_step = dense_bytes_per_step // 2 if base == "fp16" else dense_bytes_per_step
    gen = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    evals, valid, train, sent, seconds, shares = [], [], [], [], [], []
    total, training = 0.0, 0.0  # training: wall time of the steps alone (evaluations excluded)
    for step in range(1, steps + 1):
        started = time.perf_counter()
        opt.zero_grad()
        loss = task.loss(model, task.batch(gen))
        loss.backward()
        opt.step()
        if sched is not None and step < budget_steps:
            sched.step()
        total += loss.item()
        training += time.perf_counter() - started
        if step % every == 0:
            evals.append(step)
            seconds.append(training)
            train.append(hvd.allreduce(torch.tensor(total / every), name="loss").item())
            valid.append(task.validate(model))
            stats = compression.stats() if callable(getattr(compression, "stats", None)) else None
            sent.append(stats["bytes_sent"] if stats is not None else wire_bytes_per_step * step)
            if stats is not None and "noise_share" in stats:  # update mode's calibrated second moment
                shares.append(stats["noise_share"]["mean"])
            total = 0.0
    at_budget = evals.index(budget_steps) if budget_steps in evals else len(evals) - 1
    return {"metric": "validation loss", "final": valid[at_budget], "perplexity": math.exp(valid[at_budget]),
            "evals": evals, "metric_curve": valid, "curve": train, "bytes_sent": sent,
            "bytes_dense_per_step": dense_bytes_per_step, "budget_steps": budget_steps, "corpus": task.source,
            "train_seconds": seconds,
            **({"noise_share": shares} if shares else {}),  # the tensors' mean noise share at each evaluation
            **({"auto": compression.stats()["auto"]} if getattr(compression, "auto", None) is not None else {})}


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)  # atomic: a killed run leaves no half-written result behind


def worker(task: str, method: str, seed: int, budget: str, out: Path) -> None:
    if task == "digits-keras":  # TensorFlow: no torch in this process
        start = time.perf_counter()
        result = digits_keras_run(method, seed)
        result.update(task=task, method=method, seed=seed, seconds=time.perf_counter() - start)
        if result.pop("rank") == 0:
            write_result(result, out)
        return
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    if hvd.rank() == 0:  # ratio="auto"'s decision lines (horovod_topk's logger) go into the run's log
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    if task in LM_BUDGETS:
        result = lm_run(task, method, seed, budget)
    else:
        result = digits_run(method, seed, task == "digits-noniid")
    result.update(task=task, method=method, seed=seed, seconds=time.perf_counter() - start)
    if hvd.rank() == 0:
        write_result(result, out)


def result_name(task: str, method: str, seed: int, budget: str, workers: int = 2) -> str:
    name = f"{task}-{budget}-{method}-{seed}" if task in LM_BUDGETS else f"{task}-{method}-{seed}"
    return f"{name}.json" if workers == 2 else f"{name}-p{workers}.json"


def steps_to_target(run: dict, target: float) -> Optional[int]:
    """The first evaluated step at which the run's validation loss is at or below ``target`` (None: never)."""
    for step, value in zip(run["evals"], run["metric_curve"]):
        if value <= target:
            return step
    return None


def mean_half(values: List[float]) -> str:
    return f"{sum(values) / len(values):.4f} ± {(max(values) - min(values)) / 2:.4f}"


def summarize(out_dir: Path, tasks, methods, seeds, budget: str, plot: bool, workers: int = 2) -> None:
    load = {(t, m, s): json.loads((out_dir / result_name(t, m, s, budget, workers)).read_text())
            for t in tasks for m in methods for s in seeds}
    print("| task | metric | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for task in tasks:
        metric = load[(task, methods[0], seeds[0])]["metric"]
        cells = [mean_half([load[(task, m, s)]["final"] for s in seeds]) for m in methods]
        print(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    lm_tasks = [t for t in tasks if t in LM_BUDGETS]
    if lm_tasks and "dense" in methods:
        print(f"\nLanguage models, {budget} budget: steps to target (target = 1.01 x dense's final validation loss, "
              f"mean over seeds; first evaluation at or below it, runs go to {OVERRUN}x the budget; "
              f"'-' = not reached) and bytes handed to collectives per step relative to dense")
        print("| task | budget | dense converged? | method | final validation loss | steps to target (per seed) "
              f"| steps / dense's | loss after {OVERRUN}x the steps | bytes / dense's |")
        print("|---|---|---|---|---|---|---|---|---|")
        for task in lm_tasks:
            dense_runs = [load[(task, "dense", s)] for s in seeds]
            target = 1.01 * sum(r["final"] for r in dense_runs) / len(dense_runs)
            budget_steps = dense_runs[0]["budget_steps"]
            # converged: dense's validation loss changed by < 1% over the last 20% of the budget
            late = [r["metric_curve"][r["evals"].index(next(e for e in r["evals"] if e >= 0.8 * budget_steps))]
                    for r in dense_runs]
            change = (sum(late) - sum(r["final"] for r in dense_runs)) / sum(late)
            dense_steps = [steps_to_target(r, target) for r in dense_runs]
            dense_mean = sum(x for x in dense_steps if x) / max(1, sum(1 for x in dense_steps if x))
            for method in methods:
                runs = [load[(task, method, s)] for s in seeds]
                reached = [steps_to_target(r, target) for r in runs]
                per_seed = ", ".join(str(x) if x else "-" for x in reached)
                ratio = (f"{sum(reached) / len(reached) / dense_mean:.2f}x" if all(reached) else
                         f"> {OVERRUN:.1f}x")
                at = [r["evals"].index(r["budget_steps"]) for r in runs]
                nbytes = sum(r["bytes_sent"][i] / (r["bytes_dense_per_step"] * r["budget_steps"])
                             for r, i in zip(runs, at)) / len(runs)
                longer = ("–" if runs[0]["evals"][-1] <= runs[0]["budget_steps"] else
                          mean_half([r["metric_curve"][-1] for r in runs]))
                print(f"| {task} | {budget_steps} steps | {'yes' if change < 0.01 else 'no'} "
                      f"({100 * change:.1f}% over the last 20%) | {method} | "
                      f"{mean_half([r['final'] for r in runs])} | {per_seed} | {ratio} | {longer} | {100 * nbytes:.2f}% |")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for task in tasks:
            is_lm = task in LM_BUDGETS
            panels = 2 if is_lm else 1
            fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
            for method in methods:
                runs = [load[(task, method, s)] for s in seeds]
                if is_lm:
                    n = min(len(r["evals"]) for r in runs)
                    valid = [sum(r["metric_curve"][i] for r in runs) / len(runs) for i in range(n)]
                    sent = [sum(r["bytes_sent"][i] for r in runs) / len(runs) / 1e6 for i in range(n)]
                    axes[0][0].plot(runs[0]["evals"][:n], valid, label=method)
                    axes[0][1].plot(sent, valid, label=method)
                else:
                    curves = [r["curve"] for r in runs]
                    mean = [sum(v) / len(v) for v in zip(*curves)]
                    axes[0][0].plot(range(1, len(mean) + 1), mean, label=method)
            if is_lm:
                axes[0][0].set_xlabel("step")
                axes[0][0].set_ylabel("validation loss (mean over seeds)")
                axes[0][1].set_xlabel("MB handed to collectives by rank 0")
                axes[0][1].set_xscale("log")
                axes[0][1].set_ylabel("validation loss (mean over seeds)")
                axes[0][0].set_title(f"{task} ({budget} budget): {workers} workers")
            else:
                axes[0][0].set_yscale("log")
                axes[0][0].set_xlabel("epoch")
                axes[0][0].set_ylabel("training loss (mean over seeds)")
                axes[0][0].set_title(f"{task}: {workers} workers")
            axes[0][0].legend()
            name = f"convergence_{task}-{budget}" if is_lm else f"convergence_{task}"
            name += ".png" if workers == 2 else f"-p{workers}.png"
            path = ROOT / "docs" / name
            path.parent.mkdir(exist_ok=True)
            fig.savefig(path, dpi=110, bbox_inches="tight")
            print(f"plot: {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS + EXTRA_TASKS)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS + EXTRA_METHODS + AUTO_METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", default="short", choices=["short", "converged"],
                        help="language-model budget (steps in LM_BUDGETS); the digits tasks always run 30 epochs")
    parser.add_argument("--workers", type=int, default=2,
                        help="Horovod workers per run (digits-noniid needs 2: it splits the classes in two halves)")
    parser.add_argument("--out", default=str(ROOT / "results" / "convergence"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--gloo", action="store_true",
                        help="the test bed's runs over Gloo (scripts/testbed.sh run --gloo, as horovodrun --gloo "
                             "starts them) instead of MPI")
    parser.add_argument("--worker", nargs=3, metavar=("TASK", "METHOD", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = Path(args.out)
    tasks = [args.worker[0]] if args.worker else args.tasks
    if args.workers < 2 or ("digits-noniid" in tasks and args.workers != 2):
        parser.error(f"--workers {args.workers}: need at least 2, and exactly 2 with digits-noniid")
    if args.worker:
        task, method, seed = args.worker
        worker(task, method, int(seed), args.budget,
               out_dir / result_name(task, method, int(seed), args.budget, args.workers))
        return
    runs = [(t, m, s) for t in args.tasks for m in args.methods for s in args.seeds]
    for n, (task, method, seed) in enumerate(runs, 1):
        path = out_dir / result_name(task, method, seed, args.budget, args.workers)
        if not path.exists():
            p = str(args.workers)
            rate = testbed_rate(method)
            launch = ([str(ROOT / "scripts" / "testbed.sh"), "run", p, "--rate", rate] + ["--gloo"] * args.gloo
                      + ["--"] if rate else
                      ["horovodrun", "-np", p, "-H", f"localhost:{p}"])
            # the workers' output is kept beside the result (a stall or a warning is read there afterwards)
            out_dir.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".log"), "w") as log:
                subprocess.run(launch + [sys.executable, __file__, "--worker", task, method, str(seed), "--budget",
                                         args.budget, "--out", str(out_dir), "--workers", p],
                               check=True, stdout=log, stderr=subprocess.STDOUT, text=True)
        r = json.loads(path.read_text())
        print(f"[{n}/{len(runs)}] {task:<14} {method:<17} seed {seed}: {r['metric']} {r['final']:.4f} "
              f"({r['seconds']:.0f} s)", flush=True)
    summarize(out_dir, args.tasks, args.methods, args.seeds, args.budget, plot=not args.no_plot, workers=args.workers)


if __name__ == "__main__":
    main()
