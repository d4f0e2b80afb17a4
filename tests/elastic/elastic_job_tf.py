"""A Horovod elastic TensorFlow job with TopKEF tracked by its TensorFlowKerasState (launched by test_elastic_tf.py).

Same scenario as elastic_job.py (PyTorch): it starts on one host, adds a second at JOIN_STEP, and the worker on
the added host dies (os._exit) between two commits once KILL_STEP is passed; the survivor rolls back and goes on
alone. The training step is a tf.function made inside the elastic function, so that it is traced again after each
reset (the world size is a constant of the trace). One JSON line per step, start and reset.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from horovod_topk.tensorflow import TopKEF  # noqa: E402

JOIN_STEP, KILL_STEP, LAST_STEP, MAX_STEPS, STEP_SECONDS, COMMIT_EVERY = 5, 45, 70, 300, 0.25, 5
hosts_file, log_file, added_host = sys.argv[1:4]

hvd.init()
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.layers.Dense(128, activation="relu", input_shape=(32,)),
                             tf.keras.layers.Dense(4)])
opt = tf.keras.optimizers.legacy.SGD(0.05)  # TensorFlowKerasState calls optimizer.variables()
_ = opt.iterations  # created now on every worker: a joining worker's sync broadcasts the same variables
compressor = TopKEF(ratio=0.02, min_numel=256)
# TensorFlowKerasState, not TensorFlowState: the latter broadcasts its variables in its constructor (eagerly), which
# a joining worker would run alone
state = compressor.elastic_state(hvd.elastic.TensorFlowKerasState(model, opt, step=0))


def log(event: str) -> None:
    records = dict(compressor.registry)
    line = {
        "event": event, "rank": hvd.rank(), "size": hvd.size(), "host": os.environ.get("HOROVOD_HOSTNAME"),
        "step": state.step,
        "steps": {n: int(c.numpy()[0]) for n, c in compressor._counter_vars.items()},
        "world": {n: r.world_size for n, r in records.items()},
        "residual_sq": {n: float(np.square(r.numpy().astype(np.float64)).sum())
                        for n, r in compressor._residual_vars.items()},
        "params": float(sum(t.numpy().astype(np.float64).sum() for t in model.variables)),
    }
    with open(log_file, "a") as f:
        f.write(json.dumps(line) + "\n")


state.register_reset_callbacks([lambda: log("reset")])


@hvd.elastic.run
def train(state):
    log("start")  # after the sync: what a new worker has

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
        tape = hvd.DistributedGradientTape(tape, compression=compressor)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    while state.step < LAST_STEP or (not os.path.exists(hosts_file + ".killed") and state.step < MAX_STEPS):
        r = np.random.RandomState(1000 * hvd.rank() + state.step)
        step(tf.constant(r.randn(16, 32).astype(np.float32)), tf.constant(r.randint(0, 4, 16), tf.int32))
        state.step += 1
        log("step")
        time.sleep(STEP_SECONDS)
        if state.step == JOIN_STEP and hvd.size() == 1 and not os.path.exists(hosts_file + ".joined"):
            open(hosts_file + ".joined", "w").close()
            with open(hosts_file, "a") as f:
                f.write(f"{added_host}:1\n")
        if state.step >= KILL_STEP and state.step % COMMIT_EVERY == 3 and hvd.size() == 2 \
                and os.environ.get("HOROVOD_HOSTNAME") == added_host and not os.path.exists(hosts_file + ".killed"):
            open(hosts_file + ".killed", "w").close()
            os._exit(1)
        if state.step % COMMIT_EVERY == 0:
            state.commit()


train(state)
log("done")
