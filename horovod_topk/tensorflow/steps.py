"""The two halves of one tensor's compressed allgather step, each a body that every tensor with the same options
shares, whatever its size and k (horovod_topk.tensorflow.shared.call_any_shape): :func:`send` before the
allgather, :func:`receive` after it.

Why: what a tensor adds to the user's traced step is then two call ops around its allgather, and the model's
whole compressed path is a couple of traced functions, instead of the selection, packing, state updates, size
check, counter arithmetic and decoding built op by op in Python for every tensor, or traced once per size. Both
costs of a first step grow with those: the Python trace, and the graph TensorFlow optimises and instantiates on
the first call (README, "First-step (tracing) cost"). The allgather stays outside: its name is the tensor's, and
Horovod matches collectives across ranks by that name.

The sizes of a step arrive as one int32 row (sizes.SizePlan.row: a constant, or looked up by step during a
warm-up), so nothing in a body depends on a static shape. The state variables arrive as their resource handles and
are read and written with ``tf.raw_ops``; a body's writes finish before its call returns: the residual and
momentum buffer are written before the payload leaves, and the counters once the gathered payloads' size is checked
(a failed check counts no step).
"""
from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf

from . import encoding, ops
from .sizes import SizeOptions, sizes_of_row

__all__ = ["send", "receive"]


def send(grad: tf.Tensor, residual: tf.Tensor, momentum_buffer: Optional[tf.Tensor], row: tf.Tensor, *,
         options: SizeOptions, state_dtype: tf.DType, select_dtype: tf.DType,
         momentum: float) -> Tuple[tf.Tensor, tf.Tensor]:
    """(payload, whether the gradient was finite) of ``grad`` (any shape): error-feedback selection
    (ops.error_feedback_step) of the row's k, packed in the row's layout (compact: encoding.encode, which also puts
    float8's rounding back into the residual). ``residual`` and ``momentum_buffer`` are variable handles (flat,
    ``state_dtype``); their new values are written to them."""
    size = sizes_of_row(options, row)
    current = tf.raw_ops.ReadVariableOp(resource=residual, dtype=state_dtype)
    buffer = None if momentum_buffer is None else tf.raw_ops.ReadVariableOp(resource=momentum_buffer,
                                                                              dtype=state_dtype)
    indices, values, new_residual, new_momentum, finite = ops.error_feedback_step(
        tf.reshape(grad, [-1]), current, size.k, select_dtype, size.sampling, buffer, momentum)
    if size.layout.compact:
        payload, new_residual = encoding.encode(indices, values, new_residual, size.layout)
    else:
        payload = ops.pack(indices, values, size.layout)
    tf.raw_ops.AssignVariableOp(resource=residual, value=new_residual)
    if momentum_buffer is not None:
        tf.raw_ops.AssignVariableOp(resource=momentum_buffer, value=new_momentum)
    return payload, finite


def receive(gathered: tf.Tensor, counters: tf.Tensor, finite: tf.Tensor, guarded: Optional[tf.Tensor],
            message: tf.Tensor, row: tf.Tensor, shape: tf.Tensor, *, options: SizeOptions, world_size: int,
            wire_dtype: tf.DType, acc_dtype: tf.DType, scale: float, out_dtype: tf.DType) -> tf.Tensor:
    """The dense sum of the ``world_size`` gathered payloads (ops.sum_payloads) as a tensor of ``shape`` (the
    gradient's shape, not the gradient itself, which can then be freed once sent), after checking that they are
    ``world_size`` payloads of the row's size (else ``message``, on every rank alike) and adding this step to the
    ``counters`` handle (steps, bytes sent, bytes dense, non-finite steps, guarded steps; ``guarded`` is None
    without spike_guard)."""
    size = sizes_of_row(options, row)
    layout = size.layout
    # tf.debugging.Assert, not assert_equal: the same check in 4 graph nodes instead of 17
    check = tf.debugging.Assert(tf.equal(tf.size(gathered), world_size * layout.nbytes), [message])
    with tf.control_dependencies([check]):
        dense_nbytes = tf.cast(layout.numel, tf.int64) * out_dtype.size
        was_guarded = tf.constant(0, tf.int64) if guarded is None else tf.cast(guarded, tf.int64)
        tf.raw_ops.AssignAddVariableOp(resource=counters, value=tf.stack([
            tf.constant(1, tf.int64), tf.cast(layout.nbytes, tf.int64), dense_nbytes, 1 - tf.cast(finite, tf.int64),
            was_guarded]))
        gathered = tf.identity(gathered)
    dense = ops.sum_payloads(gathered, world_size, layout, wire_dtype, layout.numel, acc_dtype, scale, out_dtype)
    return tf.reshape(dense, shape)
