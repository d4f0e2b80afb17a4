"""TensorFlow: what ratio="auto"'s traced step costs over dense when it stays dense, in one process (no link).

    python benchmarks/bench_tf_auto_step.py --steps 300 --rounds 3
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_tf_auto_step.py --steps 300 --rounds 3

The Keras digits CNN (examples/digits_keras.py), a batch of 32, SGD, one ``tf.function`` step through
``hvd.DistributedGradientTape``. Alone (``hvd.init()`` in one process) the collectives are local, so what differs
between the rows is the graph around them (auto: per compressed tensor a ``tf.switch_case`` over its routes and
two stamps, one host tick per step); under horovodrun the collectives are real, and the methods are compared side
by side in one job. Methods alternate within each round; each gets a fresh model, 30 untimed steps (tracing,
auto's first decisions), then ``--steps`` timed ones. Rank 0 prints the median step per method and its ratio to
dense.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from digits_keras import digits_cnn  # noqa: E402
from horovod_topk.tensorflow import TopKEF  # noqa: E402

METHODS = ("dense", "0.01", "auto")


def step_ms(method: str, steps: int) -> "tuple[float, object]":
    """Milliseconds per timed step of ``method``, and (auto) the density in force at the end."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(32, 8, 8, 1)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(32,)))
    tf.keras.utils.set_random_seed(0)
    model = digits_cnn()
    opt = tf.keras.optimizers.SGD(0.01)
    compressor = None if method == "dense" else TopKEF(ratio="auto" if method == "auto" else float(method))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            logits = model(x)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        tape = (hvd.DistributedGradientTape(tape, compression=compressor) if compressor is not None
                else hvd.DistributedGradientTape(tape))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(30):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - started) / steps * 1e3
    chosen = compressor.auto.ratio if compressor is not None and compressor.auto is not None else None
    return ms, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    hvd.init()
    times = {m: [] for m in METHODS}
    chosen = None
    for _ in range(args.rounds):
        for method in METHODS:
            ms, ratio = step_ms(method, args.steps)
            times[method].append(ms)
            if method == "auto":
                chosen = ratio
    if hvd.rank() != 0:
        return
    dense = statistics.median(times["dense"])
    print(f"tensorflow {tf.__version__}, {hvd.size()} worker(s), {args.steps} steps x {args.rounds} rounds; auto chose "
          f"{'dense' if chosen is None else chosen}")
    print("| method | ms per step (each round) | median | / dense |")
    print("|---|---|---|---|")
    for method in METHODS:
        med = statistics.median(times[method])
        runs = ", ".join(f"{t:.2f}" for t in times[method])
        print(f"| {method} | {runs} | {med:.2f} | {med / dense:.2f}x |")


if __name__ == "__main__":
    main()
