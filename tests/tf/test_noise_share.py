"""The calibrated second moment's TensorFlow ops (horovod_topk.tensorflow.noise_share) against core's integer
definitions and a NumPy reference: the signs every rank and framework draws alike, the sketch, the shares."""
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.update_mode import row_sign, sketch_salt
from horovod_topk.tensorflow import noise_share


@pytest.mark.parametrize("step,position", [(1, 0), (7, 3), (123_456, 77), (2**40 + 3, 5)])
def test_the_salt_of_a_step_tensor_is_cores_eagerly_and_traced(step, position):
    expected = sketch_salt(step, position)
    assert int(noise_share.sketch_salt(tf.constant(step, tf.int64), position)) == expected
    traced = tf.function(lambda s: noise_share.sketch_salt(s, position))
    assert int(traced(tf.constant(step, tf.int64))) == expected


def test_the_row_signs_are_cores():
    salt = sketch_salt(11, 2)
    signs = noise_share.row_signs(700, tf.constant(salt, tf.int64)).numpy()
    assert signs.dtype == np.float32
    assert signs.tolist() == [float(row_sign(r, salt)) for r in range(700)]


@pytest.mark.parametrize("shape", [(1,), (40,), (64,), (65,), (37, 29)])
def test_the_sketch_is_cores_definition_and_ends_with_the_squared_norm(shape):
    width, salt = 64, sketch_salt(3, 1)
    g = np.random.RandomState(sum(shape)).randn(*shape).astype(np.float32)
    out = noise_share.sketch(tf.constant(g), width, tf.constant(salt, tf.int64)).numpy()
    flat = g.reshape(-1).astype(np.float64)
    expected = np.zeros(width)
    for i, value in enumerate(flat):
        expected[i % width] += row_sign(i // width, salt) * value
    np.testing.assert_allclose(out[:width], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[width], np.square(flat).sum(), rtol=1e-5)


def test_an_embeddings_indexed_slices_count_as_their_dense_sum():
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), tf.constant([0, 2, 0]),
                              dense_shape=tf.constant([3, 2]))
    salt = tf.constant(sketch_salt(1, 0), tf.int64)
    dense = tf.constant([[6.0, 8.0], [0.0, 0.0], [3.0, 4.0]])
    np.testing.assert_allclose(noise_share.sketch(slices, 4, salt).numpy(), noise_share.sketch(dense, 4, salt).numpy())


def test_the_shares_are_clamped_and_a_zero_gradient_gets_one():
    world = 4
    agree = np.concatenate([4 * np.ones(8), [4 * 8]])  # 4 ranks sent the same sketch of a gradient of 8 ones
    noise = np.concatenate([np.zeros(8), [4 * 8]])  # their sketches cancel: pure noise
    zero = np.zeros(9)
    half = np.concatenate([np.full(8, 2.0 * np.sqrt(2.0)), [32.0]])  # ||sum||^2 = 64 over 4 * 32: 0.5
    shares = noise_share.noise_shares(tf.constant(np.stack([agree, noise, zero, half]), tf.float32), world).numpy()
    np.testing.assert_allclose(shares, [1.0, 1.0 / world, 1.0, 0.5], rtol=1e-6)
