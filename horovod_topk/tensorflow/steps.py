"""The two halves of one tensor's compressed allgather step, each a body that every tensor with the same plan
shares (horovod_topk.tensorflow.shared): :func:`send` before the allgather, :func:`receive` after it.

Why two bodies that take the state variables: what a tensor adds to the user's traced step is then two call ops
around its allgather (plus a reshape and a message constant), instead of the selection, packing, state updates,
size check, counter arithmetic and decoding built op by op in Python for every tensor. Both costs of a first step
grow with those per-tensor ops: the Python trace, and the graph TensorFlow optimises and instantiates on the first
call (README, "First-step (tracing) cost"). The allgather stays outside: its name is the tensor's, and Horovod
matches collectives across ranks by that name.

Variables are inputs of the bodies (their resource handles), not captures, so one trace serves every tensor of the
same size; a body's variable updates finish before its call returns, which orders them as before: the residual and
momentum buffer are written before the payload leaves, the counters after the payload's size is checked.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import tensorflow as tf

from . import encoding, ops
from .sizes import SizePlan

__all__ = ["send", "receive"]


def send(grad: tf.Tensor, residual: tf.Variable, momentum_buffer: Optional[tf.Variable], step: Optional[tf.Tensor],
         *, plan: SizePlan, select_dtype: tf.DType, momentum: float) -> Tuple[tf.Tensor, tf.Tensor]:
    """(payload, whether the gradient was finite) of the flat ``grad``: error-feedback selection
    (ops.error_feedback_step) at the plan's k of ``step`` (None when k is fixed), packed in the plan's layout
    (compact: encoding.encode, which also puts float8's rounding back into the residual); the new residual and
    momentum buffer are written to their variables."""
    size = plan.at(step)
    indices, values, new_residual, new_momentum, finite = ops.error_feedback_step(
        grad, residual, size.k, select_dtype, size.sampling, momentum_buffer, momentum)
    if size.layout.compact:
        payload, new_residual = encoding.encode(indices, values, new_residual, size.layout)
    else:
        payload = ops.pack(indices, values, size.layout)
    residual.assign(new_residual)
    if momentum_buffer is not None:
        momentum_buffer.assign(new_momentum)
    return payload, finite


def receive(gathered: tf.Tensor, counters: tf.Variable, finite: tf.Tensor, guarded: Union[int, tf.Tensor],
            message: tf.Tensor, step: Optional[tf.Tensor], *, plan: SizePlan, world_size: int, numel: int,
            wire_dtype: tf.DType, acc_dtype: tf.DType, scale: float, out_dtype: tf.DType,
            dense_nbytes: int) -> tf.Tensor:
    """The flat dense sum of the ``world_size`` gathered payloads (ops.sum_payloads), after checking that they
    are ``world_size`` payloads of this step's size (else ``message``, on every rank alike) and adding this step
    to ``counters`` (steps, bytes sent, bytes dense, non-finite steps, guarded steps)."""
    size = plan.at(step)
    # tf.debugging.Assert, not assert_equal: the same check in 4 graph nodes instead of 17
    check = tf.debugging.Assert(tf.equal(tf.size(gathered), world_size * size.layout.nbytes), [message])
    with tf.control_dependencies([check]):
        counted = counters.assign_add(tf.stack([
            tf.constant(1, tf.int64), tf.cast(size.layout.nbytes, tf.int64), tf.constant(dense_nbytes, tf.int64),
            1 - tf.cast(finite, tf.int64), tf.cast(guarded, tf.int64)]))
    with tf.control_dependencies([counted]):
        gathered = tf.identity(gathered)
    return ops.sum_payloads(gathered, world_size, size.layout, wire_dtype, numel, acc_dtype, scale, out_dtype)
