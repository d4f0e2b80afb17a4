"""The calibrated second moment's noise share in TensorFlow ops: the sketch each rank sends, and the share each
tensor gets from the ranks' sum (core.update_mode has the why and the layout).

Pure functions of tensors, no collectives and no state: tensorflow.update_mode makes the calls. The salt and the
rows' signs are core's integer definitions (sketch_salt, row_sign) vectorised here, so a rank draws the signs
torch would draw for the same step and tensor.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..core.update_mode import MASK31, SALT_MULTIPLIERS, SALT_OFFSET, SIGN_HASH_MULTIPLIERS

__all__ = ["sketch_salt", "row_signs", "sketch", "noise_shares"]

#: The smallest normal float32: a floor for the divisor where it is zero (that branch is not taken then).
_TINY = 1.1754944e-38


def _xorshift(x: tf.Tensor, bits: int) -> tf.Tensor:
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(bits, x.dtype)))


def sketch_salt(step: Any, position: int) -> tf.Tensor:
    """core.update_mode.sketch_salt of a step held in a tensor (the optimizer's iterations + 1), as an int64 scalar:
    the same 64-bit arithmetic in uint64, which wraps as the definition's mask does. On the host (uint64
    multiplication has no kernel on every device); a scalar."""
    first, second, third = SALT_MULTIPLIERS
    offset = (int(position) * second + SALT_OFFSET) & (2**64 - 1)
    with tf.device("/cpu:0"):
        x = tf.cast(tf.convert_to_tensor(step), tf.uint64) * tf.constant(first, tf.uint64) + tf.constant(offset,
                                                                                                          tf.uint64)
        x = _xorshift(x, 30) * tf.constant(second, tf.uint64)
        x = _xorshift(x, 27) * tf.constant(third, tf.uint64)
        x = tf.bitwise.bitwise_and(_xorshift(x, 31), tf.constant(MASK31, tf.uint64))
        return tf.cast(x, tf.int64)


def row_signs(rows: int, salt: tf.Tensor) -> tf.Tensor:
    """``rows`` float32 signs of core.update_mode.row_sign under ``salt`` (an int64 scalar)."""
    mask = tf.constant(MASK31, tf.int64)
    first, *rest = SIGN_HASH_MULTIPLIERS
    x = tf.range(rows, dtype=tf.int64)
    x = tf.bitwise.bitwise_and(x * first + tf.bitwise.bitwise_and(salt, mask), mask)
    for multiplier in rest:
        x = tf.bitwise.bitwise_and(_xorshift(x, 15) * multiplier, mask)
    x = _xorshift(x, 13)
    bit = tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, tf.constant(7, tf.int64)), tf.constant(1, tf.int64))
    return tf.cast(bit, tf.float32) * 2.0 - 1.0


def sketch(gradient: Any, width: int, salt: tf.Tensor) -> tf.Tensor:
    """One rank's ``width + 1`` float32 values for one tensor: the count sketch of ``gradient`` (entry ``r * width +
    b`` into bucket ``b`` with row ``r``'s sign; the last row padded with zeros) and then ``||gradient||**2``. An
    embedding's IndexedSlices count as the dense gradient they sum to. A NaN/Inf entry makes both non-finite."""
    numel = gradient.shape.num_elements()  # an IndexedSlices' dense shape, which its conversion can lose in a branch
    flat = tf.ensure_shape(tf.reshape(tf.cast(tf.convert_to_tensor(gradient), tf.float32), [-1]), [numel])
    rows = max(1, -(-numel // width))
    padded = tf.reshape(tf.pad(flat, [[0, rows * width - numel]]), [rows, width])
    buckets = tf.linalg.matvec(padded, row_signs(rows, salt), transpose_a=True)
    return tf.concat([buckets, tf.reshape(tf.reduce_sum(tf.square(flat)), [1])], axis=0)


def noise_shares(summed: tf.Tensor, world_size: int) -> tf.Tensor:
    """Each tensor's noise share from the ranks' summed sketches (``(tensors, width + 1)``): ``||sum_r sketch_r||**2
    / (P * sum_r ||g_r||**2)`` clamped to [1/P, 1], 1 for a gradient that is zero on every rank (the torch
    adapter's update_rule.noise_shares computes the same; core.update_mode says why the clamp)."""
    sketched = tf.reduce_sum(tf.square(summed[:, :-1]), axis=1)
    norms = summed[:, -1] * float(world_size)
    share = tf.where(norms > 0.0, sketched / tf.maximum(norms, _TINY), tf.ones_like(norms))
    return tf.clip_by_value(share, 1.0 / world_size, 1.0)
