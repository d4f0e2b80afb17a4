#!/usr/bin/env python
"""TensorFlow: how long the Keras digits CNN's training step takes to trace, and its first and later calls.

The `tf.function` step of benchmarks/bench_tf_auto_step.py (the CNN of examples/digits_keras.py, a batch of 32, SGD,
`hvd.DistributedGradientTape`), one method per job; rank 0 prints the graph's op count (function library included),
the trace (`get_concrete_function`), the first call, the mean of 100 later calls, and auto's history. ``--root``
imports horovod_topk from another checkout (to compare two versions in alternating jobs).

    horovodrun -np 4 -H localhost:4 --gloo python benchmarks/probe_tf_trace_cnn.py --method 0.01
    horovodrun -np 4 -H localhost:4 --gloo python benchmarks/probe_tf_trace_cnn.py --method auto --root /tmp/other
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="0.01", help="dense, auto, or a ratio")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    sys.path.insert(0, args.root)
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf
    from digits_keras import digits_cnn

    from horovod_topk.tensorflow import TopKEF

    hvd.init()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(32, 8, 8, 1)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(32,)))
    tf.keras.utils.set_random_seed(0)
    model, opt = digits_cnn(), tf.keras.optimizers.SGD(0.01)
    compressor = None if args.method == "dense" else TopKEF(
        ratio="auto" if args.method == "auto" else float(args.method))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            logits = model(x)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        tape = hvd.DistributedGradientTape(tape, compression=compressor) if compressor else \
            hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    started = time.perf_counter()
    concrete = step.get_concrete_function()
    traced = time.perf_counter()
    step()
    first = time.perf_counter()
    for _ in range(30):
        step()
    later = time.perf_counter()
    for _ in range(100):
        step()
    done = time.perf_counter()
    graph = concrete.graph.as_graph_def()
    ops = len(graph.node) + sum(len(f.node_def) for f in graph.library.function)
    if hvd.rank() == 0:
        history = compressor.auto.history if compressor is not None and compressor.auto is not None else ""
        print(f"{args.method} ({args.root}): ops {ops}, trace {traced - started:.2f} s, first call "
              f"{first - traced:.2f} s, later {(done - later) / 100 * 1e3:.1f} ms {history}", flush=True)


if __name__ == "__main__":
    main()
