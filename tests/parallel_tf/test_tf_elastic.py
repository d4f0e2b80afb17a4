"""The TensorFlow TopKEF inside Horovod's elastic states, on real workers: commit / restore / sync of the
residuals (horovod_topk.tensorflow.elastic), without a world-size change (tests/elastic has the real one)."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_topk.tensorflow import TopKEF

from .tf_harness import apply, batch, loss_fn, make_variables


def _setup(compressor):
    v = make_variables()
    names = sorted(v)

    @tf.function
    def step(x, tokens, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(v, x, tokens, y)
        grads = hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [v[n] for n in names])
        apply(v, names, grads)

    state = compressor.elastic_state(hvd.elastic.TensorFlowState(variables=[v[n] for n in names], batch=0))
    return v, step, state


def _residuals(compressor):
    return {name: var.numpy().copy() for name, var in compressor._residual_vars.items()}


def _steps(compressor):
    return {name: int(var.numpy()[0]) for name, var in compressor._counter_vars.items()}


def test_commit_modify_restore_returns_residuals_counters_and_model_to_the_commit():
    compressor = TopKEF(ratio=0.01)
    v, step, state = _setup(compressor)
    for s in range(3):
        step(*batch(s))
    state.batch = 3
    state.commit()
    committed, committed_model = _residuals(compressor), {n: t.numpy().copy() for n, t in v.items()}
    for s in range(3, 5):
        step(*batch(s))
    moved = _residuals(compressor)
    state.restore()
    restored = _residuals(compressor)
    step(*batch(3))  # the traced step keeps working on the restored variables
    assert len(committed) == 2 and any(not np.array_equal(moved[n], committed[n]) for n in committed)
    for name in committed:
        np.testing.assert_array_equal(restored[name], committed[name], err_msg=name)
    assert set(_steps(compressor).values()) == {4} and state.batch == 3
    assert not all(np.array_equal(v[n].numpy(), committed_model[n]) for n in v)  # one step after restore


def test_sync_keeps_each_ranks_own_residual_and_a_new_worker_adopts_the_step_counters():
    trained = TopKEF(ratio=0.01)
    v, step, state = _setup(trained)
    for s in range(3):
        step(*batch(s))
    # rank 1 plays a worker that just joined: its state tracks a compressor that has never run
    compressor = trained if hvd.rank() == 0 else TopKEF(ratio=0.01)
    if hvd.rank() == 1:  # a state without variables (TensorFlowState's constructor broadcasts them: collective)
        from horovod.common.elastic import ObjectState

        state = compressor.elastic_state(ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, batch=0))
    before = _residuals(compressor)
    state.sync()
    after = {name: r.steps for name, r in compressor.registry}
    gathered = hvd.allgather_object(after, name="test.elastic.steps")
    residuals = hvd.allgather_object(_residuals(compressor), name="test.elastic.residuals")
    assert gathered[0] == gathered[1] and len(gathered[0]) == 4 and set(gathered[1].values()) == {3}
    assert residuals[1] == {}  # a new worker starts without residuals: never a copy of another rank's
    if hvd.rank() == 0:
        assert len(before) == 2 and any(np.any(r != 0) for r in before.values())
        for name in before:
            np.testing.assert_array_equal(residuals[0][name], before[name])  # untouched by the sync


def test_sync_after_a_world_size_change_rescales_this_ranks_residuals():
    compressor = TopKEF(ratio=0.01)
    v, step, state = _setup(compressor)
    for s in range(2):
        step(*batch(s))
    saved = compressor.state_dict()
    for entry in saved["tensors"].values():
        entry["world_size"] = 4  # as if committed on 4 workers, now reset onto 2
    compressor.load_state_dict(saved)
    state.sync()
    after = _residuals(compressor)
    for name, entry in saved["tensors"].items():
        if entry["residual"] is not None:
            np.testing.assert_allclose(after[name], entry["residual"] * 0.5, rtol=1e-6, err_msg=name)
        assert compressor.registry.records[name].world_size == hvd.size()
