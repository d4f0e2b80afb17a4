"""Faults on real Horovod workers (TensorFlow): a non-finite gradient on one rank."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_topk.tensorflow import TopKEF

from .tf_harness import batch, loss_fn, make_variables


def test_an_inf_gradient_on_one_rank_reaches_every_rank_and_never_enters_the_residual():
    v = make_variables()
    names = sorted(v)
    compressor = TopKEF(ratio=0.05, min_numel=1000)

    @tf.function
    def step(x, tokens, y, poison):
        with tf.GradientTape() as tape:
            # on rank 1 at the poisoned step, one entry of w1's gradient turns infinite
            loss = loss_fn(v, x, tokens, y) + poison * v["w1"][3, 5]
        return hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [v[n] for n in names])

    seen = []
    for s in range(3):
        poison = np.float32(np.inf if (s == 1 and hvd.rank() == 1) else 0.0)
        before = {n: var.numpy().copy() for n, var in compressor._residual_vars.items()}
        grads = step(*batch(s), tf.constant(poison))
        w1 = grads[names.index("w1")].numpy()
        residuals = {n: var.numpy().copy() for n, var in compressor._residual_vars.items()}
        seen.append((w1, before, residuals))
    poisoned_w1 = seen[1][0]
    assert np.isinf(poisoned_w1[3, 5]) and np.isfinite(np.delete(poisoned_w1.reshape(-1), 3 * 64 + 5)).all()
    assert np.isfinite(seen[0][0]).all() and np.isfinite(seen[2][0]).all()
    for _, _, residuals in seen:
        assert all(np.isfinite(r).all() for r in residuals.values())
    # residuals are keyed by the gradient's graph name; w1's is the sum (AddN) of its two loss terms' gradients
    (name,) = [n for n in seen[1][2] if n.startswith("AddN")]
    if hvd.rank() == 1:
        assert seen[1][2][name][3 * 64 + 5] == seen[1][1][name][3 * 64 + 5]
        assert compressor.stats()["nonfinite_steps"] == 1
    else:
        assert compressor.stats()["nonfinite_steps"] == 0


def test_gather_and_restore_every_ranks_residuals():
    from horovod_topk.tensorflow import gather_state, restore_state

    from .tf_harness import train_tape

    compressor = TopKEF(ratio=0.05, min_numel=1000)
    train_tape(compressor, steps=3)
    before = {n: v.numpy().copy() for n, v in compressor._residual_vars.items()}
    checkpoint = gather_state(compressor)
    compressor.reset()  # zeroes the variables in place
    restore_state(compressor, checkpoint)
    after = {n: v.numpy().copy() for n, v in compressor._residual_vars.items()}
    mine = hvd.allgather_object(before, name="test.before")
    assert after.keys() == before.keys() and len(before) == 2
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
        assert not np.array_equal(mine[0][name], mine[1][name]), "ranks hold different residuals"
    if hvd.rank() == 0:
        assert checkpoint["world_size"] == 2
        for rank in range(2):
            for name in before:
                np.testing.assert_array_equal(checkpoint["ranks"][rank]["tensors"][name]["residual"], mine[rank][name])
    else:
        assert checkpoint is None
    assert compressor.stats()["steps"] == 3


def test_a_tf_train_checkpoint_restores_residuals_and_counters_into_a_new_compressor(tmp_path_factory):
    from .tf_harness import train_tape

    first = TopKEF(ratio=0.05, min_numel=1000)
    train_tape(first, steps=3)
    path = tf.train.Checkpoint(topk=first.trackable).write(str(tmp_path_factory.mktemp(f"rank{hvd.rank()}") / "ck"))
    second = TopKEF(ratio=0.05, min_numel=1000)
    tf.train.Checkpoint(topk=second.trackable).read(path)  # its variables do not exist yet: restored on creation
    # one more identical step (same fresh model, same batch) from the saved state and from the restored one
    train_tape(first, steps=1)
    train_tape(second, steps=1)
    assert first.stats()["steps"] == second.stats()["steps"] == 4
    ours = {n: v.numpy() for n, v in second._residual_vars.items()}
    assert ours.keys() == {n for n in first._residual_vars} and len(ours) == 2
    for name, value in first._residual_vars.items():
        np.testing.assert_array_equal(ours[name], value.numpy())
