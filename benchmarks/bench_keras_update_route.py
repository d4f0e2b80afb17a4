#!/usr/bin/env python
"""Keras: the step time of update mode under ratio="auto" against Horovod's dense and fp16, side by side in one job.

The Keras digits CNN (examples/digits_keras.py), a batch of 32 per worker, Adam through
``horovod.tensorflow.keras.DistributedOptimizer`` in ``model.fit`` (Keras 2). Methods: ``dense`` and ``fp16``
(Horovod's own allreduce and ``Compression.fp16``), ``auto-update`` (``TopKEF(ratio="auto")``, which takes update mode
for Adam; while it holds dense or fp16 its steps run as gradient mode), ``auto-gradient``
(``TopKEF(ratio="auto", target="gradient")``). The methods alternate within each round; each gets a fresh model and
one ``fit`` of ``--warmup`` + ``--steps`` batches; the step is the median time between batch ends over the last
``--steps`` (auto's first decisions are in the warm-up). Rank 0 prints the table and what auto held. ``--root``
imports horovod_topk from another checkout (two versions compared in alternating jobs).

    horovodrun -np 4 -H localhost:4 --gloo python benchmarks/bench_keras_update_route.py
    scripts/testbed.sh run 4 --rate 100mbit -- "$PWD/.venv/bin/python" benchmarks/bench_keras_update_route.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

METHODS = ("dense", "fp16", "auto-update", "auto-gradient")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    sys.path.insert(0, args.root)
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import numpy as np
    import tensorflow as tf
    from digits_keras import digits_cnn

    from horovod_topk.tensorflow import TopKEF

    hvd.init()
    batches = args.warmup + args.steps
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(32 * batches, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=(32 * batches,))

    class Clock(tf.keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    def run(method: str) -> "tuple[float, float, str]":
        tf.keras.backend.clear_session()
        tf.keras.utils.set_random_seed(0)
        model = digits_cnn()
        compressor = None
        if method == "fp16":
            compression = hvd.Compression.fp16
        elif method.startswith("auto"):
            compression = compressor = TopKEF(ratio="auto", target=method.split("-")[1])
        else:
            compression = hvd.Compression.none
        model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3), compression=compression),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        clock = Clock()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
        times = np.diff(clock.ends)
        held = "" if compressor is None else \
            f"{compressor.auto.ratio if compressor.auto.ratio is not None else 'dense'} ({compressor.auto.history})"
        return float(statistics.median(times[args.warmup:])) * 1e3, float(times[0]), held

    results = {m: [] for m in args.methods}
    for _ in range(args.rounds):
        for method in args.methods:
            results[method].append(run(method))
    if hvd.rank() != 0:
        return
    print(f"tensorflow {tf.__version__}, {hvd.size()} workers, horovod_topk from {args.root}, "
          f"{args.steps} timed steps after {args.warmup}, {args.rounds} rounds")
    print("| method | ms per step (each round) | median | first step s | auto held (history) |")
    print("|---|---|---|---|---|")
    for method, rows in results.items():
        per_round = ", ".join(f"{r[0]:.1f}" for r in rows)
        print(f"| {method} | {per_round} | {statistics.median(r[0] for r in rows):.1f} | "
              f"{', '.join(f'{r[1]:.1f}' for r in rows)} | {'; '.join(r[2] for r in rows if r[2])} |")


if __name__ == "__main__":
    main()
