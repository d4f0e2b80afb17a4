"""TopKEF with hvd.DistributedGradientTape (eager and tf.function) and Horovod's Keras optimizer wrapper."""
import os
import tempfile

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.tensorflow import TopKEF

from ..timeline import timeline_activities
from .tf_harness import assert_same, batch, make_variables, train_tape

EVERYTHING = dict(ratio=1.0, min_numel=0, dense_fallback=False)

OPTIONS = {
    "function": {},
    "eager": {"use_function": False},
    "op_sum": {"op": hvd.Sum},
    # Horovod itself refuses a predivide factor with IndexedSlices, hence sparse_as_dense there
    "predivide": {"gradient_predivide_factor": 2.0, "sparse_as_dense": True},
    # Horovod 0.28.1's grouped_allreduce breaks on IndexedSlices (zips them with the wrong list), hence sparse_as_dense
    "groups": {"groups": 2, "sparse_as_dense": True},
    "sparse_as_dense": {"sparse_as_dense": True},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_tape_ratio_one_matches_plain_horovod(option):
    kwargs = OPTIONS[option]
    plain = train_tape(hvd.Compression.none, **kwargs)
    compressor = TopKEF(**EVERYTHING)
    ours = train_tape(compressor, **kwargs)
    initial = {n: v.numpy() for n, v in make_variables().items()}
    stats = compressor.stats()
    assert_same(ours, plain)
    assert all(not np.array_equal(plain[n], initial[n]) for n in plain), "every variable must train"
    assert stats["steps"] == 4 and stats["tensors_compressed"] >= 4


def test_indexed_slices_keep_horovods_own_path():
    compressor = TopKEF(**EVERYTHING)
    train_tape(compressor)
    shapes = sorted(tuple(r.shape) for _, r in compressor.registry)
    assert (100, 16) not in shapes, "the embedding's IndexedSlices gradient must not reach the compressor"
    assert (32, 64) in shapes and (64, 32) in shapes


@pytest.mark.parametrize("option", ["function", "eager", "op_sum"])
def test_tape_ratio_one_with_16_bit_indices_matches_plain_horovod(option):
    kwargs = OPTIONS[option]
    plain = train_tape(hvd.Compression.none, **kwargs)
    compressor = TopKEF(**EVERYTHING, index_bits=16)
    ours = train_tape(compressor, **kwargs)
    assert_same(ours, plain)
    assert compressor.stats()["tensors_compressed"] >= 4


@pytest.mark.parametrize("options", [{}, {"selector": "exact"}, {"value_dtype": "float16"},
                                     {"index_bits": 16, "value_dtype": "float8"}])
def test_error_feedback_invariant_at_one_percent(options):
    """Per tensor: sum over ranks and steps of local gradients == P * sum of reduced ones + sum of residuals."""
    compressor = TopKEF(ratio=0.01, **options)
    local_sum, reduced_sum, nonzeros = {}, {}, {}

    def record(step, names, local, reduced):
        for name, g, r in zip(names, local, reduced):
            if isinstance(g, tf.IndexedSlices):
                continue
            local_sum[name] = local_sum.get(name, 0) + g.numpy()
            reduced_sum[name] = reduced_sum.get(name, 0) + r.numpy()
            nonzeros.setdefault(name, []).append(int(np.count_nonzero(r.numpy())))

    train_tape(compressor, steps=5, on_grads=record)
    residual_by_shape = {tuple(r.shape): r.residual.numpy() for _, r in compressor.registry if r.residual is not None}
    checked = []
    for name in sorted(local_sum):
        shape = local_sum[name].shape
        if shape not in residual_by_shape:
            continue
        total_local = hvd.allreduce(tf.constant(local_sum[name]), op=hvd.Sum, name=f"ef_local_{name}").numpy()
        total_residual = hvd.allreduce(tf.constant(residual_by_shape[shape]), op=hvd.Sum,
                                       name=f"ef_residual_{name}").numpy()
        sent = hvd.size() * reduced_sum[name]
        np.testing.assert_allclose(sent.reshape(-1) + total_residual, total_local.reshape(-1), rtol=1e-5, atol=1e-6)
        k = -(-local_sum[name].size // 100)
        assert max(nonzeros[name]) <= hvd.size() * k
        checked.append(name)
    assert set(checked) == {"w1", "w2"}
    assert compressor.stats()["compression_ratio"] > 5


def test_timeline_shows_allgather_and_no_allreduce_for_compressed_tensors():
    path = hvd.broadcast_object(tempfile.mktemp(suffix=".json", prefix="topk-tf-timeline-"), root_rank=0)
    compressor = TopKEF(ratio=0.01)
    hvd.start_timeline(path)
    train_tape(compressor, steps=3)
    hvd.stop_timeline()
    hvd.allreduce(tf.constant(0.0), name="timeline_done")  # every rank past stop_timeline
    compressed = sorted(n for n, r in compressor.registry.records.items() if r.residual is not None)
    dense = sorted(n for n, r in compressor.registry.records.items() if r.residual is None)
    problems = []
    if hvd.rank() == 0:
        events = timeline_activities(path)
        os.unlink(path)
        for name in compressed:
            # its own allgather, or its bucket's (named from its first and last members: core.buckets)
            gathered = [c for c in events if c.endswith(f"topk.{name}") or ("topk.bucket." in c and name in c)]
            if not gathered or not all("ALLGATHER" in events[c] for c in gathered):
                problems.append(f"{name}: no ALLGATHER ({gathered})")
            reduced = [c for c in events if name in c and "ALLREDUCE" in " ".join(events[c])]
            if reduced:
                problems.append(f"{name}: went through an allreduce too: {reduced}")
        if not any("ALLREDUCE" in " ".join(ev) for ev in events.values()):
            problems.append("the small dense tensors should have been allreduced")
    problems = hvd.broadcast_object(problems, root_rank=0)
    assert problems == []
    assert len(compressed) == 2 and len(dense) >= 2


def test_adasum_is_refused_at_construction():
    with tf.GradientTape() as tape:
        tf.reduce_sum(tf.Variable(1.0) * 2.0)
    with pytest.raises(ValueError, match="Adasum"):
        hvd.DistributedGradientTape(tape, compression=TopKEF, op=hvd.Adasum)


def _keras_fit(compression, epochs=2, wrapper=None):
    import horovod.tensorflow.keras as hvd_keras

    wrapper = wrapper or hvd_keras.DistributedOptimizer
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(64, activation="relu", input_shape=(32,)),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(4),
    ])
    opt = wrapper(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=compression)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, _, y = batch(0)
    model.fit(x.numpy().repeat(4, 0), y.numpy().repeat(4, 0), batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return {str(i): w for i, w in enumerate(model.get_weights())}


@pytest.mark.parametrize("wrapper", ["horovod.tensorflow.keras", "horovod.tensorflow"])
def test_keras_optimizer_ratio_one_matches_plain_horovod(wrapper):
    """Horovod's Keras wrapper, and hvd.DistributedOptimizer given a Keras optimizer (which delegates to it)."""
    import importlib

    distributed_optimizer = importlib.import_module(wrapper).DistributedOptimizer
    plain = _keras_fit(hvd.Compression.none, wrapper=distributed_optimizer)
    compressor = TopKEF(**EVERYTHING)
    ours = _keras_fit(compressor, wrapper=distributed_optimizer)
    stats = compressor.stats()
    assert_same(ours, plain)
    assert stats["steps"] == 8 and stats["tensors_compressed"] == 6


def test_keras_optimizer_at_one_percent_sends_less_and_trains():
    compressor = TopKEF(ratio=0.01, min_numel=1024)
    ours = _keras_fit(compressor)
    stats = compressor.stats()
    assert all(np.isfinite(w).all() for w in ours.values())
    assert stats["tensors_compressed"] == 2 and stats["bytes_sent"] < stats["bytes_dense"] / 5
