"""TensorFlow: what ratio="auto"'s traced step costs over dense when it stays dense, in one process (no link).

    python benchmarks/bench_tf_auto_step.py --steps 300 --rounds 3
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/bench_tf_auto_step.py --steps 300 --rounds 3
    scripts/testbed.sh run 4 --rate 100mbit -- "$PWD/.venv/bin/python" benchmarks/bench_tf_auto_step.py --steps 100

The Keras digits CNN (examples/digits_keras.py), a batch of 32, SGD, one ``tf.function`` step through
``hvd.DistributedGradientTape``. Alone (``hvd.init()`` in one process) the collectives are local, so what differs
between the rows is the graph around them (``fp16``: Horovod's own ``Compression.fp16``; auto: per bucket a ``tf.switch_case`` over its members' routes,
``auto-per-tensor`` one per compressed tensor; two stamps per tensor, one host tick per step; ``auto-no-fp16`` without
fp16 among the choices, so without its float16 branch, and the small tensors go to Horovod directly); under horovodrun
the collectives are real, and the methods are compared side
by side in one job. Methods alternate within each round; each gets a fresh model, 30 untimed steps (tracing,
auto's first decisions), then ``--steps`` timed ones. Rank 0 prints the median step per method and its ratio to
dense. ``--ablate`` adds auto with one part replaced at a time (its dense branch by Horovod's bare allreduce, its
stamps by nothing, its tick by a constant): what each part costs.
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

from horovod_topk.tensorflow import auto_density, compressor as tf_compressor  # noqa: E402

METHODS = ("dense", "fp16", "0.01", "auto", "auto-no-fp16", "auto-per-tensor")
#: --ablate: auto with one of its parts replaced, to see what each costs (not a working compressor: timing only)
ABLATIONS = ("auto-plain-dense", "auto-no-stamps", "auto-no-tick")
_PARTS = {"call": auto_density.AutoTick._call, "ready": auto_density.AutoTick.ready,
          "done": auto_density.AutoTick.done, "dense": tf_compressor.TopKEF._dense_reduce}


def ablate(method: str) -> None:
    """Put auto's parts back, then replace the one ``method`` names: the dense branch by Horovod's bare allreduce
    (no leftovers, no counters), the stamps by nothing, or the tick by a constant position (dense)."""
    auto_density.AutoTick._call = _PARTS["call"]
    auto_density.AutoTick.ready = _PARTS["ready"]
    auto_density.AutoTick.done = _PARTS["done"]
    tf_compressor.TopKEF._dense_reduce = _PARTS["dense"]
    if method == "auto-no-tick":
        auto_density.AutoTick._call = lambda self: tf.constant(0, tf.int32)
    elif method == "auto-no-stamps":
        auto_density.AutoTick.ready = lambda self, name, tensor, position: tf.no_op()
        auto_density.AutoTick.done = lambda self, name, reduced, ready_stamp: reduced
    elif method == "auto-plain-dense":
        from horovod.tensorflow.mpi_ops import Average, _allreduce

        def plain(self, step, *, op_name, prescale_factor, postscale_factor):
            flat = _allreduce(tf.reshape(step.tensor, [-1]), name=f"{step.name}.dense", op=Average,
                              ignore_name_scope=True, process_set=step.process_set)
            return tf.reshape(flat, step.shape)

        tf_compressor.TopKEF._dense_reduce = plain


def step_ms(method: str, steps: int) -> "tuple[float, object]":
    """Milliseconds per timed step of ``method``, and (auto) the density in force at the end."""
    ablate(method)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(32, 8, 8, 1)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(32,)))
    tf.keras.utils.set_random_seed(0)
    model = digits_cnn()
    opt = tf.keras.optimizers.SGD(0.01)
    buckets = {"bucket_bytes": 0} if method.endswith("-per-tensor") else {}  # every tensor its own switch_case
    compressor = (None if method in ("dense", "fp16") else
                  TopKEF(ratio="auto" if method.startswith("auto") else float(method), **buckets))
    horovod_fp16 = {"compression": hvd.Compression.fp16} if method == "fp16" else {}
    if method == "auto-no-fp16":  # fp16 not among the choices: no float16 branch, small tensors straight to Horovod
        compressor.auto.half = False

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            logits = model(x)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        tape = (hvd.DistributedGradientTape(tape, compression=compressor) if compressor is not None
                else hvd.DistributedGradientTape(tape, **horovod_fp16))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(30):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - started) / steps * 1e3
    chosen = None
    if compressor is not None and compressor.auto is not None:
        chosen = compressor.auto.ratio
        if hvd.rank() == 0 and method == "auto":  # what it chose, and why (the last decision's line)
            print(f"# {method}: {compressor.auto.summary_line()}; history {compressor.auto.history}", flush=True)
    return ms, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ablate", action="store_true", help="also time auto with each of its parts replaced")
    args = parser.parse_args()
    hvd.init()
    methods = METHODS + (ABLATIONS if args.ablate else ())
    times = {m: [] for m in methods}
    chosen = None
    for _ in range(args.rounds):
        for method in methods:
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
    for method in methods:
        med = statistics.median(times[method])
        runs = ", ".join(f"{t:.2f}" for t in times[method])
        print(f"| {method} | {runs} | {med:.2f} | {med / dense:.2f}x |")


if __name__ == "__main__":
    main()
