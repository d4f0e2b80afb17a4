#!/usr/bin/env python
"""TensorFlow: what TopKEF adds to the first training step (tracing the tf.function) and to later steps.

The training step of Horovod's own examples/tensorflow2/tensorflow2_synthetic_benchmark.py (a Keras application
model with weights=None, synthetic images, `hvd.DistributedGradientTape`, SGD, variables broadcast on the first
step), on 2 Horovod workers, once per method in the same run: dense allreduce, TopKEF at ratio 0.01, and TopKEF
with sparsity warm-up (`--warmup-steps`, default 100: a `tf.switch_case` per tensor with a dense branch and one
compressed branch whose sizes follow the step's k). Per method it prints the first step's time (trace + graph
optimisation + one step), the mean of the next steps, and the trace cost = first - later; a table compares them
with dense. The later steps of a 100-step warm-up go dense (its first k are large); `--warmup-steps 1` times the
compressed branch at the final k instead (its steps after the first).

Small images (--image, default 64) keep a step on this 2-core machine short: the trace cost depends on the
graph (number of variables and ops), not on the image size.

    python benchmarks/bench_tf_trace.py                              # ResNet-50, 2 workers (about 15 minutes here)
    python benchmarks/bench_tf_trace.py --methods topk0.01 topk0.01-warmup --warmup-steps 1 --steps 5
    python benchmarks/bench_tf_trace.py --model MobileNetV2 --image 96 --steps 5
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["dense", "topk0.01", "topk0.01-per-tensor", "topk0.01-warmup"]


def worker(args: argparse.Namespace) -> None:
    # Keras 2 (tf-keras), as Horovod's example was written for: its `opt.variables()` and Horovod's
    # broadcast_variables on Keras 3 variables do not run (Horovod issue #4290); the graph being timed is the same
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    import horovod.tensorflow as hvd

    from horovod_topk.tensorflow import TopKEF

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows = {}
    for method in args.methods:
        tf.keras.backend.clear_session()
        tf.random.set_seed(0)
        model = getattr(tf.keras.applications, args.model)(weights=None, input_shape=(args.image, args.image, 3))
        opt = tf.keras.optimizers.SGD(0.01)
        data = tf.random.uniform([args.batch, args.image, args.image, 3])
        target = tf.random.uniform([args.batch, 1], minval=0, maxval=999, dtype=tf.int64)
        compression = {"dense": hvd.Compression.none, "topk0.01": TopKEF(ratio=0.01),
                       "topk0.01-per-tensor": TopKEF(ratio=0.01, bucket_bytes=0),  # one allgather per tensor
                       "topk0.01-warmup": TopKEF(ratio=0.01, warmup_steps=args.warmup_steps)}[method]

        @tf.function
        def step(first_batch: bool) -> None:
            with tf.GradientTape() as tape:
                probs = model(data, training=True)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(target, probs))
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            if first_batch:
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(opt.variables(), root_rank=0)

        hvd.allreduce(tf.zeros(1), name=f"trace.start.{method}")
        start = time.perf_counter()
        step(tf.constant(True))
        first = time.perf_counter() - start
        later = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step(tf.constant(False))
            later.append(time.perf_counter() - start)
        # the largest time over ranks: a step ends for the job when its slowest rank ends it
        both = hvd.allgather_object((first, sum(later) / len(later)))
        rows[method] = (max(f for f, _ in both), max(l for _, l in both))
        if hvd.rank() == 0:
            print(f"  {method:<16} first step {rows[method][0]:7.1f} s, later steps {rows[method][1]:6.2f} s",
                  file=sys.stderr, flush=True)
    if hvd.rank() == 0:
        compressed = sum(1 for v in model.trainable_variables if v.shape.num_elements() >= 1024)
        print("TRACE " + json.dumps({"rows": rows, "variables": len(model.trainable_variables),
                                     "compressed": compressed}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ResNet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps timed after the first")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--warmup-steps", type=int, default=100, help="warmup_steps of topk0.01-warmup")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = ["horovodrun", "-np", "2", "-H", "localhost:2", sys.executable, str(Path(__file__).resolve()), "--worker",
           "--model", args.model, "--batch", str(args.batch), "--image", str(args.image), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--methods", *args.methods]
    # the workers' output is read as it comes, so that rank 0's line per finished method shows progress
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ})
    lines: List[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "first step" in line:
            print(re.sub(r"\[\d+(,\d+)?\]<std(out|err)>:", "", line).rstrip(), file=sys.stderr, flush=True)
    returncode = proc.wait()
    output = "".join(lines)
    m = re.search(r"TRACE (\{.*\})", output)
    if returncode != 0 or m is None:
        sys.exit(f"failed:\n{output[-6000:]}")
    result = json.loads(m.group(1))
    rows = result["rows"]
    print(f"{args.model}, {result['variables']} trainable variables ({result['compressed']} of >= 1024 entries, "
          f"compressed by TopKEF), batch {args.batch} of {args.image}x{args.image}, 2 workers")
    print("| method | first step (s) | later steps (s) | trace cost = first - later (s) | trace cost / dense's |")
    print("|---|---|---|---|---|")
    dense_trace = rows["dense"][0] - rows["dense"][1] if "dense" in rows else None
    for method, (first, later) in rows.items():
        rel = f"{(first - later) / dense_trace:.2f}x" if dense_trace else "–"
        print(f"| {method} | {first:.1f} | {later:.2f} | {first - later:.1f} | {rel} |")


if __name__ == "__main__":
    main()
