#!/usr/bin/env python
"""The first ``model.fit`` of a Keras 3 model with TopKEF, against dense: what a Keras 3 user waits for at start-up.

ResNet-50 from ``keras.applications`` (``weights=None``, 32x32 inputs, 10 classes) compiled with
``horovod.tensorflow.keras.DistributedOptimizer(SGD)``, one step of 8 images per ``fit``; the first ``fit``
traces and optimises the train function, the second only runs it. Keras 3 builds the optimizer's variables
before tracing, so any second trace of the train function would be TopKEF's doing (horovod_topk.tensorflow.state).
One process (``hvd.init()`` alone) unless run under ``horovodrun``; methods run one after the other in it.

    python benchmarks/bench_keras3_first_fit.py dense topk
"""
from __future__ import annotations

import os
import sys
import time

os.environ["TF_USE_LEGACY_KERAS"] = "0"  # Keras 3


def main() -> None:
    import keras
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras

    from horovod_topk.tensorflow import TopKEF

    methods = sys.argv[1:] or ["dense", "topk"]
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    print("| method | first fit (s) | second fit (s) |\n|---|---|---|")
    for method in methods:
        keras.utils.set_random_seed(0)
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        compression = {"dense": hvd.Compression.none, "topk": TopKEF(ratio=0.01)}[method]
        optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=compression)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy())
        rng = np.random.RandomState(hvd.rank())
        x, y = rng.rand(8, 32, 32, 3).astype(np.float32), rng.randint(0, 10, 8)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            times.append(time.perf_counter() - start)
        if hvd.rank() == 0:
            print(f"| {method} | {times[0]:.1f} | {times[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
