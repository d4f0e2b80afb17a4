"""The compact wire encoding (core.payload) in TensorFlow ops: 16-bit segmented indices and float8 values.

The same bytes as the PyTorch encoder (horovod_topk/torch/encoding.py). TensorFlow casts to float8 e4m3fn but
cannot bitcast it, so the byte of a float8 number is found in core's table of the 256 e4m3 values, and decoded by
a lookup in the same table. The layout's sizes are ints, or int32 scalars (sizes.StepLayout, sizes.RowLayout).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import tensorflow as tf

from ..core.payload import FLOAT8_MAX, SEGMENT_BITS, float8_e4m3_values

if TYPE_CHECKING:
    from .sizes import Layout

__all__ = ["encode", "decode"]

_FLOAT8 = tf.dtypes.experimental.float8_e4m3fn
_SEGMENT_MASK = (1 << SEGMENT_BITS) - 1
#: bytes 0x00..0x7E are the non-negative finite e4m3 numbers in increasing order
_POSITIVE = float8_e4m3_values()[:0x7F]


def _bytes_of(x: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.bitcast(x, tf.uint8), [-1])


def _float8_bytes(exact: tf.Tensor) -> tf.Tensor:
    """The e4m3fn byte of each float32 value that is exactly an e4m3 number (or NaN: 0x7F)."""
    magnitude = tf.abs(exact)
    positive = tf.constant(_POSITIVE, tf.float32)
    code = tf.searchsorted(positive, tf.where(tf.math.is_nan(magnitude), tf.zeros_like(magnitude), magnitude),
                           side="left", out_type=tf.int32)
    code = tf.where(tf.math.is_nan(magnitude), tf.fill(tf.shape(code), 0x7F), code)
    sign = tf.where(tf.bitcast(tf.cast(exact, tf.float32), tf.int32) < 0, 0x80, 0)  # the sign bit: -0.0 too
    return tf.cast(tf.bitwise.bitwise_or(code, sign), tf.uint8)


def encode(
    indices: tf.Tensor, values: tf.Tensor, residual: tf.Tensor, layout: "Layout"
) -> Tuple[tf.Tensor, tf.Tensor]:
    """(payload, new residual) for one rank's selected ``indices`` and ``values``. With float8 the values must be
    exact (already removed from ``residual``); float8's rounding is added back there at those indices, non-finite
    values travel as NaN and never enter the residual -- error feedback stays exact."""
    indices = tf.cast(indices, tf.int32)
    parts = []
    if layout.scaled:
        parts.append(tf.zeros([layout.scale_nbytes], tf.uint8))  # the scale's slot, filled below
    if layout.index_bits == 16:
        order = tf.argsort(indices)
        indices, values = tf.gather(indices, order), tf.gather(values, order)
        counts = tf.math.bincount(tf.bitwise.right_shift(indices, SEGMENT_BITS), minlength=layout.segments, maxlength=layout.segments,
                                  dtype=tf.int32)
        parts += [_bytes_of(counts), _bytes_of(tf.cast(tf.bitwise.bitwise_and(indices, _SEGMENT_MASK), tf.uint16))]
    else:
        parts.append(_bytes_of(indices))
    parts.append(tf.zeros([layout.values_offset - layout.indices_end], tf.uint8))
    if layout.scaled:
        exact = tf.cast(values, residual.dtype)
        finite = tf.math.is_finite(exact)
        largest = tf.reduce_max(tf.where(finite, tf.abs(exact), tf.zeros_like(exact)))
        scale = tf.where(largest > 0, largest / FLOAT8_MAX, tf.ones_like(largest))
        # clipped: largest / scale can round a hair above 448, and casts past it are not saturating everywhere
        scaled = tf.where(finite, tf.clip_by_value(exact / scale, -FLOAT8_MAX, FLOAT8_MAX),
                          tf.fill(tf.shape(exact), tf.constant(float("nan"), exact.dtype)))
        on_wire = tf.cast(tf.cast(tf.cast(scaled, tf.float32), _FLOAT8), tf.float32)
        back = tf.cast(on_wire, exact.dtype) * scale
        residual = tf.tensor_scatter_nd_add(residual, indices[:, None],
                                            tf.where(finite, exact - back, tf.zeros_like(exact)))
        parts[0] = tf.concat([_bytes_of(tf.reshape(tf.cast(scale, tf.float32), [1])),
                              tf.zeros([layout.scale_nbytes - 4], tf.uint8)], 0)
        parts.append(_float8_bytes(on_wire))
    else:
        parts.append(_bytes_of(values))
    parts.append(tf.zeros([layout.nbytes - layout.values_end], tf.uint8))
    return tf.concat(parts, axis=0), residual


def decode(
    gathered: tf.Tensor, world_size: int, layout: "Layout", value_dtype: tf.DType
) -> Tuple[tf.Tensor, tf.Tensor]:
    """(indices int32, values), each (P, k), from a gathered buffer of P payloads of ``layout``: float8 values come
    back as float32 times their scale, others in ``value_dtype``."""
    rows = tf.reshape(gathered, [world_size, layout.nbytes])
    k = layout.k
    if layout.index_bits == 16:
        counts = tf.bitcast(tf.reshape(rows[:, layout.counts_offset:layout.indices_offset],
                                       [world_size, layout.segments, 4]), tf.int32)
        position = tf.broadcast_to(tf.range(k, dtype=tf.int32), [world_size, k])
        segment = tf.searchsorted(tf.cumsum(counts, axis=1), position, side="right", out_type=tf.int32)
        offsets = tf.cast(tf.bitcast(tf.reshape(rows[:, layout.indices_offset:layout.indices_end],
                                                [world_size, k, 2]), tf.uint16), tf.int32)
        indices = tf.bitwise.left_shift(segment, SEGMENT_BITS) + offsets
    else:
        indices = tf.bitcast(tf.reshape(rows[:, layout.indices_offset:layout.indices_end], [world_size, k, 4]),
                             tf.int32)
    value_bytes = rows[:, layout.values_offset:layout.values_end]
    if layout.scaled:
        scale = tf.bitcast(tf.reshape(rows[:, :4], [world_size, 1, 4]), tf.float32)
        table = tf.constant(float8_e4m3_values(), tf.float32)
        return indices, tf.gather(table, tf.cast(value_bytes, tf.int32)) * scale
    values = tf.bitcast(tf.reshape(value_bytes, [world_size, k, layout.value_itemsize]), value_dtype)
    return indices, values
