"""horovod_topk.tensorflow.sizes: one traced graph whose sizes follow the step's k builds the same bytes and the
same selection as a graph built for that k alone (single process)."""
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core import TopKConfig
from horovod_topk.core.exchange import SPARSE_ALLREDUCE
from horovod_topk.core.payload import PayloadLayout
from horovod_topk.tensorflow import encoding, ops, sizes

NUMEL = 70_000  # two 16-bit index segments
COUNTS = [0, 9000, 3001, 800, 123, 77]  # step 0 goes dense (another branch)


@pytest.mark.parametrize("options,value_dtype", [
    ({}, tf.float32), ({"value_dtype": "float16"}, tf.float16), ({"index_bits": 16}, tf.float32),
    ({"index_bits": 16, "value_dtype": "float8"}, tf.float32), ({"selector": "exact"}, tf.float32),
])
def test_one_graph_builds_each_steps_payload_as_a_graph_for_that_k_alone(options, value_dtype):
    config = TopKConfig(**options)
    itemsize = 1 if config.value_dtype == "float8" else value_dtype.size
    rng = np.random.RandomState(0)
    grad = tf.constant(rng.standard_t(3, NUMEL).astype(np.float32))
    residual = tf.constant((rng.randn(NUMEL) * 0.1).astype(np.float32))

    def payload(size, wire):
        indices, values, new_residual, _, _ = ops.error_feedback_step(grad, residual, size.k, wire, size.sampling)
        if size.layout.compact:
            return encoding.encode(indices, values, new_residual, size.layout)
        return ops.pack(indices, values, size.layout), new_residual

    wire = tf.float32 if config.value_dtype == "float8" else value_dtype

    @tf.function
    def per_step(step):
        return payload(sizes.step_plan(config, COUNTS, NUMEL, itemsize, 2, "allgather").at(step), wire)

    traces = per_step.experimental_get_tracing_count
    for t, k in enumerate(COUNTS):
        if not k:
            continue
        got, got_residual = per_step(tf.constant(t))
        fixed = sizes.fixed_plan(config, k, NUMEL, itemsize, 2, "allgather").at(None)
        want, want_residual = payload(fixed, wire)
        assert got.shape == (fixed.layout.nbytes,), (t, k)
        # the same entries (the order within a payload may differ between top_k calls of other static sizes);
        # float8's scale may differ in its last bit between a graph and eager ops
        unpack = encoding.decode if fixed.layout.compact else ops.unpack
        got_i, got_v = (t.numpy().ravel() for t in unpack(got, 1, fixed.layout, wire))
        want_i, want_v = (t.numpy().ravel() for t in unpack(want, 1, fixed.layout, wire))
        np.testing.assert_array_equal(np.sort(got_i), np.sort(want_i))
        np.testing.assert_allclose(got_v[np.argsort(got_i)], want_v[np.argsort(want_i)], rtol=1e-6)
        # (a last-bit change of float8's scale moves its rounding, kept in the residual, by up to 448 of its ulps)
        np.testing.assert_allclose(got_residual.numpy(), want_residual.numpy(), rtol=0,
                                   atol=1e-4 if config.value_dtype == "float8" else 0)
        sent = np.zeros(NUMEL, np.float64)
        np.add.at(sent, got_i, got_v.astype(np.float64))
        np.testing.assert_allclose(sent + got_residual.numpy(), grad.numpy() + residual.numpy(), rtol=0, atol=1e-5)
    assert traces() == 1, "one graph for every k"


def test_step_sparse_layouts_are_cores_layouts_of_the_steps_k():
    from horovod_topk.core.exchange import SparseAllreduceLayouts

    config = TopKConfig()
    size = sizes.step_plan(config, COUNTS, NUMEL, 4, 4, SPARSE_ALLREDUCE).at(tf.constant(3))
    want = SparseAllreduceLayouts(COUNTS[3], 4, 4, NUMEL)
    assert int(size.k) == COUNTS[3] and int(size.sparse.sent_nbytes) == want.sent_nbytes
    assert int(size.sparse.send.k) == want.send.k and int(size.sparse.kept.nbytes) == want.kept.nbytes
    assert int(size.layout.nbytes) == PayloadLayout(COUNTS[3], 4).nbytes and size.layout.index_bits == 32


@pytest.mark.parametrize("options", [{}, {"index_bits": 16}, {"index_bits": 16, "value_dtype": "float8"},
                                     {"selector": "exact"}])
def test_a_row_gives_the_layout_and_selection_of_its_plan(options):
    """sizes_of_row (the sizes the shared bodies of horovod_topk.tensorflow.steps read from their input): every
    field equals core's PayloadLayout of that k, for fixed plans and for each step of a warm-up plan."""
    config = TopKConfig(**options)
    itemsize = 1 if config.value_dtype == "float8" else 4
    plans = [sizes.fixed_plan(config, k, NUMEL, itemsize, 2, "allgather") for k in (123, 9000)]
    plans.append(sizes.step_plan(config, COUNTS, NUMEL, itemsize, 2, "allgather"))
    for plan in plans:
        for t, (k, layout, geometry) in enumerate(zip(plan.ks, plan.layouts, plan.sampling)):
            got = sizes.sizes_of_row(plan.options, plan.row(tf.constant(t) if plan.per_step else None, NUMEL))
            assert int(got.k) == k
            assert (got.sampling is None) == (geometry is None)
            if geometry is not None:
                assert (int(got.sampling[0]), int(got.sampling[1])) == geometry
            assert int(got.layout.numel) == NUMEL  # the tensor's size, whatever the index width
            for field in ("segments", "indices_offset", "indices_end", "indices_nbytes", "values_offset",
                          "values_nbytes", "values_end", "nbytes", "scale_nbytes", "counts_offset", "compact",
                          "index_bits", "value_itemsize", "scaled"):
                assert int(getattr(got.layout, field)) == int(getattr(layout, field)), (field, t)
