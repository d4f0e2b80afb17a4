"""Update mode's gradient route through the Keras optimizer wrappers (core.update_mode, "The gradient route"), on 2
real Horovod workers: while ratio="auto" holds dense or fp16 a step of update mode runs as gradient mode. The cases
both Keras suites run (tests/parallel_tf: Keras 2; tests/parallel_keras3: Keras 3).

Checked: held dense it is Keras's Adam on Horovod's averaged gradient; entering the route makes every rank's moments
their mean and applies the ranks' mean update residual; leaving fp16 puts each rank's fp16 residual into its own
gradient; weights stay the same bytes on every rank; a checkpoint on either side of a change resumes exactly. The
links the decisions are made from are scripted (tests/auto_links.py); collectives and compressor are real.
"""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.autodensity import HALF
from horovod_topk.tensorflow import TopKEF, auto_density
from horovod_topk.tensorflow.gradient_route import own_state
from horovod_topk.tensorflow.update_mode import update_keys
from tests.auto_links import (CHECK_STEPS, FIRST_DECISION, SECOND_DECISION, THIRD_DECISION, fast_link, half_link,
                              script, slow_link, sparse_slower_than_dense)
from tests.keras_update_mode_cases import (_batches, _loss_fn, _model, _same_on_every_rank, _train_step, _weights,
                                          _wrap)

keras = tf.keras
BETA1 = 0.9
ONE = tf.constant(1.0)


def _adam():
    return keras.optimizers.Adam(1e-2, beta_1=BETA1)


def _auto(half):
    compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS)
    compressor.auto.half = half
    return compressor


def _momentum(optimizer, variable):
    """Adam's first-moment slot of ``variable`` (Keras 3 by index, Keras 2 by key)."""
    if hasattr(optimizer, "_get_variable_index"):
        return optimizer._momentums[optimizer._get_variable_index(variable)]
    return optimizer._momentums[optimizer._index_dict[optimizer._var_key(variable)]]


def _residual_values(compressor, model):
    """Each trainable variable's update residual (zeros where none is kept yet), in the model's order."""
    keys = update_keys(model.trainable_variables)
    values = {key: var.numpy() for key, var in compressor._residual_vars.items()}
    return [values.get(key, np.zeros(v.shape.num_elements(), np.float32)).reshape(v.shape)
            for key, v in zip(keys, model.trainable_variables)]


def _run(compressor, steps, before=None, after=None, optimizer=None, model=None):
    """Adam through Horovod's Keras wrapper; ``before(i, model, opt)`` / ``after(i, model, opt, grads)`` around
    step ``i`` (``grads``: this rank's own gradients of the step)."""
    model = model or _model()
    optimizer = optimizer or _wrap(_adam(), compressor)
    step = _train_step(model, optimizer)
    batches = _batches(max(steps) + 1, hvd.rank())
    for i in steps:
        if before is not None:
            before(i, model, optimizer)
        grads = step(*batches[i], ONE)
        if after is not None:
            after(i, model, optimizer, [g.numpy() for g in grads])
    return model, optimizer


def _averaged_adam(steps):
    """Keras's Adam stepping on Horovod's average of the ranks' gradients, in a traced step (gradient mode)."""
    model, optimizer, loss_fn = _model(), _adam(), _loss_fn()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        averaged = [hvd.allreduce(g, op=hvd.Average, name=f"route.tf.reference.{i}") for i, g in enumerate(grads)]
        optimizer.apply_gradients(zip(averaged, model.trainable_variables))

    batches = _batches(max(steps) + 1, hvd.rank())
    for i in steps:
        step(*batches[i])
    return model


def test_held_dense_is_adam_on_the_averaged_gradient(monkeypatch):
    """auto kept dense (a fast link): update mode's steps are Keras's Adam on Horovod's averaged gradient, as
    gradient mode's are, and every rank's weights and moments are the same bytes."""
    script(monkeypatch, auto_density, lambda step: fast_link)
    compressor = _auto(half=True)
    model, optimizer = _run(compressor, range(FIRST_DECISION + 4))
    reference = _averaged_adam(range(FIRST_DECISION + 4))
    assert compressor.auto.ratio is None and compressor.auto.decisions >= 1
    assert compressor.auto.shared_scopes == [update_keys(model.trainable_variables)[0]]
    for ours, plain in zip(_weights(model), _weights(reference)):
        np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)
    assert _same_on_every_rank(_weights(model), "route.tf.dense.weights")
    assert _same_on_every_rank([v.numpy() for v in own_state(optimizer.variables)], "route.tf.dense.moments")


def test_entering_averages_the_moments_and_applies_the_mean_update_residual(monkeypatch):
    """dense -> sparse (updates exchanged, residuals left) -> dense at SECOND_DECISION. With lr 0 on the entering
    step the weights move by exactly minus the ranks' mean update residual, and each first moment is Adam's on the
    mean of the ranks' first moments and the averaged gradient."""
    script(monkeypatch, auto_density, lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    compressor = _auto(half=False)
    seen, shared = {}, []

    def before(i, model, optimizer):
        if i != SECOND_DECISION:
            return
        variables = model.trainable_variables
        seen["residuals"] = _residual_values(compressor, model)
        seen["mean_residual"] = [hvd.allreduce(r, op=hvd.Average, name=f"route.tf.enter.res.{n}").numpy()
                                 for n, r in enumerate(seen["residuals"])]
        seen["mean_m"] = [hvd.allreduce(tf.convert_to_tensor(_momentum(optimizer, v)), op=hvd.Average,
                                        name=f"route.tf.enter.m.{n}").numpy() for n, v in enumerate(variables)]
        seen["weights"] = _weights(model)
        optimizer.learning_rate.assign(0.0)

    def after(i, model, optimizer, grads):
        shared.append(list(compressor.auto.shared_scopes))
        if i != SECOND_DECISION:
            return
        optimizer.learning_rate.assign(1e-2)
        averaged = [hvd.allreduce(g, op=hvd.Average, name=f"route.tf.enter.g.{n}").numpy()
                    for n, g in enumerate(grads)]
        for n, (w, v) in enumerate(zip(model.get_weights(), model.trainable_variables)):
            np.testing.assert_allclose(w, seen["weights"][n] - seen["mean_residual"][n], rtol=0, atol=1e-6)
            moment = BETA1 * seen["mean_m"][n] + (1 - BETA1) * averaged[n]
            np.testing.assert_allclose(_momentum(optimizer, v).numpy(), moment, rtol=1e-5, atol=1e-7)
        seen["moments_same"] = _same_on_every_rank([v.numpy() for v in own_state(optimizer.variables)],
                                                   "route.tf.enter.moments")

    model, _ = _run(compressor, range(SECOND_DECISION + 3), before=before, after=after)
    assert any(np.any(r) for r in seen["residuals"])  # there was a residual to apply
    assert shared[SECOND_DECISION - 1] == [] and all(shared[i] for i in range(SECOND_DECISION, len(shared)))
    assert seen["moments_same"]
    assert _same_on_every_rank(_weights(model), "route.tf.enter.weights")


def test_leaving_fp16_puts_its_residual_into_the_ranks_own_gradient(monkeypatch):
    """fp16 (gradient route, residuals of float16's rounding) -> a density (update mode) at SECOND_DECISION: the
    step back takes each rank's fp16 residual into that rank's own gradient before its local step, which Adam's
    first moment shows (update mode's first moment is this rank's own)."""
    links = {FIRST_DECISION: half_link, SECOND_DECISION: slow_link}
    script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    compressor = _auto(half=True)
    seen, ratios = {}, []

    def before(i, model, optimizer):
        if i == SECOND_DECISION:
            seen["residuals"] = _residual_values(compressor, model)
            seen["m"] = [_momentum(optimizer, v).numpy() for v in model.trainable_variables]

    def after(i, model, optimizer, grads):
        ratios.append(compressor.auto.ratio)
        if i != SECOND_DECISION:
            return
        for n, v in enumerate(model.trainable_variables):
            moment = BETA1 * seen["m"][n] + (1 - BETA1) * (grads[n] + seen["residuals"][n])
            np.testing.assert_allclose(_momentum(optimizer, v).numpy(), moment, rtol=1e-5, atol=1e-8)

    model, _ = _run(compressor, range(SECOND_DECISION + 2), before=before, after=after)
    assert ratios[FIRST_DECISION] == HALF and isinstance(ratios[SECOND_DECISION], float), ratios
    assert any(np.any(r) for r in seen["residuals"])  # fp16 left something to take back
    assert compressor.auto.shared_scopes == []
    assert _same_on_every_rank(_weights(model), "route.tf.leave.weights")


@pytest.mark.parametrize("links, save_at, shared", [
    ({FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}, SECOND_DECISION - 2, False),
    ({FIRST_DECISION: half_link}, FIRST_DECISION + 2, True),
], ids=["in-update-mode-before-entering", "within-fp16"])
@pytest.mark.parametrize("saver", ["state_dict", "trackable"])
def test_a_checkpoint_resumes_exactly(monkeypatch, tmp_path, links, save_at, shared, saver):
    """Saved in update mode before the step that enters the gradient route (the resumed job must average as the
    straight one did), or within fp16's gradient route (its residuals hold gradient: the resumed job must not take
    them for update residuals): weights, this rank's optimizer variables and TopKEF's state, by ``state_dict()`` or
    by ``tf.train.Checkpoint(topk=compressor.trackable)`` (ratio="auto"'s state travels in it too)."""
    script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    saved = {}
    path = str(tmp_path / f"rank{hvd.rank()}")

    def keep(i, model, optimizer, grads):
        if i == save_at:
            saved.update(weights=_weights(model), topk=compressor.state_dict(),
                         optimizer=[v.numpy() for v in optimizer.variables])
            if saver == "trackable":
                tf.train.Checkpoint(topk=compressor.trackable).write(path)

    compressor = _auto(half=True)
    straight, _ = _run(compressor, range(THIRD_DECISION), after=keep)
    assert bool(saved["topk"]["auto"]["shared_scopes"]) == shared
    compressor = _auto(half=True)
    model = _model()
    model.set_weights(saved["weights"])
    if saver == "trackable":
        tf.train.Checkpoint(topk=compressor.trackable).read(path).assert_existing_objects_matched()
        assert compressor.auto.state_dict() == saved["topk"]["auto"]
    else:
        compressor.load_state_dict(saved["topk"])
    optimizer = _wrap(_adam(), compressor)
    optimizer.build(model.trainable_variables)
    for variable, value in zip(optimizer.variables, saved["optimizer"]):
        variable.assign(value)
    resumed, _ = _run(compressor, range(save_at + 1, THIRD_DECISION), optimizer=optimizer, model=model)
    assert all(np.array_equal(a, b) for a, b in zip(_weights(straight), _weights(resumed)))


def test_after_an_elastic_reset_the_route_averages_the_ranks_own_state_again(monkeypatch):
    """Within the gradient route, a reset (core.checkpoint.sync_after_reset over Horovod's collectives, what the
    elastic state's sync runs) makes the next step average the ranks' own optimizer state again: here rank 1's
    moments are zeroed, as a joined worker's would be were they not broadcast, and every rank's moments and weights
    stay the same bytes."""
    from horovod_topk.core.checkpoint import sync_after_reset
    from horovod_topk.tensorflow.checkpoint import _TensorFlowTransport

    script(monkeypatch, auto_density, lambda step: fast_link)
    compressor = _auto(half=True)

    def reset(i, model, optimizer):
        if i != 4:
            return
        if hvd.rank() == 1:
            for v in own_state(optimizer.variables):
                v.assign(tf.zeros_like(v))
        sync_after_reset(compressor, _TensorFlowTransport())
        assert compressor.auto.resync_scopes == compressor.auto.shared_scopes != []

    model, optimizer = _run(compressor, range(FIRST_DECISION + 2), before=reset)
    assert _same_on_every_rank([v.numpy() for v in own_state(optimizer.variables)], "route.tf.resync.moments")
    assert _same_on_every_rank(_weights(model), "route.tf.resync.weights")
    assert compressor.auto.resync_scopes == []


def test_an_embedding_through_the_route_and_back_keeps_ranks_identical(monkeypatch):
    """An embedding's gradient (IndexedSlices) on the route (made dense for the exchange) and on leaving fp16 (its
    residual joined as rows of their own): the traced step builds, runs dense -> fp16 -> a density, and every rank's
    weights stay the same bytes."""
    links = {FIRST_DECISION: half_link, SECOND_DECISION: slow_link}
    script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    compressor = TopKEF(ratio="auto", min_numel=16, target="update", auto_every=CHECK_STEPS)
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(64, 8),
                              keras.layers.Flatten(), keras.layers.Dense(4)])
    optimizer = _wrap(_adam(), compressor)
    loss_fn = _loss_fn()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return grads[0]

    rng = np.random.RandomState(7 + hvd.rank())
    ratios = []
    for _ in range(SECOND_DECISION + 2):
        first = step(rng.randint(0, 64, (16, 4)), rng.randint(0, 4, 16))
        ratios.append(compressor.auto.ratio)
    assert isinstance(first, tf.IndexedSlices)
    assert ratios[FIRST_DECISION] == HALF and isinstance(ratios[SECOND_DECISION], float), ratios
    assert _same_on_every_rank(_weights(model), "route.tf.embedding.weights")
