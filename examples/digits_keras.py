"""Train a small CNN on scikit-learn's digits with Horovod's Keras wrapper and TopKEF (TensorFlow 2).

Same data, model and schedule as digits_torch.py. Horovod 0.28.1's Keras wrapper needs Keras 2 behind tf.keras
(tf-keras with TF_USE_LEGACY_KERAS=1, set below before TensorFlow loads).

    horovodrun -np 2 -H localhost:2 python examples/digits_keras.py               # TopKEF, ratio 0.01
    horovodrun -np 2 -H localhost:2 python examples/digits_keras.py --dense       # plain Horovod, for comparison
"""
from __future__ import annotations

import math
import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
from digits_data import load_split, method_label, parse_args, summary_ratio, write_summary  # noqa: E402

from horovod_topk.tensorflow import TopKEF  # noqa: E402


def digits_cnn() -> tf.keras.Model:
    return tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu", input_shape=(8, 8, 1)),
        tf.keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


class Report(tf.keras.callbacks.Callback):
    """Rank 0 prints loss, test accuracy and bytes sent versus dense after every epoch."""

    def __init__(self, compressor, x_test, y_test, steps_per_epoch: int) -> None:
        super().__init__()
        self.compressor, self.x_test, self.y_test = compressor, x_test, y_test
        self.steps_per_epoch = steps_per_epoch
        self.accuracy = 0.0
        self.history = []
        self.epoch_start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        train_s = time.perf_counter() - self.epoch_start  # the epoch's training steps, before the evaluation
        self.accuracy = float((self.model.predict(self.x_test, verbose=0).argmax(1) == self.y_test).mean())
        self.history.append({"epoch": epoch + 1, "loss": float(logs["loss"]), "accuracy": self.accuracy,
                             "train_s": train_s, "steps": self.steps_per_epoch})
        if hvd.rank() == 0:
            line = f"epoch {epoch + 1:2d}  loss {logs['loss']:.4f}  test accuracy {self.accuracy:.4f}"
            if self.compressor is not None:
                s = self.compressor.stats()
                line += (f"  sent {s['bytes_sent'] / 1e6:.2f} MB vs dense {s['bytes_dense'] / 1e6:.2f} MB"
                         f" ({s['compression_ratio']:.1f}x less)")
            print(line, flush=True)


def main() -> None:
    args = parse_args(__doc__)

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_split(args.seed, hvd.rank(), hvd.size())
    x_train, x_test = x_train[..., None], x_test[..., None]

    compressor = None if args.dense else TopKEF(ratio=args.ratio)
    model = digits_cnn()
    opt = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9),
        compression=hvd.Compression.none if args.dense else compressor,
    )
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if hvd.rank() == 0:
        method = method_label(args)
        print(f"digits CNN (Keras): {model.count_params()} parameters, {hvd.size()} workers, {method}, "
              f"{len(x_train)} training images per worker, {len(x_test)} test images", flush=True)
    # the same number of steps on every worker, or one of them would wait for the other's gradients forever
    steps = int(hvd.allreduce(tf.constant(len(x_train) // args.batch_size), op=hvd_tf.Min, name="steps"))
    report = Report(compressor, x_test, y_test, steps)
    start = time.perf_counter()
    model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, steps_per_epoch=steps, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), report],
    )
    wall = time.perf_counter() - start
    if hvd.rank() == 0:
        print(f"done in {wall:.1f} s; final test accuracy {report.accuracy:.4f}", flush=True)
        dense_bytes = 4 * model.count_params() * steps * args.epochs  # float32 gradients, every step
        sent = dense_bytes if compressor is None else compressor.stats()["bytes_sent"]
        method = method_label(args)
        write_summary(args.summary, "Keras", method, report.history, sent, dense_bytes, wall,
                      ratio=summary_ratio(args, compressor),
                      tensors=[math.prod(int(d) for d in w.shape) for w in model.trainable_weights])


if __name__ == "__main__":
    main()
