"""TensorFlow TopKEF on one process: the compressor contract and state handling (no collectives)."""
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core import pending_of
from horovod_topk.tensorflow import TopKEF


def test_compress_marks_an_alias_eagerly_and_in_a_function():
    comp = TopKEF(ratio=0.1)
    t = tf.ones([4, 4])
    alias, ctx = comp.compress(t)
    assert pending_of(alias) is ctx and pending_of(t) is None and ctx.source_name is None and ctx.shape == (4, 4)

    seen = {}

    @tf.function
    def traced(x):
        y = tf.matmul(x, x, name="grad_like")
        alias, ctx = comp.compress(y)
        seen["ctx"] = ctx
        return alias

    traced(t)
    assert seen["ctx"].source_name.startswith("grad_like")


def test_class_is_a_compressor_too():
    alias, ctx = TopKEF.compress(tf.ones([3]))
    assert ctx.compressor is TopKEF.default()
    with pytest.warns(UserWarning, match="reduced dense"):
        TopKEF.decompress(alias, ctx)


def test_state_dict_holds_numpy_residuals_and_round_trips():
    comp = TopKEF(ratio=0.5)
    rec = comp.registry.record("w", (2, 2))
    rec.residual, rec.steps = np.arange(4, dtype=np.float32), 3
    state = comp.state_dict()
    assert isinstance(state["tensors"]["w"]["residual"], np.ndarray)
    other = TopKEF()
    other.load_state_dict(state)
    assert np.array_equal(other.registry.records["w"].residual, np.arange(4, dtype=np.float32))
    assert other.stats()["steps"] == 3 and other.stats()["residual_norm"] == pytest.approx(np.sqrt(14))


def test_invalid_options_are_refused():
    with pytest.raises(ValueError, match="ratio"):
        TopKEF(ratio=0)
    with pytest.raises(ValueError, match="k must be"):
        TopKEF(k=0)


def test_warmup_momentum_and_spike_guard_are_accepted():
    assert TopKEF(warmup_steps=10, momentum=0.9, spike_guard=3.0).config.momentum == 0.9


def test_sparse_allreduce_is_accepted_and_refused_only_with_the_compact_encoding():
    assert TopKEF(exchange="sparse_allreduce").config.exchange == "sparse_allreduce"
    assert TopKEF(exchange="allgather").config.exchange == "allgather"
    with pytest.raises(ValueError, match="sparse_allreduce"):
        TopKEF(exchange="sparse_allreduce", index_bits=16)
