"""horovod_topk.tensorflow.shared: one traced body per distinct signature, same results as a direct call."""
import numpy as np
import tensorflow as tf

from horovod_topk.core.payload import payload_layout
from horovod_topk.tensorflow import ops, shared


def _graph_nodes(concrete, op_type: str) -> int:
    graph = concrete.graph.as_graph_def()
    return (sum(n.op == op_type for n in graph.node)
            + sum(n.op == op_type for f in graph.library.function for n in f.node_def))


def test_equal_signatures_share_one_trace_and_match_the_direct_call():
    rng = np.random.RandomState(0)
    grads = [tf.constant(rng.randn(n).astype(np.float32)) for n in (300, 300, 300, 400)]
    residual = tf.Variable(rng.randn(300).astype(np.float32))
    before = shared.traced_count()

    @tf.function
    def step():
        return [shared.call(ops.error_feedback_step, g, residual if g.shape[0] == 300 else tf.zeros([400]), 3,
                            tf.float32, (5, 4)) for g in grads]

    got = step()
    # three 300-entry tensors share one function; the 400-entry one has another
    assert shared.traced_count() - before == 2
    assert _graph_nodes(step.get_concrete_function(), "TopKV2") == 2 * _graph_nodes(
        tf.function(lambda: ops.error_feedback_step(grads[0], residual, 3, tf.float32, (5, 4))).get_concrete_function(),
        "TopKV2")
    for g, out in zip(grads, got):
        want = ops.error_feedback_step(g, residual if g.shape[0] == 300 else tf.zeros([400]), 3, tf.float32, (5, 4))
        for a, b in zip(out, want):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_tensors_nested_in_arguments_are_inputs_and_layouts_are_fixed():
    layout = payload_layout(4, 100, 4)
    before = shared.traced_count()

    @tf.function
    def pack(step):
        # k and the sampling geometry as tensors (the warm-up's case): inputs, not part of the trace's key
        k = tf.constant(4) + 0 * step
        return (shared.call(ops.pack, tf.range(4), tf.ones([4]), layout),
                shared.call(ops.error_feedback_step, tf.ones([100]), tf.zeros([100]), k, tf.float32,
                            (tf.constant(3), tf.constant(2))))

    payload, _ = pack(tf.constant(0))
    assert shared.traced_count() - before == 2
    np.testing.assert_array_equal(payload.numpy(), ops.pack(tf.range(4), tf.ones([4]), layout).numpy())


def test_other_values_and_eager_calls_run_directly():
    before = shared.traced_count()
    seen = []

    def fn(x, marker):
        seen.append(marker)
        return x + 1

    marker = object()  # not a plain value: nothing to key a shared trace on

    @tf.function
    def traced():
        return shared.call(fn, tf.ones([2]), marker)

    np.testing.assert_array_equal(traced().numpy(), [2, 2])
    np.testing.assert_array_equal(shared.call(fn, tf.ones([2]), 7).numpy(), [2, 2])  # eager
    assert shared.traced_count() == before and seen == [marker, 7]


def test_one_body_serves_every_size_and_writes_each_tensors_own_residual():
    """steps.send through call_any_shape: tensors of different sizes and k share one trace, the sizes come from
    each tensor's row, and each body call writes the residual whose handle it was given."""
    from horovod_topk.core import TopKConfig
    from horovod_topk.tensorflow import sizes, steps

    rng = np.random.RandomState(1)
    numels = (500, 500, 3000)
    grads = [tf.constant(rng.randn(n).astype(np.float32)) for n in numels]
    starts = [rng.randn(n).astype(np.float32) for n in numels]
    residuals = [tf.Variable(start) for start in starts]
    plans = [sizes.fixed_plan(TopKConfig(selector="exact"), k, n, 4, 1, "allgather")
             for k, n in zip((7, 7, 40), numels)]
    assert len({plan.options for plan in plans}) == 1
    before = shared.traced_count()

    @tf.function
    def step():
        return [shared.call_any_shape(steps.send, g, r.handle, None, plan.row(None, g.shape[0]), options=plan.options,
                                      state_dtype=tf.float32, select_dtype=tf.float32, momentum=0.0)
                for g, r, plan in zip(grads, residuals, plans)]

    sent = step()
    assert shared.traced_count() - before == 1
    assert _graph_nodes(step.get_concrete_function(), "TopKV2") == 1  # one body, three calls
    for g, start, r, plan, (payload, finite) in zip(grads, starts, residuals, plans, sent):
        indices, values, new_residual, _, _ = ops.error_feedback_step(g, tf.constant(start), plan.ks[0], tf.float32)
        np.testing.assert_array_equal(r.numpy(), new_residual.numpy())
        np.testing.assert_array_equal(payload.numpy(), ops.pack(indices, values, plan.layouts[0]).numpy())
        assert bool(finite)


def test_constant_inputs_reach_the_shared_body_through_a_placeholder():
    """A constant input would make TensorFlow's optimiser copy the body for that call (call_any_shape's
    _not_constant): the call sees a PlaceholderWithDefault, and the value is unchanged."""

    def double(x):
        return x * 2

    @tf.function
    def traced():
        return shared.call_any_shape(double, tf.constant([1, 2, 3]))

    np.testing.assert_array_equal(traced().numpy(), [2, 4, 6])
    graph = traced.get_concrete_function().graph
    call = next(op for op in graph.get_operations() if op.type in ("StatefulPartitionedCall", "PartitionedCall"))
    assert all(t.op.type != "Const" for t in call.inputs)
    assert any(t.op.type == "PlaceholderWithDefault" for t in call.inputs)
