"""The tensor math of TopKEF for TensorFlow, as pure functions (work eagerly and inside tf.function).

Mirrors horovod_topk.torch.ops on the same payload layout (core.payload), so a payload means the same bytes in
both frameworks.
"""
from __future__ import annotations

from typing import Tuple

import tensorflow as tf

from ..core.payload import PayloadLayout

__all__ = ["residual_dtype", "compensate_and_select", "pack", "unpack", "scatter_sum"]


def residual_dtype(grad_dtype: tf.DType) -> tf.DType:
    """float32 residuals for half-precision gradients (small unsent updates would vanish in fp16), float64 for
    float64."""
    return tf.float64 if grad_dtype == tf.float64 else tf.float32


def compensate_and_select(
    grad: tf.Tensor, residual: tf.Tensor, k: int, wire_dtype: tf.DType
) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Error-feedback Top-K on one tensor.

    Returns (indices int32 (k,), values of ``wire_dtype`` (k,), new residual), where for every element
    ``new residual + sent == residual + grad`` and the rounding of the sent values to ``wire_dtype`` stays in the
    new residual.
    """
    compensated = residual + tf.cast(tf.reshape(grad, [-1]), residual.dtype)
    _, indices = tf.math.top_k(tf.abs(compensated), k=k, sorted=False)
    picked = tf.gather(compensated, indices)
    values = tf.cast(picked, wire_dtype)
    new_residual = tf.tensor_scatter_nd_update(
        compensated, indices[:, None], picked - tf.cast(values, compensated.dtype)
    )
    return indices, values, new_residual


def _bytes_of(x: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.bitcast(x, tf.uint8), [-1])


def pack(indices: tf.Tensor, values: tf.Tensor, layout: PayloadLayout) -> tf.Tensor:
    """One uint8 buffer holding ``indices`` (int32) and ``values`` at the offsets of ``layout``."""
    pad_middle = tf.zeros([layout.values_offset - layout.indices_nbytes], tf.uint8)
    pad_end = tf.zeros([layout.nbytes - layout.values_end], tf.uint8)
    return tf.concat([_bytes_of(tf.cast(indices, tf.int32)), pad_middle, _bytes_of(values), pad_end], axis=0)


def unpack(
    gathered: tf.Tensor, world_size: int, layout: PayloadLayout, value_dtype: tf.DType
) -> Tuple[tf.Tensor, tf.Tensor]:
    """Indices (P, k) int32 and values (P, k) of a gathered buffer of P payloads."""
    rows = tf.reshape(gathered, [world_size, layout.nbytes])
    index_bytes = tf.reshape(rows[:, : layout.indices_nbytes], [world_size, layout.k, 4])
    value_bytes = tf.reshape(
        rows[:, layout.values_offset : layout.values_end], [world_size, layout.k, layout.value_itemsize]
    )
    return tf.bitcast(index_bytes, tf.int32), tf.bitcast(value_bytes, value_dtype)


def scatter_sum(indices: tf.Tensor, values: tf.Tensor, numel: int, acc_dtype: tf.DType) -> tf.Tensor:
    """Dense flat tensor with every (index, value) pair of every rank added in (collisions add up)."""
    return tf.math.unsorted_segment_sum(
        tf.reshape(tf.cast(values, acc_dtype), [-1]), tf.reshape(indices, [-1]), numel
    )
