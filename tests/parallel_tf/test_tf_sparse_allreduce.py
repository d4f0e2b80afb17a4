"""exchange="sparse_allreduce" in TensorFlow on real Horovod workers: parity with plain Horovod at ratio 1.0, exact
error feedback over all ranks below it, a NaN that reaches every rank, the refusals, and the ranks' agreement."""
import math

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core import PayloadLayout, RankMismatch
from horovod_topk.core.exchange import SparseAllreduceLayouts, choose_exchange
from horovod_topk.tensorflow import TopKEF

from .tf_harness import assert_same, train_tape

SPARSE = dict(min_numel=0, dense_fallback=False, exchange="sparse_allreduce")
COMPRESSED = {(32, 64), (64, 32), (64,), (32, 4)}  # the harness' dense gradients; emb's too with sparse_as_dense


def _sent_by_sparse_allreduce(compressor, ratio, value_itemsize=4):
    """Whether every compressed tensor's bytes_sent is exactly that of the sparse allreduce on every step."""
    size = hvd.size()
    compressor.stats()  # reads the counter variables back into the records
    for _, record in compressor.registry:
        if record.residual is None:
            continue
        assert record.steps > 0
        numel = int(np.prod(record.shape))
        k = max(1, math.ceil(ratio * numel - 1e-9))
        expected = SparseAllreduceLayouts(k, size, value_itemsize, numel).sent_nbytes
        if record.bytes_sent != record.steps * expected:
            return False
    return True


@pytest.mark.parametrize("option", ["average", "sum", "sparse_as_dense"])
def test_ratio_one_matches_plain_horovod(option):
    kwargs = {"sum": {"op": hvd.Sum}, "sparse_as_dense": {"sparse_as_dense": True}}.get(option, {})
    plain = train_tape(hvd.Compression.none, steps=3, **kwargs)
    compressor = TopKEF(ratio=1.0, **SPARSE)
    ours = train_tape(compressor, steps=3, **kwargs)
    assert_same(ours, plain)
    stats = compressor.stats()
    assert stats["tensors_compressed"] == len(COMPRESSED) + (option == "sparse_as_dense")
    assert stats["exchanges"] == {"sparse_allreduce": stats["tensors_compressed"]}
    assert _sent_by_sparse_allreduce(compressor, 1.0), "every compressed tensor must take the sparse allreduce"


def _reducer(shapes, compressor, op):
    """A tf.function that reduces the given gradients (one per variable of ``shapes``) through
    DistributedGradientTape: the gradient of sum(v * g) with respect to v is g itself."""
    variables = [tf.Variable(tf.zeros(shape), name=f"v{i}") for i, shape in enumerate(shapes)]

    @tf.function
    def reduce(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        return hvd.DistributedGradientTape(tape, compression=compressor, op=op).gradient(loss, variables)

    return reduce


def _residuals_by_shape(compressor):
    return {tuple(r.shape): r.residual.numpy().astype(np.float64).copy()
            for _, r in compressor.registry if r.residual is not None}


@pytest.mark.parametrize("value_dtype", [None, "float16"])
@pytest.mark.parametrize("op_name", ["average", "sum"])
def test_error_feedback_is_exact_over_all_ranks(op_name, value_dtype):
    size, ratio = hvd.size(), 0.05
    op = hvd.Average if op_name == "average" else hvd.Sum
    shapes = [(16, 8, 3, 3), (500, 16), (3000,)]
    compressor = TopKEF(ratio=ratio, min_numel=0, value_dtype=value_dtype, exchange="sparse_allreduce")
    reduce = _reducer(shapes, compressor, op)
    rng = np.random.RandomState(hvd.rank())
    old = {s: np.zeros(int(np.prod(s))) for s in shapes}
    for step in range(3):
        grads = [(rng.randn(*s) * (1 + 10 * (step % 2))).astype(np.float32) for s in shapes]
        out = [o.numpy() for o in reduce([tf.constant(g) for g in grads])]
        new = _residuals_by_shape(compressor)
        for i, shape in enumerate(shapes):
            tag = f"inv.{op_name}.{value_dtype}.{i}.{step}"
            before = hvd.allreduce(tf.constant(old[shape] + grads[i].reshape(-1).astype(np.float64)), op=hvd.Sum,
                                   name=f"{tag}.before").numpy()
            residuals = hvd.allreduce(tf.constant(new[shape]), op=hvd.Sum, name=f"{tag}.res").numpy()
            applied = out[i].reshape(-1).astype(np.float64) * (size if op_name == "average" else 1)
            rows = hvd.allgather(tf.constant(applied[None]), name=f"{tag}.applied").numpy()
            assert all(np.array_equal(rows[0], row) for row in rows), "every rank must apply the same update"
            np.testing.assert_allclose(residuals + applied, before, rtol=0, atol=1e-4, err_msg=str(shape))
            k = math.ceil(ratio * int(np.prod(shape)))
            assert 0 < np.count_nonzero(applied) <= k + size  # at most P * ceil(k / P) entries applied
        old = new
    assert _sent_by_sparse_allreduce(compressor, ratio, 2 if value_dtype == "float16" else 4)


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_values_beyond_float16_travel_clamped_and_the_excess_follows(exchange):
    """value_dtype="float16" with gradients past 65504: every rank applies the same finite update, no residual
    holds an Inf, error feedback stays exact over all ranks, and the excess goes out on the following steps (every
    rank's entry 11 is 60000, so the sparse allreduce's owner re-sends a sum past 65504; each rank's own entry
    passes it alone). As in PyTorch (tests/parallel_torch/test_torch_sparse_allreduce.py)."""
    compressor = TopKEF(ratio=0.05, min_numel=0, dense_fallback=False, value_dtype="float16", exchange=exchange)
    reduce = _reducer([(3000,)], compressor, hvd.Sum)
    grad = np.random.RandomState(hvd.rank()).randn(3000).astype(np.float32)
    grad[11] = 60000.0
    grad[2000:2000 + hvd.size()] = 0.0
    grad[2000 + hvd.rank()] = 1e5
    old, applied_total = np.zeros(3000), np.zeros(3000)
    for step in range(4):
        (out,) = reduce([tf.constant(grad)])
        out = out.numpy().astype(np.float64)
        (new,) = _residuals_by_shape(compressor).values()
        assert np.isfinite(out).all() and np.isfinite(new).all()
        tag = f"range.{exchange}.{step}"
        rows = hvd.allgather(tf.constant(out[None]), name=f"{tag}.out").numpy()
        assert all(np.array_equal(rows[0], row) for row in rows), "every rank must apply the same update"
        before = hvd.allreduce(tf.constant(old + grad.astype(np.float64)), op=hvd.Sum, name=f"{tag}.before").numpy()
        residuals = hvd.allreduce(tf.constant(new), op=hvd.Sum, name=f"{tag}.res").numpy()
        np.testing.assert_allclose(residuals + out, before, rtol=0, atol=0.05)
        applied_total += out
        old, grad = new, np.zeros(3000, np.float32)  # the following steps send what stayed
    assert applied_total[11] == pytest.approx(60000.0 * hvd.size(), abs=0.05), "the excess went out"
    for rank in range(hvd.size()):
        assert applied_total[2000 + rank] == pytest.approx(1e5, abs=0.05)


def test_a_nan_on_one_rank_reaches_every_rank_and_never_enters_a_residual():
    compressor = TopKEF(ratio=0.05, min_numel=0, exchange="sparse_allreduce")
    reduce = _reducer([(4000,)], compressor, hvd.Average)
    rng = np.random.RandomState(hvd.rank())
    for step in range(2):
        grad = rng.randn(4000).astype(np.float32)
        if hvd.rank() == 0 and step == 1:
            grad[123] = np.nan
        (out,) = reduce([tf.constant(grad)])
        out = out.numpy()
        assert np.isnan(out[123]) == (step == 1)
        assert np.isfinite(np.delete(out, 123)).all()
        assert all(np.isfinite(r).all() for r in _residuals_by_shape(compressor).values())
    assert compressor.stats()["nonfinite_steps"] == (1 if hvd.rank() == 0 else 0)


@pytest.mark.parametrize("compact", [{"index_bits": 16}, {"value_dtype": "float8"}])
def test_the_compact_encoding_is_refused_with_the_sparse_allreduce(compact):
    with pytest.raises(ValueError, match="compact encoding .* travels by allgather"):
        TopKEF(exchange="sparse_allreduce", **compact)


def test_auto_follows_the_cost_model():
    """exchange="auto" takes core.exchange.choose_exchange's answer: on 2 workers the allgather (k entries against
    ~1.05 k), so its bytes are the allgather's."""
    compressor = TopKEF(ratio=0.05, min_numel=0, dense_fallback=False)
    train_tape(compressor, steps=1)
    compressor.stats()  # reads the counter variables back into the records
    for _, record in compressor.registry:
        if record.residual is None:
            continue
        numel = int(np.prod(record.shape))
        k = math.ceil(0.05 * numel - 1e-9)
        exchange, _ = choose_exchange("auto", hvd.size(), numel, k, 4, 4, dense_fallback=False)
        expected = (SparseAllreduceLayouts(k, hvd.size(), 4, numel).sent_nbytes if exchange == "sparse_allreduce"
                    else PayloadLayout(k, 4).nbytes)
        assert record.bytes_sent == expected, (record.shape, exchange)


def test_warm_up_keeps_error_feedback_exact_and_sends_each_steps_bytes():
    """With a sparsity warm-up one branch of the graph serves every step's k by the sparse allreduce: per step,
    error feedback exact over all ranks and exactly the bytes of core's layouts for that step's k."""
    from horovod_topk.core.policy import plan_tensor

    compressor = TopKEF(ratio=0.05, warmup_steps=3, **SPARSE)
    reduce = _reducer([(3000,)], compressor, hvd.Sum)
    rng = np.random.RandomState(hvd.rank())
    old, sent_before, ks = np.zeros(3000), 0, []
    for step in range(5):
        grad = rng.randn(3000).astype(np.float32)
        (out,) = reduce([tf.constant(grad)])
        (new,) = _residuals_by_shape(compressor).values()
        before = hvd.allreduce(tf.constant(old + grad), op=hvd.Sum, name=f"warm.before.{step}").numpy()
        residuals = hvd.allreduce(tf.constant(new), op=hvd.Sum, name=f"warm.res.{step}").numpy()
        np.testing.assert_allclose(residuals + out.numpy().astype(np.float64), before, rtol=0, atol=1e-4)
        plan = plan_tensor("v", 3000, True, compressor.config, world_size=hvd.size(), step=step,
                           sparse_available=True)
        compressor.stats()
        (record,) = [r for _, r in compressor.registry if r.residual is not None]
        assert plan.exchange == "sparse_allreduce"
        assert record.bytes_sent - sent_before == SparseAllreduceLayouts(plan.k, hvd.size(), 4, 3000).sent_nbytes
        old, sent_before = new, record.bytes_sent
        ks.append(plan.k)
    assert len(set(ks)) == 4 and ks[-1] == 150  # one graph, four sizes
    assert compressor.stats()["steps"] == 5


def test_ranks_that_disagree_about_the_exchange_raise_on_every_rank():
    exchange = "sparse_allreduce" if hvd.rank() == 0 else "allgather"
    compressor = TopKEF(ratio=0.05, min_numel=0, dense_fallback=False, exchange=exchange)
    reduce = _reducer([(3000,)], compressor, hvd.Average)
    with pytest.raises(RankMismatch, match="exchange \\(rank 0: 'sparse_allreduce', rank 1: 'allgather'\\)"):
        reduce([tf.constant(np.ones(3000, np.float32))])
    hvd.allreduce(tf.constant(1.0), name="after.exchange.disagreement")  # both ranks got past the error
