"""Update mode through the Keras optimizer wrappers, on 2 real Horovod workers: the cases both Keras suites run.

tests/parallel_tf (Keras 2 behind tf.keras) and tests/parallel_keras3 (Keras 3) import these tests; the Keras under
``tf.keras`` is whichever the suite's conftest chose before TensorFlow loaded. Every test issues the same
collectives in the same order on every rank and asserts after them.
"""
import importlib

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core import RankMismatch
from horovod_topk.tensorflow import TopKEF
from horovod_topk.tensorflow.update_mode import update_keys

keras = tf.keras
EVERYTHING = dict(ratio=1.0, min_numel=0, dense_fallback=False)
WRAPPERS = ["horovod.tensorflow.keras", "horovod.tensorflow"]


def _model(seed: int = 0):
    keras.backend.clear_session()  # the same layer names (hence residual keys) as a new process would give
    keras.utils.set_random_seed(seed)  # the same initial weights on every rank
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])


def _batches(steps: int, rank: int):
    rng = np.random.RandomState(100 + rank)  # every rank its own data: only the exchange makes them agree
    return [(rng.randn(16, 32).astype(np.float32), rng.randint(0, 4, 16)) for _ in range(steps)]


def _wrap(optimizer, compression, wrapper="horovod.tensorflow.keras", **options):
    return importlib.import_module(wrapper).DistributedOptimizer(optimizer, compression=compression, **options)


def _loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _train_step(model, optimizer):
    loss_fn = _loss_fn()

    @tf.function
    def step(x, y, poison):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [grads[0] * poison] + list(grads[1:])  # poison = NaN puts a NaN in this rank's first gradient
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    return step


def _adam_training(second_moment="auto"):
    """A model, update mode's compressor (ratio 0.05), a wrapped Adam and the traced step over them ("auto" is the
    calibrated second moment for Keras's Adam)."""
    model = _model()
    compressor = TopKEF(ratio=0.05, min_numel=256, target="update", second_moment=second_moment)
    optimizer = _wrap(keras.optimizers.Adam(1e-2), compressor)
    return model, compressor, optimizer, _train_step(model, optimizer)


def _weights(model):
    return [w.copy() for w in model.get_weights()]


def _same_on_every_rank(arrays, name):
    gathered = hvd.allgather_object([np.asarray(a) for a in arrays], name=name)
    return all(all(np.array_equal(u, v) for u, v in zip(gathered[0], other)) for other in gathered[1:])


def _residuals(compressor):
    state = compressor.state_dict()["tensors"]
    return {key: np.asarray(entry["residual"], np.float64) for key, entry in state.items()
            if entry.get("residual") is not None}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_update_mode_sgd_at_ratio_one_trains_as_dense_horovod(wrapper):
    """SGD without momentum: the update is lr times the gradient, so averaging updates is averaging gradients."""
    def fit(compression):
        model = _model()
        model.compile(optimizer=_wrap(keras.optimizers.SGD(0.1), compression, wrapper), loss=_loss_fn())
        x, y = _batches(1, hvd.rank())[0]
        model.fit(np.repeat(x, 4, 0), np.repeat(y, 4, 0), batch_size=16, epochs=2, shuffle=False, verbose=0)
        return _weights(model)

    plain = fit(hvd.Compression.none)
    compressor = TopKEF(target="update", **EVERYTHING)
    ours = fit(compressor)
    for i, (u, v) in enumerate(zip(ours, plain)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")
    assert _same_on_every_rank(ours, f"update.sgd.{wrapper}")
    stats = compressor.stats()
    assert stats["steps"] == 8 and stats["tensors_compressed"] == 6


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_update_mode_adam_error_feedback_invariant_and_identical_ranks(exchange):
    """Per step and tensor: sum of the ranks' new residuals + P * applied == sum of (old residual + local update),
    where the local update is what a plain Adam (the same hyperparameters, the same gradients) does to a twin of the
    variables; and every rank's parameters are the same bytes."""
    size = hvd.size()
    model, twin = _model(), _model()
    compressor = TopKEF(ratio=0.05, min_numel=256, exchange=exchange, target="update", second_moment="local")
    optimizer = _wrap(keras.optimizers.Adam(1e-2), compressor)
    plain = keras.optimizers.Adam(1e-2)
    step = _train_step(model, optimizer)
    key = update_keys(model.trainable_variables)[0]  # the first kernel (32 x 64): compressed
    for i, (x, y) in enumerate(_batches(4, hvd.rank())):
        before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
        old = _residuals(compressor)
        grads = step(x, y, tf.constant(1.0))
        twin_before = [v.numpy().astype(np.float64) for v in twin.trainable_variables]
        plain.apply_gradients(zip(grads, twin.trainable_variables))
        local = [b - v.numpy().astype(np.float64) for b, v in zip(twin_before, twin.trainable_variables)]
        applied = [b - v.numpy().astype(np.float64) for b, v in zip(before, model.trainable_variables)]
        new = _residuals(compressor)
        gathered = hvd.allgather_object((old.get(key, np.zeros_like(new[key])), new[key], local[0].reshape(-1)),
                                        name=f"invariant.{exchange}.{i}")
        total_old = sum(o + u for o, _, u in gathered)
        total_new = sum(n for _, n, _ in gathered)
        np.testing.assert_allclose(total_new + size * applied[0].reshape(-1), total_old, rtol=1e-5, atol=1e-7)
        assert np.abs(total_new).sum() > 0  # something was held back: Top-K did select
        assert _same_on_every_rank(_weights(model), f"identical.{exchange}.{i}")
    assert compressor.stats()["bytes_sent"] < compressor.stats()["bytes_dense"] / 2


def test_update_mode_one_rank_nonfinite_skips_the_step_on_every_rank():
    """A NaN in one rank's gradient: no rank changes its parameters, optimizer state or residuals; the next finite
    step trains on."""
    model, compressor, optimizer, step = _adam_training()
    batches = _batches(3, hvd.rank())
    step(*batches[0], tf.constant(1.0))
    weights, residuals = _weights(model), _residuals(compressor)
    state = [v.numpy().copy() for v in optimizer.variables]
    iterations = int(optimizer.iterations.numpy())
    poison = tf.constant(float("nan") if hvd.rank() == 1 else 1.0)
    step(*batches[1], poison)
    unchanged = all(np.array_equal(a, b) for a, b in zip(weights, _weights(model)))
    residuals_after = _residuals(compressor)
    kept = bool(residuals) and all(np.array_equal(residuals[k], residuals_after[k]) for k in residuals)
    kept = kept and all(np.array_equal(a, v.numpy()) for a, v in zip(state, optimizer.variables))
    skipped = int(optimizer.iterations.numpy()) == iterations
    step(*batches[2], tf.constant(1.0))
    finite = all(np.isfinite(w).all() for w in _weights(model)) and all(
        np.isfinite(r).all() for r in _residuals(compressor).values())
    moved = not all(np.array_equal(a, b) for a, b in zip(weights, _weights(model)))
    same = _same_on_every_rank(_weights(model), "nonfinite.same")
    assert unchanged and kept and skipped, (unchanged, kept, skipped)
    assert finite and moved and same


@pytest.mark.parametrize("second_moment", ["local", "calibrated"])
def test_update_mode_resumes_exactly_from_a_checkpoint(second_moment):
    """Residuals (TopKEF.state_dict) and this rank's optimizer state saved after 2 steps: a new model, optimizer and
    compressor loaded from them take steps 3-4 exactly as the uninterrupted run did (the calibrated sketch's signs
    follow the optimizer's iterations, which the optimizer state carries)."""
    batches = _batches(4, hvd.rank())

    model, compressor, optimizer, step = _adam_training(second_moment)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            saved = (_weights(model), compressor.state_dict(), [v.numpy() for v in optimizer.variables])
        step(x, y, tf.constant(1.0))
    straight = _weights(model)

    model, compressor, optimizer, step = _adam_training(second_moment)
    model.set_weights(saved[0])
    compressor.load_state_dict(saved[1])
    optimizer.build(model.trainable_variables)
    for variable, value in zip(optimizer.variables, saved[2]):
        variable.assign(value)
    for x, y in batches[2:]:
        step(x, y, tf.constant(1.0))
    resumed = _weights(model)
    assert all(np.array_equal(a, b) for a, b in zip(straight, resumed))


def test_update_mode_ranks_in_different_modes_raise_instead_of_hanging():
    """Rank 0 in update mode, the others in gradient mode: the first traced step raises RankMismatch naming the
    target on every rank (the agreement check runs under the gradient's reduction name in both modes)."""
    model = _model()
    target = "update" if hvd.rank() == 0 else "gradient"
    optimizer = _wrap(keras.optimizers.SGD(0.1), TopKEF(ratio=0.05, min_numel=256, target=target))
    model.compile(optimizer=optimizer, loss=_loss_fn())
    x, y = _batches(1, hvd.rank())[0]
    with pytest.raises(RankMismatch, match="target"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_update_mode_refuses_what_it_cannot_do_by_name():
    import horovod.tensorflow.keras as hvd_keras

    with tf.GradientTape() as tape:
        tf.reduce_sum(tf.Variable(1.0) * 2.0)
    with pytest.raises(ValueError, match="gradient tape only returns gradients.*target='gradient'"):
        hvd.DistributedGradientTape(tape, compression=TopKEF(target="update"))
    with pytest.raises(ValueError, match="hands over gradients only"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 compression=TopKEF(target="update"))
    for wrapper in (hvd_keras.DistributedOptimizer, hvd.DistributedOptimizer):  # the latter drops op for Keras
        with pytest.raises(ValueError, match="op=hvd.Average"):
            wrapper(keras.optimizers.SGD(0.1), compression=TopKEF(target="update"), op=hvd.Sum)
    with pytest.raises(ValueError, match="register_local_var is not supported"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                       compression=TopKEF(target="update")).register_local_var(tf.Variable(1.0))
    with pytest.raises(ValueError, match="second_moment='shared'.*PyTorch's.*second_moment='calibrated'"):
        hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.1),
                                       compression=TopKEF(target="update", second_moment="shared"))
    calibrated = TopKEF(target="update", second_moment="calibrated")
    for cannot in (keras.optimizers.SGD(0.1), keras.optimizers.RMSprop(0.1), keras.optimizers.Adam(0.1, beta_2=0.0),
                   keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(0.1))):
        with pytest.raises(ValueError, match="second_moment='calibrated'.*second_moment='local'"):
            hvd_keras.DistributedOptimizer(cannot, compression=calibrated)
    if "gradient_accumulation_steps" in keras.optimizers.Adam(0.1).get_config():  # Keras 3
        with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
            hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.1, gradient_accumulation_steps=2),
                                           compression=calibrated)
    for other in (keras.optimizers.SGD(0.1), keras.optimizers.RMSprop(0.1)):  # "auto": each rank's own there
        hvd_keras.DistributedOptimizer(other, compression=TopKEF(target="update"))
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=TopKEF(target="update"),
                                       backward_passes_per_step=2)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5), compression=TopKEF(target="update"))
    assert isinstance(opt, keras.optimizers.SGD) and type(opt).__name__ == "SGD"
    assert opt.get_config()["momentum"] == 0.5


def test_update_mode_elastic_commit_and_restore_return_the_update_residuals():
    """hvd.elastic.TensorFlowKerasState tracking the compressor: a restore puts the update residuals and the model
    back to the commit; the traced step then trains on."""
    model, compressor, optimizer, step = _adam_training()
    batches = _batches(5, hvd.rank())
    step(*batches[0], tf.constant(1.0))
    state = compressor.elastic_state(hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0))
    step(*batches[1], tf.constant(1.0))
    state.commit()
    committed, committed_model = _residuals(compressor), _weights(model)
    for x, y in batches[2:4]:
        step(x, y, tf.constant(1.0))
    moved = _residuals(compressor)
    state.restore()
    restored, restored_model = _residuals(compressor), _weights(model)
    step(*batches[4], tf.constant(1.0))
    assert committed and set(committed) == set(restored) and all(k.startswith("update.") for k in committed)
    assert any(not np.array_equal(moved[k], committed[k]) for k in committed)
    assert all(np.array_equal(restored[k], committed[k]) for k in committed)
    assert all(np.array_equal(a, b) for a, b in zip(restored_model, committed_model))
    assert _same_on_every_rank(_weights(model), "elastic.same")


def _scale(optimizer):
    return float(optimizer.dynamic_scale if hasattr(optimizer, "dynamic_scale") else optimizer.loss_scale)


def test_update_mode_loss_scale_optimizer_lowers_its_scale_on_every_rank_when_one_overflows():
    """A LossScaleOptimizer: one rank's NaN skips the step everywhere and every rank's loss scale goes down (a skip
    it never saw would leave the scale where it overflows, and skip every later step too)."""
    model = _model()
    optimizer = _wrap(keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
                      TopKEF(ratio=0.05, min_numel=256, target="update"))
    step = _train_step(model, optimizer)
    batches = _batches(3, hvd.rank())
    step(*batches[0], tf.constant(1.0))
    weights, scale = _weights(model), _scale(optimizer)
    step(*batches[1], tf.constant(float("nan") if hvd.rank() == 1 else 1.0))
    unchanged = all(np.array_equal(a, b) for a, b in zip(weights, _weights(model)))
    lowered = _scale(optimizer)
    step(*batches[2], tf.constant(1.0))
    moved = not all(np.array_equal(a, b) for a, b in zip(weights, _weights(model)))
    scales = hvd.allgather_object(lowered, name="lso.scales")
    same = _same_on_every_rank(_weights(model), "lso.same")
    assert unchanged and moved and same
    assert all(s == scale / 2 for s in scales), (scale, scales)


def test_update_mode_fixed_loss_scale_skips_without_applying_nan():
    """A LossScaleOptimizer with a fixed scale (Keras 2's dynamic=False) applies whatever it is handed: a skipped
    step must not hand it NaN gradients."""
    try:
        inner = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-2), dynamic=False,
                                                         initial_scale=8.0)
    except (TypeError, ValueError):  # Keras 3 refuses dynamic=False (its scale is always dynamic)
        pytest.skip("this Keras's LossScaleOptimizer has no fixed scale")
    model = _model()
    optimizer = _wrap(inner, TopKEF(ratio=0.05, min_numel=256, target="update"))
    step = _train_step(model, optimizer)
    batches = _batches(2, hvd.rank())
    step(*batches[0], tf.constant(1.0))
    weights = _weights(model)
    step(*batches[1], tf.constant(float("nan") if hvd.rank() == 1 else 1.0))
    after = _weights(model)
    assert all(np.isfinite(w).all() for w in after)
    assert all(np.array_equal(a, b) for a, b in zip(weights, after))


def test_update_mode_variables_of_the_same_name_keep_apart_in_a_traced_step():
    """Two models built alike (the same variable names): each variable gets its own residual key, valid as a
    collective's name inside tf.function, and training keeps the ranks identical."""
    def twin():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, name="same")], name="twin")

    first, second = twin(), twin()
    variables = first.trainable_variables + second.trainable_variables
    keys = update_keys(variables)
    compressor = TopKEF(ratio=0.05, min_numel=256, target="update")
    optimizer = _wrap(keras.optimizers.Adam(1e-2), compressor)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(first(x))) + tf.reduce_mean(tf.abs(second(x)))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for x, _ in _batches(3, hvd.rank()):
        step(x)
    assert len(set(keys)) == len(keys) == 4 and sum(".dup" in k for k in keys) == 4  # the names did collide
    assert set(_residuals(compressor)) <= set(keys) and len(_residuals(compressor)) == 2  # the two kernels
    assert _same_on_every_rank([v.numpy() for v in variables], "same.names")


def _velocities(optimizer, variables):
    from horovod_topk.tensorflow.update_mode import _velocity

    return [_velocity(optimizer, v).numpy().astype(np.float64) for v in variables]


@pytest.mark.parametrize("make", ["Adam", "AdamW"])
def test_calibrated_first_step_matches_an_independent_reference_with_the_exact_share(make):
    """Step 1 from a fresh state, ratio 1, a sketch as wide as the widest variable (hence exact): Keras's update is
    alpha * m / (sqrt(v) + eps) with m = (1 - b1) g, v = (1 - b2) * s * g**2, alpha = lr sqrt(1 - b2) / (1 - b1),
    s = ||sum_r g_r||**2 / (P sum_r ||g_r||**2) clamped to [1/P, 1]; every rank applies the ranks' mean (AdamW also
    decays the variable by lr * wd, the same on every rank)."""
    lr, eps, wd = 1e-2, 1e-7, 0.004
    model = _model()
    widest = max(int(np.prod(v.shape)) for v in model.trainable_variables)
    compressor = TopKEF(target="update", second_moment="calibrated", second_moment_sketch=widest, **EVERYTHING)
    user = keras.optimizers.AdamW(lr, weight_decay=wd, epsilon=eps) if make == "AdamW" else \
        keras.optimizers.Adam(lr, epsilon=eps)
    step = _train_step(model, _wrap(user, compressor))
    before = [w.astype(np.float64) for w in _weights(model)]
    grads = [g.numpy().astype(np.float64) for g in step(*_batches(1, hvd.rank())[0], tf.constant(1.0))]
    every = hvd.allgather_object(grads, name=f"calibrated.first.{make}")
    size = hvd.size()
    shares = []
    for i, p0 in enumerate(before):
        g = np.stack([ranks[i] for ranks in every])
        total = np.square(g).sum()
        share = float(np.clip(np.square(g.sum(0)).sum() / (size * total), 1.0 / size, 1.0)) if total > 0 else 1.0
        shares.append(share)
        local = lr * np.sqrt(1 - 0.999) * g / (np.sqrt((1 - 0.999) * share) * np.abs(g) + eps)
        expected = p0 * (1 - lr * wd if make == "AdamW" else 1.0) - local.mean(0)
        np.testing.assert_allclose(_weights(model)[i], expected, rtol=2e-5, atol=1e-6, err_msg=f"variable {i}")
    assert min(shares) < 0.99  # the ranks' gradients differ: some share is not 1, so the scaling was exercised
    stats = compressor.stats()["noise_share"]
    assert abs(stats["min"] - min(shares)) < 1e-5 and abs(stats["max"] - max(shares)) < 1e-5
    assert _same_on_every_rank(_weights(model), f"calibrated.same.{make}")


def test_calibrated_second_moment_is_the_local_one_times_a_share():
    """The same first step with each rank's own second moment and with the calibrated one (the default sketch of
    64): per variable the velocities differ by one factor in [1/P, 1], below 1 for some variable; the sketch's
    bytes are counted in what each update sent."""
    velocities, sent = {}, {}
    for mode in ("local", "calibrated"):
        model = _model()
        compressor = TopKEF(target="update", second_moment=mode, **EVERYTHING)
        optimizer = _wrap(keras.optimizers.Adam(1e-2), compressor)
        _train_step(model, optimizer)(*_batches(1, hvd.rank())[0], tf.constant(1.0))
        velocities[mode] = _velocities(optimizer, model.trainable_variables)
        sent[mode] = compressor.stats()["bytes_sent"]
    size, below = hvd.size(), 0
    for i, (local, calibrated) in enumerate(zip(velocities["local"], velocities["calibrated"])):
        seen = local > 1e-20
        ratio = calibrated[seen] / local[seen]
        np.testing.assert_allclose(ratio, ratio[0], rtol=1e-4, err_msg=f"variable {i}")  # one share per tensor
        assert 1.0 / size - 1e-5 <= ratio[0] <= 1.0 + 1e-5, (i, ratio[0])
        below += ratio[0] < 0.99
    assert below >= 1
    assert sent["calibrated"] - sent["local"] == 6 * 4 * 65  # 6 variables, 65 float32 each


def test_calibrated_error_feedback_invariant_from_the_state_the_step_left():
    """Over 4 steps at ratio 0.05: each rank's local update recomputed from the Adam slots its step left (alpha * m
    / (sqrt(v) + eps)) satisfies sum of new residuals + P * applied == sum of (old residual + local update), and the
    ranks' variables stay the same bytes while their velocities are their own."""
    size = hvd.size()
    model, compressor, optimizer, step = _adam_training("calibrated")
    key = update_keys(model.trainable_variables)[0]  # the first kernel (32 x 64): compressed
    for i, (x, y) in enumerate(_batches(4, hvd.rank())):
        before = model.trainable_variables[0].numpy().astype(np.float64)
        old = _residuals(compressor)
        step(x, y, tf.constant(1.0))
        t = np.float32(optimizer.iterations.numpy())
        m = optimizer._momentums[0].numpy()
        v = _velocities(optimizer, model.trainable_variables[:1])[0].astype(np.float32)
        # in float32 as Keras computes it: the twin of the arithmetic, not a second rounding of it
        one = np.float32(1)
        alpha = np.float32(1e-2) * np.sqrt(one - np.float32(0.999) ** t) / (one - np.float32(0.9) ** t)
        local = ((m * alpha) / (np.sqrt(v) + np.float32(optimizer.epsilon))).astype(np.float64)
        applied = before - model.trainable_variables[0].numpy().astype(np.float64)
        new = _residuals(compressor)
        gathered = hvd.allgather_object((old.get(key, np.zeros_like(new[key])), new[key], local.reshape(-1)),
                                        name=f"calibrated.invariant.{i}")
        total_old = sum(o + u for o, _, u in gathered)
        total_new = sum(n for _, n, _ in gathered)
        np.testing.assert_allclose(total_new + size * applied.reshape(-1), total_old, rtol=1e-5, atol=1e-7)
        assert np.abs(total_new).sum() > 0
        assert _same_on_every_rank(_weights(model), f"calibrated.identical.{i}")
    assert not _same_on_every_rank(_velocities(optimizer, model.trainable_variables), "calibrated.own.velocity")


def test_the_default_target_exchanges_adams_updates_and_sgds_gradients():
    """target="auto" (the default): Keras's Adam trains in update mode (its residuals are keyed update.<variable>),
    SGD in gradient mode; a gradient tape, which never sees the step, takes the default without refusing it."""
    keys = {}
    for name, user in (("adam", keras.optimizers.Adam(1e-2)), ("sgd", keras.optimizers.SGD(0.1))):
        model = _model()
        compressor = TopKEF(ratio=0.05, min_numel=256)
        # model.fit: Horovod's Keras 2 wrapper averages gradients on fit's path (a custom loop takes the tape)
        model.compile(optimizer=_wrap(user, compressor), loss=_loss_fn())
        x, y = _batches(1, hvd.rank())[0]
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        keys[name] = sorted(_residuals(compressor))
        assert _same_on_every_rank(_weights(model), f"default.{name}"), (name, keys[name])
    assert keys["adam"] and all(k.startswith("update.") for k in keys["adam"])
    assert keys["sgd"] and not any(k.startswith("update.") for k in keys["sgd"])
    with tf.GradientTape() as tape:
        tf.reduce_sum(tf.Variable(1.0) * 2.0)
    hvd.DistributedGradientTape(tape, compression=TopKEF())


@pytest.mark.parametrize("second_moment", ["local", "calibrated"])
def test_update_mode_updates_in_buckets_train_as_the_per_tensor_exchange(second_moment, monkeypatch):
    """The compressed updates travel in one allgather per step (one bucket), and the weights and residuals are those
    of one allgather per update, bit for bit."""
    from tests.tf_allgathers import record_allgathers, topk_exchanges

    def train(bucket_bytes):
        model = _model()
        compressor = TopKEF(ratio=0.05, min_numel=256, target="update", second_moment=second_moment,
                            bucket_bytes=bucket_bytes)
        step = _train_step(model, _wrap(keras.optimizers.Adam(1e-2), compressor))
        for x, y in _batches(3, hvd.rank()):
            step(x, y, tf.constant(1.0))
        return _weights(model), _residuals(compressor)

    names = record_allgathers(monkeypatch)
    ours, our_residuals = train(1 << 20)
    bucketed = topk_exchanges(names)
    names.clear()
    theirs, their_residuals = train(0)
    per_tensor = topk_exchanges(names)
    for i, (u, v) in enumerate(zip(ours, theirs)):
        np.testing.assert_array_equal(u, v, err_msg=f"weight {i}")
    assert our_residuals.keys() == their_residuals.keys() and our_residuals
    for key in our_residuals:
        np.testing.assert_array_equal(our_residuals[key], their_residuals[key], err_msg=key)
    assert len(per_tensor) == 2 and len(bucketed) == 1 and bucketed[0].startswith("topk.bucket.")  # both kernels
    assert _same_on_every_rank(ours, f"bucketed.{second_moment}")


@pytest.mark.parametrize("second_moment", ["local", "calibrated"])
def test_the_non_finite_count_and_the_sketches_share_one_allreduce(monkeypatch, second_moment):
    """Before its local step a calibrated step waits for one collective, not two: the non-finite count travels with
    every gradient's sketch (the gradients do not change in between). A NaN on one rank still skips the step on
    every rank (the count in the shared allreduce says so)."""
    import horovod.tensorflow

    reduce, names = horovod.tensorflow._allreduce, []

    def recorded(tensor, *args, name=None, **kwargs):
        names.append(name)
        return reduce(tensor, *args, name=name, **kwargs)

    monkeypatch.setattr(horovod.tensorflow, "_allreduce", recorded)
    model = _model()
    step = _train_step(model, _wrap(keras.optimizers.Adam(1e-2), TopKEF(target="update", second_moment=second_moment,
                                                                         **EVERYTHING)))
    batches = _batches(2, hvd.rank())
    step(*batches[0], tf.constant(1.0))  # traced here: the collectives the step holds are named now
    before = _weights(model)
    step(*batches[1], tf.constant(float("nan") if hvd.rank() == 1 else 1.0))
    before_local_step = [n for n in names if n.startswith("topk.update.") and "." not in n[len("topk.update."):]]
    expected = {"local": "topk.update.nonfinite", "calibrated": "topk.update.nonfinite_and_noise_share"}
    assert before_local_step and set(before_local_step) == {expected[second_moment]}, names  # once per trace
    assert all(np.array_equal(a, b) for a, b in zip(_weights(model), before))  # the poisoned step was skipped
