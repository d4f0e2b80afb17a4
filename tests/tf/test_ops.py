import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core import PayloadLayout
from horovod_topk.tensorflow import ops


def _sent_dense(indices, values, numel):
    return tf.scatter_nd(indices[:, None], tf.cast(values, tf.float32), [numel]).numpy()


@pytest.mark.parametrize("k", [1, 10, 1000])
def test_selection_keeps_the_k_largest_and_loses_no_mass(k):
    rng = np.random.RandomState(0)
    grad = rng.randn(1000).astype(np.float32)
    residual = (rng.randn(1000) * 0.1).astype(np.float32)
    indices, values, new_residual = ops.compensate_and_select(tf.constant(grad), tf.constant(residual), k, tf.float32)
    compensated = residual + grad
    assert indices.dtype == tf.int32 and indices.shape == (k,)
    assert set(indices.numpy().tolist()) == set(np.argsort(-np.abs(compensated))[:k].tolist())
    np.testing.assert_allclose(_sent_dense(indices, values, 1000) + new_residual.numpy(), compensated, rtol=1e-6)
    assert np.all(new_residual.numpy()[indices.numpy()] == 0)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_half_precision_rounding_stays_in_the_residual(dtype):
    rng = np.random.RandomState(1)
    grad = tf.cast(rng.randn(4096) * 3, dtype)
    residual = tf.constant(rng.randn(4096).astype(np.float32) * 1e-3)
    indices, values, new_residual = ops.compensate_and_select(grad, residual, 64, dtype)
    compensated = residual.numpy() + tf.cast(grad, tf.float32).numpy()
    assert values.dtype == dtype and new_residual.dtype == tf.float32
    assert np.abs(new_residual.numpy()[indices.numpy()]).max() > 0
    np.testing.assert_allclose(_sent_dense(indices, values, 4096) + new_residual.numpy(), compensated, atol=1e-6)


@pytest.mark.parametrize("sampling", [None, "sampled"])
@pytest.mark.parametrize("wire,beyond,limit", [(tf.float16, 70000.0, 65504.0),
                                               (tf.bfloat16, 3.4e38, 3.3895313892515355e38)])
def test_a_value_beyond_the_wire_range_travels_clamped_and_the_excess_stays(wire, beyond, limit, sampling):
    """As in PyTorch (tests/pytorch/test_wire_range.py): a finite value never travels as an Inf, and never leaves an
    Inf in the residual; the excess stays there and error feedback stays exact."""
    grad = np.random.RandomState(2).randn(4000).astype(np.float32)
    grad[7], grad[1234] = beyond, -beyond
    k = 40
    geometry = ops.sample_geometry(4000, k, 400) if sampling else None
    indices, values, residual = ops.compensate_and_select(tf.constant(grad), tf.zeros(4000), k, wire, geometry)
    values64 = tf.cast(values, tf.float64).numpy()
    assert np.all(np.isfinite(values64)) and np.all(np.isfinite(residual.numpy()))
    sent = dict(zip(indices.numpy().tolist(), values64.tolist()))
    assert sent[7] == limit and sent[1234] == -limit
    total = residual.numpy().astype(np.float64)
    np.add.at(total, indices.numpy(), values64)
    assert np.array_equal(total, grad.astype(np.float64))
    clamped = ops.to_wire(tf.constant([float("inf"), float("nan"), -beyond]), wire)
    assert np.isposinf(tf.cast(clamped, tf.float64).numpy()[0]) and np.isnan(tf.cast(clamped, tf.float64).numpy()[1])
    assert tf.cast(clamped, tf.float64).numpy()[2] == -limit


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16, tf.float64])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_pack_unpack_round_trip(dtype, k):
    layout = PayloadLayout(k, dtype.size)
    rows = []
    for rank in range(3):
        idx = tf.range(k, dtype=tf.int32) * 7 + rank
        val = tf.cast(tf.range(k) + 100 * rank, dtype)
        buf = ops.pack(idx, val, layout)
        assert buf.dtype == tf.uint8 and buf.shape == (layout.nbytes,)
        rows.append((idx, val, buf))
    indices, values = ops.unpack(tf.concat([b for _, _, b in rows], 0), 3, layout, dtype)
    for rank, (idx, val, _) in enumerate(rows):
        assert np.array_equal(indices[rank].numpy(), idx.numpy())
        assert np.array_equal(tf.cast(values[rank], tf.float64).numpy(), tf.cast(val, tf.float64).numpy())


def test_payload_bytes_are_identical_to_the_pytorch_ones():
    """One layout, two frameworks: the same (indices, values) make the same bytes."""
    torch = pytest.importorskip("torch")
    from horovod_topk.torch import ops as torch_ops

    layout = PayloadLayout(5, 2)
    idx, val = [3, 1, 4, 1000, 59], [0.5, -2.0, 3.25, 1e-3, 7.0]
    tf_bytes = ops.pack(tf.constant(idx, tf.int32), tf.constant(val, tf.float16), layout).numpy()
    torch_bytes = torch_ops.pack(torch.tensor(idx, dtype=torch.int32), torch.tensor(val, dtype=torch.float16), layout)
    assert tf_bytes.tobytes() == torch_bytes.numpy().tobytes()


def test_scatter_sum_adds_collisions():
    dense = ops.scatter_sum(tf.constant([[0, 5], [5, 9]]), tf.constant([[1.0, 2.0], [3.0, 4.0]]), 10, tf.float32)
    expected = np.zeros(10, np.float32)
    expected[[0, 5, 9]] = [1.0, 5.0, 4.0]
    assert np.array_equal(dense.numpy(), expected)


@pytest.mark.parametrize("ratio", [0.1, 0.01, 0.001])
def test_sampled_selector_returns_exactly_the_top_k(ratio):
    rng = np.random.RandomState(3)
    n = 100_000
    k = int(np.ceil(ratio * n))
    magnitude = np.abs(rng.standard_t(2, n)).astype(np.float32)
    geometry = ops.sample_geometry(n, k, max(2048, int(100 / ratio)))
    chosen = ops.sampled_top_k_indices(tf.constant(magnitude), k, *geometry).numpy()
    assert len(set(chosen.tolist())) == k
    assert magnitude[chosen].min() >= np.sort(magnitude)[-k]


def test_sampled_selector_falls_back_when_the_sample_misleads():
    magnitude = np.zeros(10_000, np.float32)
    magnitude[1::2] = 1.0  # the strided sample (even positions) sees only zeros... and then everything is >= 0
    magnitude[7] = 5.0
    chosen = ops.sampled_top_k_indices(tf.constant(magnitude), 3, *ops.sample_geometry(10_000, 3, 64)).numpy()
    assert 7 in chosen.tolist() and len(set(chosen.tolist())) == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_entries_are_sent_and_never_enter_the_residual(bad):
    n, k = 5000, 50
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    grad[[7, 4000]] = bad
    residual = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    indices, values, new_residual, momentum, finite = ops.error_feedback_step(
        tf.constant(grad), tf.constant(residual), k, tf.float32, sampling=ops.sample_geometry(n, k, 1024)
    )
    assert momentum is None
    assert not bool(finite)
    ok = np.isfinite(grad)
    np.testing.assert_array_equal(new_residual.numpy(), np.where(ok, residual + np.where(ok, grad, 0), residual))
    assert set(indices.numpy().tolist()) == {7, 4000} and indices.numpy()[:2].tolist() == [7, 4000]
    assert not np.isfinite(values.numpy()).any()
    _, _, regular, _, finite = ops.error_feedback_step(tf.constant(np.where(ok, grad, 0)), tf.constant(residual), k,
                                                    tf.float32)
    assert bool(finite) and np.isfinite(regular.numpy()).all()


def _momentum_case(bad=None):
    rng = np.random.RandomState(3)
    grad = rng.randn(500).astype(np.float32)
    if bad is not None:
        grad[[7, 300]] = bad
    residual = (rng.randn(500) * 0.1).astype(np.float32)
    momentum = (rng.randn(500) * 0.5).astype(np.float32)
    out = ops.error_feedback_step(tf.constant(grad), tf.constant(residual), 20, tf.float32, None, tf.constant(momentum),
                                  0.9)
    return grad, residual, momentum, [None if t is None else t.numpy() for t in out]


def test_momentum_correction_accumulates_velocity_sends_it_and_masks_it():
    grad, residual, momentum, (indices, values, new_residual, new_momentum, finite) = _momentum_case()
    velocity = 0.9 * momentum + grad
    assert finite
    sent = np.zeros(500, np.float32)
    sent[indices] = values
    np.testing.assert_allclose(sent + new_residual, residual + velocity, rtol=1e-6, atol=1e-7)
    assert set(indices.tolist()) == set(np.argsort(-np.abs(residual + velocity))[:20].tolist())
    assert np.all(new_momentum[indices] == 0)
    kept = np.setdiff1d(np.arange(500), indices)
    np.testing.assert_allclose(new_momentum[kept], velocity[kept], rtol=1e-6)


def test_momentum_correction_keeps_nonfinite_entries_out_of_both_buffers():
    grad, residual, momentum, (indices, values, new_residual, new_momentum, finite) = _momentum_case(np.nan)
    finite_entries = np.isfinite(grad)
    velocity = np.where(finite_entries, 0.9 * momentum + grad, momentum)
    assert not finite and set(indices.tolist()) == {7, 300} and np.isnan(values).all()
    np.testing.assert_allclose(new_momentum, velocity, rtol=1e-6)
    np.testing.assert_allclose(new_residual, residual + np.where(finite_entries, velocity, 0), rtol=1e-6)
