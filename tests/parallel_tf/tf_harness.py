"""A small model of raw variables and a GradientTape training loop for the TensorFlow multi-worker tests."""
from typing import Callable, Dict, Optional

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf


def make_variables() -> Dict[str, tf.Variable]:
    """Two compressible matrices (2048 entries), small dense ones, and an embedding (IndexedSlices gradients)."""
    rng = np.random.RandomState(0)

    def var(name, *shape):
        return tf.Variable((rng.randn(*shape) * 0.1).astype(np.float32), name=name)

    return {"w1": var("w1", 32, 64), "b1": var("b1", 64), "w2": var("w2", 64, 32), "head": var("head", 32, 4),
            "emb": var("emb", 100, 16)}


def batch(step: int):
    rng = np.random.RandomState(1000 * hvd.rank() + step)
    return (tf.constant(rng.randn(16, 32).astype(np.float32)), tf.constant(rng.randint(0, 100, 16), tf.int32),
            tf.constant(rng.randint(0, 4, 16), tf.int32))


def loss_fn(v: Dict[str, tf.Variable], x, tokens, y):
    h = tf.nn.relu(x @ v["w1"] + v["b1"] + tf.tile(tf.gather(v["emb"], tokens), [1, 4]))
    logits = tf.nn.relu(h @ v["w2"]) @ v["head"]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def apply(v: Dict[str, tf.Variable], names, grads, lr: float = 0.1) -> None:
    for name, g in zip(names, grads):
        if isinstance(g, tf.IndexedSlices):
            v[name].scatter_sub(tf.IndexedSlices(lr * g.values, g.indices))
        else:
            v[name].assign_sub(lr * g)


def train_tape(compression, steps: int = 4, *, use_function: bool = True,
               on_grads: Optional[Callable] = None, **tape_kwargs) -> Dict[str, np.ndarray]:
    """``steps`` steps of SGD with hvd.DistributedGradientTape; returns the final variables.

    ``on_grads(step, names, local_grads, reduced_grads)`` sees this rank's own gradients next to the reduced ones.
    """
    v = make_variables()
    names = sorted(v)

    def step(x, tokens, y):
        with tf.GradientTape(persistent=on_grads is not None) as tape:
            loss = loss_fn(v, x, tokens, y)
        local = tape.gradient(loss, [v[n] for n in names]) if on_grads is not None else None
        reduced = hvd.DistributedGradientTape(tape, compression=compression, **tape_kwargs).gradient(
            loss, [v[n] for n in names])
        apply(v, names, reduced)
        return local, reduced

    run = tf.function(step) if use_function else step
    for s in range(steps):
        local, reduced = run(*batch(s))
        if on_grads is not None:
            on_grads(s, names, local, reduced)
    return {n: v[n].numpy() for n in names}


def assert_same(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)
