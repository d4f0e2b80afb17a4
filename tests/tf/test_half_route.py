"""ratio="auto"'s fp16 route in TensorFlow on one rank (tensorflow.half_route.to_half): what float16 does not carry
stays in the residual, a sum of P ranks' values cannot overflow, non-finite gradients are sent but never kept, and
the bits are PyTorch's for the same inputs."""
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.exchange import half_limit
from horovod_topk.tensorflow.half_route import to_half


def _carried(sent: tf.Tensor, scale: float) -> np.ndarray:
    return sent.numpy().astype(np.float64) / scale


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_what_float16_does_not_carry_stays_in_the_residual(world_size):
    rng = np.random.RandomState(0)
    scale = 1.0 / world_size
    grad = (rng.randn(10_000) * np.logspace(-9, 3, 10_000)).astype(np.float32)  # below subnormals up to large
    residual = (rng.randn(10_000) * 1e-4).astype(np.float32)
    acc = grad.astype(np.float64) + residual
    sent, new_residual, finite = to_half(tf.constant(grad), tf.constant(residual), scale, world_size)
    assert sent.dtype == tf.float16 and bool(finite)
    kept = new_residual.numpy().astype(np.float64)
    # exact error feedback: what travelled plus what stays is what there was (float32 rounding of the residual)
    np.testing.assert_allclose(_carried(sent, scale) + kept, acc, rtol=1.2e-7, atol=1e-12)
    assert np.count_nonzero(kept) > 0  # rounding and underflow did stay
    # at most half a float16 step of the value (relative 2**-11) where nothing was clamped
    assert (np.abs(kept) <= np.abs(acc) * 2 ** -11 / (1 - 2 ** -11) + 2 ** -25 / scale).all()


@pytest.mark.parametrize("world_size", [3, 4, 7])
def test_the_sum_of_every_rank_cannot_overflow_and_the_clamped_part_waits(world_size):
    scale = 1.0 / world_size
    grad = np.array([1e6, -3e5, 70000.0, 1.0], np.float32)
    residual = tf.zeros([4])
    sent, residual, _ = to_half(tf.constant(grad), residual, scale, world_size)
    assert np.isfinite(sent.numpy()).all() and np.abs(sent.numpy().astype(np.float32)).max() <= half_limit(world_size)
    total = sent.numpy()
    for _ in range(world_size - 1):  # P ranks' sum, rounded to float16 at every step as a reduction does
        total = (total.astype(np.float32) + sent.numpy().astype(np.float32)).astype(np.float16)
    assert np.isfinite(total).all()
    np.testing.assert_allclose(_carried(sent, scale) + residual.numpy(), grad, rtol=1e-7, atol=0)
    total = _carried(sent, scale)
    for _ in range(200):  # a zero gradient keeps draining the residual: nothing is lost
        sent, residual, _ = to_half(tf.zeros([4]), residual, scale, world_size)
        total += _carried(sent, scale)
    np.testing.assert_allclose(total + residual.numpy(), grad, rtol=1e-7, atol=0)
    assert np.abs(residual.numpy()).max() < 1e-2


def test_a_non_finite_gradient_is_sent_as_such_and_never_kept():
    grad = tf.constant([np.nan, np.inf, -np.inf, 0.5, 1e6], tf.float32)
    residual = tf.constant([0.1, 0.2, 0.3, 0.4, 0.0], tf.float32)
    sent, kept, finite = to_half(grad, residual, 0.5, 2)
    sent, kept = sent.numpy(), kept.numpy()
    assert not bool(finite)
    assert np.isnan(sent[0]) and sent[1] == np.inf and sent[2] == -np.inf
    np.testing.assert_array_equal(kept[:3], residual.numpy()[:3])  # the old values stay, finite
    assert np.isfinite(kept).all()
    np.testing.assert_allclose(sent[3:].astype(np.float64) / 0.5 + kept[3:], [0.9, 1e6], rtol=1e-7, atol=0)


def test_a_zero_scale_is_refused():
    with pytest.raises(ValueError, match="scaled by 0"):
        to_half(tf.zeros([2]), tf.zeros([2]), 0.0, 2)


@pytest.mark.parametrize("scale,world_size", [(0.5, 2), (1 / 3, 3), (2.0, 4)])
def test_the_same_bits_as_pytorch(scale, world_size):
    """One rule for both frameworks: TensorFlow's operations give PyTorch's values and residuals bit for bit
    (a postscale above 1 included, which makes some finite values infinite before the clamp)."""
    torch = pytest.importorskip("torch")
    from horovod_topk.torch.half_route import to_half as torch_to_half

    rng = np.random.RandomState(1)
    grad = (rng.randn(4096) * np.logspace(-9, 5, 4096)).astype(np.float32)
    grad[::97] = np.nan
    grad[5::101] = np.inf
    residual = (rng.randn(4096) * 1e-3).astype(np.float32)
    sent, kept, _ = to_half(tf.constant(grad), tf.constant(residual), scale, world_size)
    torch_residual = torch.from_numpy(residual.copy())
    torch_sent, _ = torch_to_half(torch.from_numpy(grad), torch_residual, scale, world_size)
    np.testing.assert_array_equal(sent.numpy().view(np.uint16), torch_sent.numpy().view(np.uint16))
    np.testing.assert_array_equal(kept.numpy().view(np.uint32), torch_residual.numpy().view(np.uint32))
