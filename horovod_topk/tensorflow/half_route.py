"""The fp16 route (core.exchange.DENSE_HALF) in TensorFlow: a tensor sent dense with its values in float16, with
error feedback -- what ratio="auto" sends while its choice is fp16 (core.autodensity.HALF).

The same rule as PyTorch's (horovod_topk.torch.half_route), in TensorFlow's operations: the values are scaled by the
reduction's factor and clamped to core.exchange.half_limit (P ranks' float16 sum cannot overflow); what float16 does
not carry -- the rounding, the underflow, what the clamp cut -- stays in the residual and goes out on later steps; a
gradient's NaN/Inf entries are sent as such (every rank's average turns non-finite there, as with a dense allreduce)
and never enter the residual. The compressor (horovod_topk.tensorflow.compressor) runs the collective and counts
the bytes.
"""
from __future__ import annotations

from typing import Tuple

import tensorflow as tf

from ..core.exchange import half_limit

__all__ = ["to_half"]


def to_half(flat: tf.Tensor, residual: tf.Tensor, scale: float, world_size: int
            ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """This rank's share of a sum-allreduce of ``scale`` x (``flat`` + ``residual``) in float16. Returns (the float16
    values, the new residual in ``flat``'s units and ``residual``'s dtype, whether every entry was finite)."""
    if scale == 0.0:
        raise ValueError("horovod-topk: a reduction scaled by 0 cannot be sent in float16 with error feedback")
    limit = half_limit(world_size)
    acc = tf.cast(flat, residual.dtype) + residual
    scaled = acc * tf.constant(scale, acc.dtype)
    finite = tf.math.is_finite(acc)
    # a finite value is clamped (also one that the scale made infinite); an Inf or NaN goes out as it is
    half = tf.cast(tf.where(finite, tf.clip_by_value(scaled, -limit, limit), scaled), tf.float16)
    kept = acc - tf.cast(half, acc.dtype) * tf.constant(1.0 / scale, acc.dtype)
    return half, tf.where(finite, kept, residual), tf.reduce_all(finite)
