"""The traced graph of a TopKEF step: tensors of the same size share one traced selection/packing/decoding body
(horovod_topk.tensorflow.shared), and the shared step still reduces like the unshared one."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_topk.tensorflow import TopKEF


def _topk_nodes(concrete) -> int:
    graph = concrete.graph.as_graph_def()
    return (sum(n.op == "TopKV2" for n in graph.node)
            + sum(n.op == "TopKV2" for f in graph.library.function for n in f.node_def))


def _step(variables, compression):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.sin(v) * float(hvd.rank() + 1 + i)) for i, v in enumerate(variables)])
        grads = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, variables)
        return grads
    return step


def test_equal_sized_tensors_share_one_traced_body_and_reduce_exactly():
    rng = np.random.RandomState(0)
    one = [tf.Variable(rng.randn(40, 50).astype(np.float32))]
    three = [tf.Variable(rng.randn(40, 50).astype(np.float32)) for _ in range(3)]
    single = _step(one, TopKEF(ratio=0.01)).get_concrete_function()
    comp = TopKEF(ratio=0.01)
    step = _step(three, comp)
    assert _topk_nodes(step.get_concrete_function()) == _topk_nodes(single)  # one body for the three tensors
    grads = step()
    # 2000 entries, k = 20 per rank: the mean of what the two ranks sent, EF exact (residual + sent == grad)
    for i, (v, g) in enumerate(zip(three, grads)):
        local = np.cos(v.numpy()) * float(hvd.rank() + 1 + i)
        # this tensor's residual: the one that leaves exactly k entries of its gradient sent (names are graph names)
        # (numpy's cos differs from TensorFlow's in the last bit: unsent entries are ~1e-7, sent ones ~1)
        sents = [np.where(np.abs(local.reshape(-1) - r.numpy()) > 1e-4, local.reshape(-1) - r.numpy(), 0.0)
                 for r in comp._residual_vars.values()]
        matching = [sent for sent in sents if np.count_nonzero(sent) == 20]
        assert len(matching) == 1
        sent = matching[0]
        np.testing.assert_allclose(g.numpy().reshape(-1), hvd.allreduce(tf.constant(sent), op=hvd.Average).numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_a_step_is_traced_once_and_a_retrace_may_add_tensors():
    """TopKEF's variables (created on a tensor's first reduction, i.e. while tracing) must not make tf.function
    trace the user's step a second time (horovod_topk.tensorflow.state): with the model's variables created before
    the first call, the step is traced exactly as often as dense's. A later trace of the same function for new
    shapes may create the state of tensors it had not seen."""
    rng = np.random.RandomState(1)
    traces = {"topk": 0, "dense": 0}

    def make(kind, compression):
        @tf.function
        def step(x, y=None):
            traces[kind] += 1
            sources = [x] if y is None else [x, y]
            with tf.GradientTape() as tape:
                tape.watch(sources)
                loss = tf.add_n([tf.reduce_sum(tf.sin(s) * float(hvd.rank() + 1)) for s in sources])
            return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, sources)[0]
        return step

    comp = TopKEF(ratio=0.01)
    topk_step = make("topk", comp)
    dense_step = make("dense", hvd.Compression.none)
    x = tf.constant(rng.randn(40, 50).astype(np.float32))
    applied = np.zeros(x.shape, np.float32)
    for _ in range(3):
        applied += topk_step(x).numpy()
        dense_step(x)
    assert traces == {"topk": 1, "dense": 1}
    assert comp.stats()["steps"] == 3 and len(comp._residual_vars) == 1
    # error feedback exact through the single trace: the 3 averages applied == mean over ranks of (3 g - residual)
    (residual,) = comp._residual_vars.values()
    local = 3 * np.cos(x.numpy()).reshape(-1) * float(hvd.rank() + 1) - residual.numpy()
    want = hvd.allreduce(tf.constant(local), op=hvd.Average).numpy()
    # another signature: a second trace of the same function, whose new tensor gets its own state
    topk_step(x, tf.constant(rng.randn(60, 50).astype(np.float32)))
    assert traces["topk"] == 2 and len(comp._residual_vars) == 2
    np.testing.assert_allclose(applied.reshape(-1), want, rtol=1e-4, atol=1e-4)
