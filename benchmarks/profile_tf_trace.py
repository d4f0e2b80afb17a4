#!/usr/bin/env python
"""Where TopKEF's first TensorFlow step goes, on a small synthetic model.

A ``tf.function`` training step with ``hvd.DistributedGradientTape`` over ``--layers`` dense layers (a weight
matrix and a bias each; the matrices are compressed, the biases stay dense), once per method in the same process
so that the numbers compare side by side. Per method it reports:

- ``trace``: Python tracing, ``get_concrete_function`` (the FuncGraph is built, nothing runs);
- ``first``: the first call of that concrete function (graph instantiation + Grappler + one step);
- ``later``: the mean of the next calls, so ``first - later`` is mostly graph optimisation;
- ``ops`` and ``ops/tensor``: nodes of the graph, the function library (tf.cond branches) included, and the
  nodes each compressed tensor adds over dense's graph;
- with ``--profile N``: cProfile's N most expensive functions (cumulative) of the trace.

One worker by default (``hvd.init()`` alone: on one rank the exchange is the allgather, as on 2); run it under
``horovodrun -np 2 -H localhost:2 --gloo`` for two.

    python benchmarks/profile_tf_trace.py
    python benchmarks/profile_tf_trace.py --methods topk topk-exact --profile 25
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/profile_tf_trace.py --layers 60 --steps 20 \
        --methods dense topk topk-per-tensor        # buckets against one allgather per tensor
    horovodrun -np 4 -H localhost:4 --gloo python benchmarks/profile_tf_trace.py --layers 60 --steps 100 \
        --methods topk topk-sparse topk-sparse-per-tensor   # the sparse allreduce per bucket and per tensor
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any, Dict

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

METHODS = ("dense", "topk", "topk-per-tensor", "topk-sparse", "topk-sparse-per-tensor", "topk-exact", "topk-warmup",
           "topk-warmup-per-tensor")


def op_count(graph_def: Any) -> int:
    """Nodes of the graph and of every function in its library (the branches of tf.cond / tf.switch_case)."""
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20, help="dense layers (a compressed matrix + a bias each)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--model", default="", help="a tf.keras.applications model (e.g. ResNet50) instead of the layers")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--bucket-bytes", type=int, default=None, help="topk's bucket_bytes (default: TopKEF's)")
    parser.add_argument("--profile", type=int, default=0, help="print the N top functions of the trace (cProfile)")
    parser.add_argument("--profile-only", default="", metavar="REGEX",
                        help="with --profile: only functions whose file:line(name) matches REGEX (e.g. horovod_topk)")
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd

    from horovod_topk.tensorflow import TopKEF

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows: Dict[str, Dict[str, float]] = {}
    compressed = args.layers  # tensors TopKEF compresses (>= 1024 entries): the layers' matrices, or the model's
    for method in args.methods:
        rng = np.random.RandomState(0)
        if args.model:
            tf.keras.backend.clear_session()
            model = getattr(tf.keras.applications, args.model)(weights=None, input_shape=(32, 32, 3))
            variables = model.trainable_variables
            compressed = sum(1 for v in variables if v.shape.num_elements() >= 1024)
            images = tf.constant(rng.rand(2, 32, 32, 3).astype(np.float32))
        else:
            weights = [tf.Variable(rng.randn(args.width, args.width).astype(np.float32) * 0.05)
                       for _ in range(args.layers)]
            biases = [tf.Variable(np.zeros(args.width, np.float32)) for _ in range(args.layers)]
            variables = [v for pair in zip(weights, biases) for v in pair]
        x = tf.constant(rng.randn(8, args.width).astype(np.float32))
        buckets = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
        compression = {"dense": hvd.Compression.none, "topk": TopKEF(ratio=0.01, **buckets),
                       # every tensor in its own allgather (bucket_bytes=0), against topk's buckets
                       "topk-per-tensor": TopKEF(ratio=0.01, bucket_bytes=0),
                       # the sparse allreduce: one alltoall + one allgather per bucket, against two per tensor
                       "topk-sparse": TopKEF(ratio=0.01, exchange="sparse_allreduce", **buckets),
                       "topk-sparse-per-tensor": TopKEF(ratio=0.01, exchange="sparse_allreduce", bucket_bytes=0),
                       "topk-exact": TopKEF(ratio=0.01, selector="exact"),
                       "topk-warmup": TopKEF(ratio=0.01, warmup_steps=args.warmup_steps, **buckets),
                       "topk-warmup-per-tensor": TopKEF(ratio=0.01, warmup_steps=args.warmup_steps,
                                                        bucket_bytes=0)}[method]

        @tf.function
        def step() -> None:
            with tf.GradientTape() as tape:
                if args.model:
                    loss = tf.reduce_mean(model(images, training=True))
                else:
                    h = x
                    for w, b in zip(weights, biases):
                        h = tf.nn.tanh(h @ w + b)
                    loss = tf.reduce_mean(h * h)
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            for v, g in zip(variables, tape.gradient(loss, variables)):
                v.assign_sub(0.01 * g)

        profiler = cProfile.Profile() if args.profile else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        concrete = step.get_concrete_function()
        if profiler is not None:
            profiler.disable()
        trace = time.perf_counter() - start
        ops = op_count(concrete.graph.as_graph_def())
        start = time.perf_counter()
        concrete()
        first = time.perf_counter() - start
        later = []
        for _ in range(args.steps):
            start = time.perf_counter()
            concrete()
            later.append(time.perf_counter() - start)
        rows[method] = {"trace": trace, "first": first, "later": sum(later) / len(later), "ops": ops}
        if profiler is not None and hvd.rank() == 0:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(
                *([args.profile_only] if args.profile_only else []), args.profile)
            print(f"--- cProfile of {method}'s trace ---\n{out.getvalue()}", file=sys.stderr)
    if hvd.rank() != 0:
        return
    dense_ops = rows["dense"]["ops"] if "dense" in rows else None
    what = args.model or f"{args.layers} layers of {args.width}x{args.width} (+ bias)"
    print(f"{what}, {compressed} compressed tensors, {hvd.size()} worker(s)")
    print("| method | trace (s) | first call (s) | later (s) | ops | ops per compressed tensor over dense |")
    print("|---|---|---|---|---|---|")
    for method, r in rows.items():
        per = f"{(r['ops'] - dense_ops) / compressed:.0f}" if dense_ops is not None else "-"
        print(f"| {method} | {r['trace']:.2f} | {r['first']:.2f} | {r['later']:.3f} | {r['ops']:.0f} | {per} |")


if __name__ == "__main__":
    main()
