"""The traced graph of a TopKEF step: tensors of the same size share one traced selection/packing/decoding body
(horovod_topk.tensorflow.shared, issue 13), and the shared step still reduces like the unshared one."""
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
