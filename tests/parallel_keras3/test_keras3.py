"""TopKEF with Keras 3: model.fit through Horovod's Keras DistributedOptimizer, and DistributedGradientTape over
Keras 3 variables (horovod_topk.tensorflow.keras3 adapts Horovod 0.28.1 to both)."""
import importlib

import horovod.tensorflow as hvd
import keras
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.tensorflow import TopKEF

EVERYTHING = dict(ratio=1.0, min_numel=0, dense_fallback=False)


def _data(rank: int):
    rng = np.random.RandomState(100 + rank)  # every rank its own data: only a reduction can make them agree
    return rng.randn(64, 32).astype(np.float32), rng.randint(0, 4, 64)


def _model():
    keras.utils.set_random_seed(0)  # the same initial weights on every rank
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])


def _fit(compression, wrapper="horovod.tensorflow.keras", epochs=2, **options):
    model = _model()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    if compression is not None:
        optimizer = importlib.import_module(wrapper).DistributedOptimizer(optimizer, compression=compression,
                                                                          **options)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(hvd.rank())
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return [w.copy() for w in model.get_weights()]


def _assert_close(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")


def _same_on_every_rank(weights, name):
    gathered = hvd.allgather_object(weights, name=name)
    return all(all(np.array_equal(u, v) for u, v in zip(gathered[0], other)) for other in gathered[1:])


@pytest.mark.parametrize("wrapper", ["horovod.tensorflow.keras", "horovod.tensorflow"])
def test_fit_ratio_one_matches_plain_horovod_and_ranks_agree(wrapper):
    local = _fit(None)
    plain = _fit(hvd.Compression.none, wrapper)
    compressor = TopKEF(**EVERYTHING)
    ours = _fit(compressor, wrapper)
    _assert_close(ours, plain)
    # Horovod 0.28.1's own Keras wrapper never reduces under Keras 3: ranks would drift apart like `local`
    assert _same_on_every_rank(plain, f"plain.{wrapper}") and _same_on_every_rank(ours, f"ours.{wrapper}")
    assert not _same_on_every_rank(local, f"local.{wrapper}")
    stats = compressor.stats()
    assert stats["steps"] == 8 and stats["tensors_compressed"] == 6


def test_fit_at_one_percent_sends_less_and_keeps_ranks_in_step():
    compressor = TopKEF(ratio=0.01, min_numel=1024)
    ours = _fit(compressor, epochs=3)
    stats = compressor.stats()
    assert all(np.isfinite(w).all() for w in ours)
    assert _same_on_every_rank(ours, "one_percent")
    assert stats["tensors_compressed"] == 2 and stats["bytes_sent"] < stats["bytes_dense"] / 5


def test_the_wrapped_optimizer_keeps_its_class_name_and_config():
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5), compression=TopKEF)
    assert isinstance(opt, keras.optimizers.SGD) and type(opt).__name__ == "SGD"
    assert opt.get_config()["momentum"] == 0.5


def test_gradient_accumulation_through_horovod_is_refused_at_construction():
    import horovod.tensorflow.keras as hvd_keras

    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=TopKEF, backward_passes_per_step=2)


def _tape_train(compression, steps=4, use_function=True):
    model = _model()
    x, y = _data(hvd.rank())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        for var, g in zip(model.trainable_variables, grads):
            var.assign_sub(0.1 * g)

    run = tf.function(step) if use_function else step
    for s in range(steps):
        run(tf.constant(x[16 * s:16 * (s + 1)]), tf.constant(y[16 * s:16 * (s + 1)]))
    return [w.copy() for w in model.get_weights()]


@pytest.mark.parametrize("use_function", [True, False], ids=["function", "eager"])
def test_tape_over_keras3_variables_ratio_one_matches_plain_horovod(use_function):
    plain = _tape_train(hvd.Compression.none, use_function=use_function)
    compressor = TopKEF(**EVERYTHING)
    ours = _tape_train(compressor, use_function=use_function)
    _assert_close(ours, plain)
    assert _same_on_every_rank(ours, f"tape.{use_function}")
    assert not all(np.array_equal(u, v) for u, v in zip(ours, _model().get_weights())), "the model must train"
    if use_function:  # eagerly, unnamed gradients have no stable key and go dense (see README)
        assert compressor.stats()["steps"] == 4 and compressor.stats()["tensors_compressed"] == 6


@pytest.mark.parametrize("wrapper", ["horovod.tensorflow.keras", "horovod.tensorflow"])
def test_fit_in_buckets_equals_the_per_tensor_exchange(wrapper, monkeypatch):
    """Keras 3 through either wrapper: the compressed kernels and biases travel in one allgather per step (one
    bucket), and the weights are those of one allgather per tensor, bit for bit."""
    from tests.tf_allgathers import record_allgathers, topk_exchanges

    names = record_allgathers(monkeypatch)
    ours = _fit(TopKEF(ratio=0.05, min_numel=0), wrapper)
    bucketed = topk_exchanges(names)
    names.clear()
    theirs = _fit(TopKEF(ratio=0.05, min_numel=0, bucket_bytes=0), wrapper)
    per_tensor = topk_exchanges(names)
    for i, (u, v) in enumerate(zip(ours, theirs)):
        np.testing.assert_array_equal(u, v, err_msg=f"weight {i}")
    assert len(bucketed) == 1 and bucketed[0].startswith("topk.bucket.") and ".6." in bucketed[0]
    assert len(per_tensor) == 6 and not any(n.startswith("topk.bucket.") for n in per_tensor)
