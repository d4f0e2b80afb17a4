"""The tensor math of TopKEF for TensorFlow, as pure functions (work eagerly and inside tf.function).

Mirrors horovod_topk.torch.ops on the same payload layout (core.payload), so a payload means the same bytes in
both frameworks.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Tuple, Union

import tensorflow as tf

from ..core.policy import CANDIDATE_MARGIN

if TYPE_CHECKING:
    from .sizes import Layout

__all__ = [
    "residual_dtype",
    "Size",
    "Sampling",
    "sample_geometry",
    "sampled_top_k_indices",
    "to_wire",
    "compensate_and_select",
    "compensate_nonfinite",
    "error_feedback_step",
    "pack",
    "unpack",
    "scatter_sum",
    "sum_payloads",
]


def residual_dtype(grad_dtype: tf.DType) -> tf.DType:
    """float32 residuals for half-precision gradients (small unsent updates would vanish in fp16), float64 for
    float64."""
    return tf.float64 if grad_dtype == tf.float64 else tf.float32


#: A size that follows k: a Python int, or an int32 scalar tensor (looked up by step in a warm-up, or read from
#: the row of the bodies every size shares; horovod_topk.tensorflow.sizes).
Size = Union[int, tf.Tensor]
#: (stride, q) of the sampled selector (sample_geometry); None selects with the exact top-k.
Sampling = Optional[Tuple[Size, Size]]


def sample_geometry(numel: int, k: int, sample_size: int) -> Optional[Tuple[int, int]]:
    """(stride, q) for the sampled selector on k of ``numel`` entries with about ``sample_size`` sampled
    magnitudes: every stride-th magnitude is sampled and the q-th largest of them is the threshold, aiming at
    CANDIDATE_MARGIN * k + 8 candidates. None when the exact top-k is the selector (no sample, or k == numel).
    Plain integers, so that a warm-up can tabulate them per step (horovod_topk.tensorflow.sizes)."""
    if sample_size <= 0 or k >= numel:
        return None
    stride = max(1, numel // max(1, sample_size))
    sampled = -(-numel // stride)  # the length of magnitude[::stride]
    q = max(1, min(sampled, math.ceil(min(numel, CANDIDATE_MARGIN * k + 8) * sampled / numel)))
    return stride, q


def sampled_top_k_indices(magnitude: tf.Tensor, k: Size, stride: Size, q: Size) -> tf.Tensor:
    """Indices of exactly k largest entries of ``magnitude`` (flat), found without a full top-k: a threshold from
    a strided sample (the q-th largest of every stride-th magnitude, see sample_geometry), the candidates above
    it, then top-k among those; if the estimate left fewer than k candidates, the exact top-k over everything."""
    threshold = tf.math.top_k(magnitude[::stride], q, sorted=True).values[q - 1]
    candidates = tf.reshape(tf.where(magnitude >= threshold), [-1])

    def among_candidates() -> tf.Tensor:
        best = tf.math.top_k(tf.gather(magnitude, candidates), k, sorted=False).indices
        return tf.cast(tf.gather(candidates, best), tf.int32)

    def over_everything() -> tf.Tensor:
        return tf.math.top_k(magnitude, k, sorted=False).indices

    return tf.cond(tf.size(candidates) >= k, among_candidates, over_everything)


def to_wire(values: tf.Tensor, wire_dtype: tf.DType) -> tf.Tensor:
    """``values`` as they travel in ``wire_dtype``: finite ones clamped to its largest finite magnitude first where
    it is narrower than theirs, so that a value beyond float16's 65504 travels as 65504, not as an Inf that would
    leave an Inf in the residual (the excess stays there instead, as rounding does); NaN and Inf as they are. The
    same rule as PyTorch's (horovod_topk.torch.ops.to_wire)."""
    if values.dtype == wire_dtype or not wire_dtype.is_floating:
        return tf.cast(values, wire_dtype)
    limit = wire_dtype.max
    if values.dtype.max > limit:
        values = tf.where(tf.math.is_inf(values), values,
                          tf.clip_by_value(values, tf.constant(-limit, values.dtype), tf.constant(limit, values.dtype)))
    return tf.cast(values, wire_dtype)


def compensate_and_select(
    grad: tf.Tensor, residual: tf.Tensor, k: Size, wire_dtype: tf.DType, sampling: Sampling = None
) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Error-feedback Top-K on one tensor: exact ``tf.math.top_k``, or the sampled selector with ``sampling``'s
    (stride, q).

    Returns (indices int32 (k,), values of ``wire_dtype`` (k,), new residual), where for every element
    ``new residual + sent == residual + grad`` and the rounding of the sent values to ``wire_dtype`` stays in the
    new residual.
    """
    compensated = residual + tf.cast(tf.reshape(grad, [-1]), residual.dtype)
    if sampling is not None:
        indices = sampled_top_k_indices(tf.abs(compensated), k, *sampling)
    else:
        _, indices = tf.math.top_k(tf.abs(compensated), k=k, sorted=False)
    picked = tf.gather(compensated, indices)
    values = to_wire(picked, wire_dtype)
    new_residual = tf.tensor_scatter_nd_update(
        compensated, indices[:, None], picked - tf.cast(values, compensated.dtype)
    )
    return indices, values, new_residual


def compensate_nonfinite(
    grad: tf.Tensor, residual: tf.Tensor, k: Size, wire_dtype: tf.DType
) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The step of a gradient with NaN/Inf entries (same rule as the PyTorch kernel): those entries never enter
    the residual (a NaN there would never be sent nor leave) and are what is sent -- the first k of them, the
    other slots repeating the first, so every rank's average turns non-finite there as with a dense allreduce --
    while the finite entries are compensated into the residual and wait for later steps."""
    flat = tf.cast(tf.reshape(grad, [-1]), residual.dtype)
    finite = tf.math.is_finite(flat)
    new_residual = residual + tf.where(finite, flat, tf.zeros_like(flat))
    bad = tf.cast(tf.reshape(tf.where(tf.logical_not(finite)), [-1]), tf.int32)
    indices = tf.reshape(tf.concat([bad, tf.fill([k], bad[0])], axis=0)[:k], [k])
    return indices, tf.cast(tf.gather(flat, indices), wire_dtype), new_residual


def error_feedback_step(
    grad: tf.Tensor,
    residual: tf.Tensor,
    k: Size,
    wire_dtype: tf.DType,
    sampling: Sampling = None,
    momentum_buffer: Optional[tf.Tensor] = None,
    momentum: float = 0.0,
) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, Optional[tf.Tensor], tf.Tensor]:
    """compensate_and_select, or compensate_nonfinite when the gradient has a NaN/Inf.

    With a ``momentum_buffer`` u (DGC momentum correction, same rule as horovod_topk.torch.ops): u = m u + g,
    the residual takes u instead of g, and u is zeroed where entries are sent (momentum-factor masking); the
    NaN/Inf entries of a non-finite gradient enter neither.

    Returns (indices, values, new residual, new momentum buffer or None, True if the gradient was finite)."""
    finite = tf.reduce_all(tf.math.is_finite(grad))
    new_momentum = None
    if momentum_buffer is not None:
        flat = tf.cast(tf.reshape(grad, [-1]), momentum_buffer.dtype)
        entry_finite = tf.math.is_finite(flat)
        new_momentum = tf.where(entry_finite, momentum * momentum_buffer + flat, momentum_buffer)
        grad = tf.where(entry_finite, new_momentum, flat)  # what enters the residual; the NaN/Inf stay as they are
    indices, values, new_residual = tf.cond(
        finite,
        lambda: compensate_and_select(grad, residual, k, wire_dtype, sampling),
        lambda: compensate_nonfinite(grad, residual, k, wire_dtype),
    )
    if new_momentum is not None:
        masked = tf.tensor_scatter_nd_update(new_momentum, indices[:, None], tf.zeros([k], new_momentum.dtype))
        new_momentum = tf.where(finite, masked, new_momentum)
    return indices, values, new_residual, new_momentum, finite


def _bytes_of(x: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.bitcast(x, tf.uint8), [-1])


def pack(indices: tf.Tensor, values: tf.Tensor, layout: "Layout") -> tf.Tensor:
    """One uint8 buffer holding ``indices`` (int32) and ``values`` at the offsets of ``layout`` (a PayloadLayout, or a
    sizes.StepLayout / sizes.RowLayout whose sizes are int32 scalars)."""
    pad_middle = tf.zeros([layout.values_offset - layout.indices_nbytes], tf.uint8)
    pad_end = tf.zeros([layout.nbytes - layout.values_end], tf.uint8)
    return tf.concat([_bytes_of(tf.cast(indices, tf.int32)), pad_middle, _bytes_of(values), pad_end], axis=0)


def unpack(
    gathered: tf.Tensor, world_size: int, layout: "Layout", value_dtype: tf.DType
) -> Tuple[tf.Tensor, tf.Tensor]:
    """Indices (P, k) int32 and values (P, k) of a gathered buffer of P payloads."""
    rows = tf.reshape(gathered, [world_size, layout.nbytes])
    index_bytes = tf.reshape(rows[:, : layout.indices_nbytes], [world_size, layout.k, 4])
    value_bytes = tf.reshape(
        rows[:, layout.values_offset : layout.values_end], [world_size, layout.k, layout.value_itemsize]
    )
    return tf.bitcast(index_bytes, tf.int32), tf.bitcast(value_bytes, value_dtype)


def sum_payloads(
    gathered: tf.Tensor, world_size: int, layout: "Layout", value_dtype: tf.DType, numel: "Size", acc_dtype: tf.DType,
    scale: float, out_dtype: tf.DType
) -> tf.Tensor:
    """The flat dense sum of P gathered payloads (plain or compact, encoding.decode), times ``scale``, as
    ``out_dtype``: the decoding half of horovod_topk.tensorflow.steps.receive."""
    from . import encoding

    unpacked = encoding.decode if layout.compact else unpack
    all_indices, all_values = unpacked(gathered, world_size, layout, value_dtype)
    dense = scatter_sum(all_indices, all_values, numel, acc_dtype)
    if scale != 1.0:
        dense = dense * tf.cast(scale, dense.dtype)
    return tf.cast(dense, out_dtype)


def scatter_sum(indices: tf.Tensor, values: tf.Tensor, numel: Size, acc_dtype: tf.DType) -> tf.Tensor:
    """Dense flat tensor with every (index, value) pair of every rank added in (collisions add up)."""
    return tf.math.unsorted_segment_sum(
        tf.reshape(tf.cast(values, acc_dtype), [-1]), tf.reshape(indices, [-1]), numel
    )
