"""DGC momentum correction and spike_guard in the TensorFlow TopKEF, on real Horovod workers."""
import math

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.policy import SPIKE_GUARD_WARMUP_STEPS
from horovod_topk.tensorflow import TopKEF

from .tf_harness import apply, batch, loss_fn, make_variables, train_tape

COMPRESSED = {(32, 64), (64, 32)}  # w1 and w2; the rest is under min_numel or IndexedSlices


def _records_by_shape(compressor):
    return {tuple(r.shape): r for _, r in compressor.registry if r.residual is not None}


def test_momentum_correction_keeps_its_invariant_and_the_update_is_the_mean_of_what_ranks_sent():
    """Per step and tensor, with velocity u' = m u + g: new residual + sent == old residual + u', u is zero where
    sent and u' elsewhere, k entries are sent, and the reduced gradient is the mean of the ranks' sent vectors."""
    ratio, m = 0.05, 0.9
    compressor = TopKEF(ratio=ratio, momentum=m)
    previous, checked = {}, []

    def record(step, names, local, reduced):
        records = _records_by_shape(compressor)
        for name, g, out in zip(names, local, reduced):
            shape = tuple(g.shape)
            if shape not in COMPRESSED:
                continue
            rec = records[shape]
            numel = int(np.prod(shape))
            r0, u0 = previous.get(shape, (np.zeros(numel, np.float32), np.zeros(numel, np.float32)))
            r1, u1 = rec.residual.numpy().copy(), rec.momentum.numpy().copy()
            velocity = m * u0 + g.numpy().reshape(-1)
            sent_mask = (r1 == 0) & (u1 == 0)  # the sent entries, and those whose velocity and residual are 0
            k = math.ceil(ratio * numel)
            assert sent_mask.sum() >= k and np.count_nonzero(np.where(sent_mask, r0 + velocity, 0)) <= k, (name, step)
            np.testing.assert_allclose(u1[~sent_mask], velocity[~sent_mask], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(r1[~sent_mask], (r0 + velocity)[~sent_mask], rtol=1e-5, atol=1e-6)
            sent = np.where(sent_mask, r0 + velocity, 0).astype(np.float32)
            mean = hvd.allreduce(tf.constant(sent), op=hvd.Average, name=f"momentum.sent.{name}.{step}").numpy()
            np.testing.assert_allclose(out.numpy().reshape(-1), mean, rtol=1e-5, atol=1e-6)
            previous[shape] = (r1, u1)
            checked.append((step, name))

    train_tape(compressor, steps=4, on_grads=record)
    assert len(checked) == 8
    assert compressor.state_dict()["tensors"] and all(
        entry["momentum"] is not None for entry in compressor.state_dict()["tensors"].values()
        if entry["residual"] is not None)


def _train_with_a_spike(compressor, steps, spike_step, factor=100.0):
    v = make_variables()
    names = sorted(v)

    @tf.function
    def step(x, tokens, y, scale):
        with tf.GradientTape() as tape:
            loss = scale * loss_fn(v, x, tokens, y)
        grads = hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [v[n] for n in names])
        apply(v, names, grads, lr=0.01)

    residual_norms = []
    for s in range(steps):
        step(*batch(s % 4), tf.constant(factor if s == spike_step else 1.0))
        residual_norms.append(compressor.stats()["residual_norm"])
    return {n: v[n].numpy() for n in names}, residual_norms


def test_spike_guard_caps_a_spike_after_its_warm_up_and_keeps_it_out_of_the_residual():
    spike = SPIKE_GUARD_WARMUP_STEPS + 2
    guarded = TopKEF(ratio=0.05, spike_guard=3.0)
    ours, guarded_norms = _train_with_a_spike(guarded, spike + 2, spike)
    plain = TopKEF(ratio=0.05)
    _, plain_norms = _train_with_a_spike(plain, spike + 2, spike)
    stats = guarded.stats()
    assert stats["guarded_steps"] == 2, "w1 and w2, once each, at the spike"
    assert plain.stats()["guarded_steps"] == 0
    assert plain_norms[spike] > 20 * plain_norms[spike - 1], "without the guard the spike sits in the residual"
    assert guarded_norms[spike] < 4 * guarded_norms[spike - 1]
    levels = [entry["gradient_level"] for entry in guarded.state_dict()["tensors"].values()
              if entry["residual"] is not None]
    assert len(levels) == 2 and all(np.isfinite(levels)) and all(level > 0 for level in levels)
    gathered = hvd.allgather_object(ours, name="spike_guard.params")
    for name in ours:
        np.testing.assert_array_equal(gathered[0][name], gathered[1][name])


@pytest.mark.parametrize("options", [{"warmup_steps": 4}, {"exchange": "sparse_allreduce"}])
def test_spike_guard_with_a_warm_up_or_the_sparse_allreduce(options):
    """The guard's scale keeps the gradient's static shape: the warm-up's dense branch and the sparse allreduce
    reshape to it (an unknown shape there failed while tracing)."""
    spike = SPIKE_GUARD_WARMUP_STEPS + 2
    guarded = TopKEF(ratio=0.05, spike_guard=3.0, **options)
    ours, norms = _train_with_a_spike(guarded, spike + 2, spike)
    assert guarded.stats()["guarded_steps"] == 2, "w1 and w2, once each, at the spike"
    assert all(np.isfinite(norms))
    gathered = hvd.allgather_object(ours, name=f"spike_guard.{sorted(options)[0]}.params")
    for name in ours:
        assert np.isfinite(ours[name]).all()
        np.testing.assert_array_equal(gathered[0][name], gathered[1][name])


@pytest.mark.parametrize("options", [{}, {"index_bits": 16, "value_dtype": "float16"}, {"value_dtype": "float8"}])
def test_warm_up_sends_each_steps_k_goes_dense_first_and_loses_nothing(options):
    """Sparsity warm-up inside one traced graph, per step and tensor: exactly that step's k (core plan_tensor, which
    PyTorch's TopKEF follows step by step) entries sent, in a payload of exactly k entries (bytes_sent), the early
    steps dense; error feedback exact over the ranks: sum of new residuals + P * reduced == sum of old residuals +
    gradients; the reduced gradient is the mean of what the ranks sent."""
    from horovod_topk.core.policy import plan_tensor, tensor_payload_layout

    compressor = TopKEF(ratio=0.01, warmup_steps=6, **options)
    itemsize = {"float16": 2, "float8": 1}.get(options.get("value_dtype"), 4)
    previous, routes = {}, []

    def record(step, names, local, reduced):
        compressor.stats()  # reads the counter variables back into the records
        records = _records_by_shape(compressor)
        for name, g, out in zip(names, local, reduced):
            shape = tuple(g.shape)
            if shape not in COMPRESSED:
                continue
            numel = int(np.prod(shape))
            plan = plan_tensor(name, numel, True, compressor.config, world_size=hvd.size(), step=step,
                               value_itemsize=itemsize, sparse_available=True)
            r0, sent_before = previous.get(shape, (np.zeros(numel, np.float32), 0))
            r1, sent_bytes = records[shape].residual.numpy().copy(), records[shape].bytes_sent
            sent = r0 + g.numpy().reshape(-1) - r1
            if plan.k is None:
                np.testing.assert_array_equal(r1, 0)
                assert sent_bytes - sent_before == numel * 4, (name, step)
            else:
                assert plan.exchange == "allgather"
                assert np.count_nonzero(np.abs(sent) > 1e-6) == plan.k, (name, step)
                nbytes = tensor_payload_layout(compressor.config, plan.k, numel, itemsize).nbytes
                assert sent_bytes - sent_before == nbytes, (name, step, plan.k)
            total = hvd.allreduce(tf.constant(np.stack([r0 + g.numpy().reshape(-1), r1])), op=hvd.Sum,
                                  name=f"warmup.ef.{name}.{step}").numpy()
            np.testing.assert_allclose(total[1] + hvd.size() * out.numpy().reshape(-1), total[0], rtol=0, atol=1e-5)
            mean = hvd.allreduce(tf.constant(sent), op=hvd.Average, name=f"warmup.sent.{name}.{step}").numpy()
            np.testing.assert_allclose(out.numpy().reshape(-1), mean, rtol=1e-5, atol=1e-6)
            previous[shape] = (r1, sent_bytes)
            routes.append(plan.k)

    train_tape(compressor, steps=8, on_grads=record)
    # two compressed tensors per step; step 0 (ratio 1.0) goes dense: a ring allreduce moves fewer bytes than an
    # allgather of k = N (core.exchange's cost model); from step 1 on they go Top-K, k shrinking to 21
    assert routes[:2] == [None] * 2 and all(k is not None for k in routes[2:]) and routes[-1] == 21
    assert len(set(routes[2:])) >= 5, "k changes from step to step within one graph"
    assert compressor.stats()["steps"] == 8
