"""The sparse allreduce exchange for TensorFlow (core.exchange): an alltoall to region owners, then an allgather.

The same exchange as horovod_topk/torch/sparse_allreduce.py, with the same bytes on the wire, built from fixed-shape
TensorFlow ops so that it traces once inside the ``tf.function`` Horovod's tape and optimizers run in:

Phase 1, one ``alltoall``: this rank's k selected entries are bucketed by owner (core.exchange.region_of) into P
blocks of ``capacity`` entries (index -1 and value 0 in unused slots), each block a core.payload layout. Entries
beyond a block's capacity go straight back into this rank's residual: they travel on a later step.

Phase 2, one ``allgather``: the owner sums what it received in the residual's dtype (float32, float64 for float64
gradients), keeps the ceil(k/P) largest sums of its region (non-finite sums first, so a NaN reaches the update as it
would with a dense allreduce), keeps the rounding of each kept sum to the wire dtype in its own residual, and
allgathers the kept (index, value) pairs. Every rank builds the same dense sum from them.

With a sparsity warm-up, k changes from step to step inside one graph: ``layouts`` is then a
horovod_topk.tensorflow.sizes.StepSparseLayouts whose sizes are looked up per step (the blocks' width, the kept
slots), and the same ops serve every step's k; Horovod's alltoall and allgather accept the changing width.

Error feedback stays exact: each rank returns to its residual its own sent entries at indices no owner kept, so over
all ranks, new residuals + applied sum == old residuals + gradients up to float rounding
(tests/parallel_tf/test_tf_sparse_allreduce.py). Non-finite values never enter a residual.

Unlike the PyTorch exchange, nothing here polls: the graph starts each phase as soon as its inputs exist, and
Horovod matches the collectives across ranks by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Sequence, Tuple

import tensorflow as tf

from ..core.buckets import bucket_collective_name
from ..core.exchange import HASH_MULTIPLIER
from ..core.naming import alltoall_name, owners_allgather_name
from . import buckets, ops, shared

if TYPE_CHECKING:
    from .sizes import Layout, SparseLayouts

__all__ = ["Member", "regions", "reduce", "reduce_bucket"]


def regions(indices: tf.Tensor, world_size: int) -> tf.Tensor:
    """core.exchange.region_of on a tensor of indices (int32 result): computed in int64, where index < 2**31
    keeps every product below 2**63."""
    hashed = tf.bitwise.bitwise_and(tf.cast(indices, tf.int64) * HASH_MULTIPLIER, 0xFFFFFFFF)
    return tf.cast(tf.bitwise.right_shift(hashed * world_size, 32), tf.int32)


def _add_to_residual(residual: tf.Tensor, indices: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """residual[indices] += values for the pairs whose index is >= 0 and whose value is finite (a NaN/Inf in a
    residual would never be sent nor leave it); the others add nothing."""
    values = tf.cast(values, residual.dtype)
    keep = tf.logical_and(indices >= 0, tf.math.is_finite(values))
    return tf.tensor_scatter_nd_add(residual, tf.where(keep, indices, tf.zeros_like(indices))[:, None],
                                    tf.where(keep, values, tf.zeros_like(values)))


def _pack_rows(indices: tf.Tensor, values: tf.Tensor, layout: "Layout") -> tf.Tensor:
    """(rows, nbytes) uint8: row r is the payload of ``indices[r]`` (int32) and ``values[r]`` at ``layout``'s
    offsets -- ops.pack, one row per destination, so one alltoall with equal splits carries all of them."""
    rows = int(indices.shape[0])

    def row_bytes(x: tf.Tensor) -> tf.Tensor:
        return tf.reshape(tf.bitcast(x, tf.uint8), [rows, -1])

    return tf.concat([
        row_bytes(tf.cast(indices, tf.int32)),
        tf.zeros([rows, layout.values_offset - layout.indices_nbytes], tf.uint8),
        row_bytes(values),
        tf.zeros([rows, layout.nbytes - layout.values_end], tf.uint8),
    ], axis=1)


def _minimum(a: ops.Size, b: ops.Size) -> ops.Size:
    """min(a, b): a Python int for fixed sizes (static shapes stay static), an op for a warm-up's."""
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else tf.minimum(a, b)


def _size_check(received: tf.Tensor, expected: ops.Size, message: str) -> tf.Operation:
    return tf.debugging.assert_equal(tf.size(received), expected, message=message)


@dataclass(frozen=True)
class Member:
    """One tensor's part of a sparse allreduce: this rank's selection and what its phases need."""

    indices: tf.Tensor  # (k,) this rank's selected indices
    values: tf.Tensor  # (k,) their values, of ``wire_dtype``
    residual: tf.Tensor  # the residual after the selection (the selected entries already removed)
    layouts: "SparseLayouts"
    numel: int
    wire_dtype: tf.DType


@dataclass(frozen=True)
class _Routed:
    """Phase 1's result for one member: its per-destination blocks and what the later phases put back."""

    blocks: tf.Tensor  # (P, send.nbytes) uint8: row r goes to rank r
    residual: tf.Tensor  # with the entries over a destination's capacity put back
    indices: tf.Tensor  # the selection sorted by owner
    values: tf.Tensor
    fits: tf.Tensor  # which of them travel (the others are already back in the residual)


# Each phase's arithmetic is a body of plain arguments, traced once per distinct (sizes, layouts) by shared.call and
# shared by every tensor that has them: a bucket of 60 equal matrices adds 60 call ops per phase, not 60 copies of
# some eighty ops each (a warm-up's per-step sizes are tensors, not plain values: those members build their ops).

def _route(member: Member, world_size: int) -> _Routed:
    """Phase 1's arithmetic (:func:`_route_body`) of ``member``."""
    return _Routed(*shared.call(_route_body, member.indices, member.values, member.residual, member.layouts.k,
                                member.layouts.send, world_size, member.wire_dtype))


def _route_body(indices: tf.Tensor, values: tf.Tensor, residual: tf.Tensor, k: ops.Size, send: "Layout",
                world_size: int, wire_dtype: tf.DType) -> Tuple[tf.Tensor, ...]:
    """This rank's entries bucketed by owner into fixed blocks (stable: within an owner the selection's order is
    kept); entries beyond a block's capacity go back to the residual, sent on a later step. Returns _Routed's
    fields."""
    slots = world_size * send.k
    indices = tf.cast(indices, tf.int32)
    owner = regions(indices, world_size)
    order = tf.argsort(owner, stable=True)
    owner, indices, values = tf.gather(owner, order), tf.gather(indices, order), tf.gather(values, order)
    counts = tf.math.bincount(owner, minlength=world_size, maxlength=world_size, dtype=tf.int32)
    slot = tf.range(k, dtype=tf.int32) - tf.gather(tf.cumsum(counts, exclusive=True), owner)
    fits = slot < send.k
    residual = _add_to_residual(residual, tf.where(fits, -1, indices), values)
    position = tf.where(fits, owner * send.k + slot, slots)[:, None]  # slot `slots` collects the overflow, dropped
    block_indices = tf.tensor_scatter_nd_update(tf.fill([slots + 1], -1), position, indices)[:slots]
    block_values = tf.tensor_scatter_nd_update(tf.zeros([slots + 1], wire_dtype), position, values)[:slots]
    blocks = _pack_rows(tf.reshape(block_indices, [world_size, send.k]),
                        tf.reshape(block_values, [world_size, send.k]), send)
    return blocks, residual, indices, values, fits


def _own(member: Member, routed: _Routed, received: tf.Tensor, world_size: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """The owner's arithmetic (:func:`_own_body`) on ``received``, the P blocks every rank sent this one."""
    return shared.call(_own_body, received, routed.residual, member.layouts.send, member.layouts.kept, world_size,
                       member.wire_dtype)


def _own_body(received: tf.Tensor, residual: tf.Tensor, send: "Layout", kept: "Layout", world_size: int,
              wire_dtype: tf.DType) -> Tuple[tf.Tensor, tf.Tensor]:
    """Sum per index, keep the largest sums (non-finite first; empty slots sum nothing). Returns (this owner's kept
    payload, the residual with the rounding of each kept sum to the wire dtype)."""
    acc_dtype = residual.dtype
    slots = world_size * send.k
    got_indices, got_values = ops.unpack(received, world_size, send, wire_dtype)
    got_indices = tf.reshape(got_indices, [-1])
    used = got_indices >= 0
    got_values = tf.where(used, tf.cast(tf.reshape(got_values, [-1]), acc_dtype), tf.zeros([slots], acc_dtype))
    _, segment = tf.unique(got_indices, out_idx=tf.int32)
    sums = tf.math.unsorted_segment_sum(got_values, segment, slots)
    owned = tf.math.unsorted_segment_max(got_indices, segment, slots)  # empty segments: the lowest int32
    priority = tf.where(owned >= 0,
                        tf.where(tf.math.is_finite(sums), tf.abs(sums), tf.fill([slots], tf.constant(float("inf"),
                                                                                                    acc_dtype))),
                        tf.fill([slots], tf.constant(-1.0, acc_dtype)))
    top = tf.math.top_k(priority, _minimum(kept.k, slots), sorted=False).indices
    valid = tf.gather(priority, top) >= 0
    kept_indices = tf.where(valid, tf.gather(owned, top), -1)
    kept_sums = tf.where(valid, tf.gather(sums, top), tf.zeros_like(valid, acc_dtype))
    if not isinstance(kept.k, int) or kept.k > slots:  # more kept slots than entries received: the rest stay empty
        empty = tf.maximum(kept.k - slots, 0)
        kept_indices = tf.concat([kept_indices, tf.fill([empty], -1)], 0)
        kept_sums = tf.concat([kept_sums, tf.zeros([empty], acc_dtype)], 0)
    kept_values = ops.to_wire(kept_sums, wire_dtype)  # P ranks' sum may pass float16's range: clamped
    # the owner re-sends its sums rounded to the wire dtype: the rounding stays here, in its residual
    residual = _add_to_residual(residual, kept_indices, kept_sums - tf.cast(kept_values, acc_dtype))
    return ops.pack(kept_indices, kept_values, kept), residual


def _apply(member: Member, routed: _Routed, residual: tf.Tensor, gathered: tf.Tensor,
           world_size: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """:func:`_apply_body` of ``member`` on ``gathered``, every owner's kept payload back to back."""
    return shared.call(_apply_body, gathered, residual, routed.indices, routed.values, routed.fits,
                       member.layouts.kept, member.numel, world_size, member.wire_dtype)


def _apply_body(gathered: tf.Tensor, residual: tf.Tensor, indices: tf.Tensor, values: tf.Tensor, fits: tf.Tensor,
                kept: "Layout", numel: int, world_size: int, wire_dtype: tf.DType) -> Tuple[tf.Tensor, tf.Tensor]:
    """Every owner's kept sums as the flat dense sum every rank applies, and the residual with this rank's sent
    entries that no owner kept put back: nothing is lost."""
    acc_dtype = residual.dtype
    applied_indices, applied_values = ops.unpack(gathered, world_size, kept, wire_dtype)
    applied_indices = tf.reshape(applied_indices, [-1])
    applied = applied_indices >= 0
    safe_indices = tf.where(applied, applied_indices, tf.zeros_like(applied_indices))
    applied_values = tf.where(applied, tf.cast(tf.reshape(applied_values, [-1]), acc_dtype),
                              tf.zeros([world_size * kept.k], acc_dtype))
    dense = tf.math.unsorted_segment_sum(applied_values, safe_indices, numel)
    hit = tf.math.unsorted_segment_max(tf.cast(applied, tf.int32), safe_indices, numel) > 0
    dropped = tf.logical_and(fits, tf.logical_not(tf.gather(hit, indices)))
    residual = _add_to_residual(residual, tf.where(dropped, indices, -1), values)
    return dense, residual


def reduce(
    indices: tf.Tensor,
    values: tf.Tensor,
    residual: tf.Tensor,
    layouts: "SparseLayouts",
    *,
    numel: int,
    wire_dtype: tf.DType,
    name: str,
    process_set: Any,
) -> Tuple[tf.Tensor, tf.Tensor, ops.Size]:
    """The sum over ranks of every rank's selected entries, as the sparse allreduce applies it.

    ``indices`` (k,) and ``values`` (k,) of ``wire_dtype`` are this rank's selection; ``residual`` is its residual
    after the selection (the selected entries already removed); ``layouts`` core.exchange.SparseAllreduceLayouts of
    that k (or, in a warm-up, sizes.StepSparseLayouts). Returns (flat dense sum of the applied entries, in
    the residual's dtype; the residual with the entries this exchange did not apply put back, and the owner's
    rounding; the bytes this rank handed to the collectives).
    """
    from horovod.tensorflow.mpi_ops import allgather, alltoall

    world_size = process_set.size()
    member = Member(indices, values, residual, layouts, numel, wire_dtype)
    send, kept, k = layouts.send, layouts.kept, layouts.k
    routed = _route(member, world_size)
    received = alltoall(routed.blocks, name=alltoall_name(name), ignore_name_scope=True, process_set=process_set)
    expected = f"{world_size} x {send.nbytes}, k={k}" if isinstance(k, int) else "this warm-up step's size"
    check = _size_check(received, world_size * send.nbytes, (
        f"horovod-topk: ranks disagree about tensor {name!r}: the sparse allreduce received another number of bytes "
        f"than this rank expects ({expected}). Check that every rank uses the same TopKEF configuration and the "
        f"same model."))
    with tf.control_dependencies([check]):
        received = tf.reshape(received, [-1])
    payload, residual = _own(member, routed, received, world_size)
    gathered = allgather(payload, name=owners_allgather_name(name), ignore_name_scope=True, process_set=process_set)
    check = _size_check(gathered, world_size * kept.nbytes, kept.mismatch_message(name, world_size))
    with tf.control_dependencies([check]):
        gathered = tf.identity(gathered)
    dense, residual = _apply(member, routed, residual, gathered, world_size)
    return dense, residual, layouts.sent_nbytes


def reduce_bucket(members: Sequence[Member], names: Sequence[str],
                  process_set: Any) -> List[Tuple[tf.Tensor, tf.Tensor]]:
    """:func:`reduce` of several tensors (named ``names``, in the bucket's order) by one alltoall and one
    allgather: row r of the alltoall holds every member's block for rank r, the allgather every member's kept
    payload, back to back in the bucket's order, so each member's arithmetic is exactly its own (a bucket changes
    how many collectives run, never what is applied). Sizes fixed or per step (a warm-up's, ratio="auto"'s). The
    collectives are named from the members (core.buckets.bucket_collective_name); a size other than every rank's
    layout implies (ranks that disagree about the bucket) fails the step on every rank with the bucket's name and
    members. Returns per member (flat dense sum, residual), as :func:`reduce`."""
    world_size = process_set.size()
    bucket = bucket_collective_name(names)
    routed = [_route(member, world_size) for member in members]
    received = buckets.alltoall_rows([r.blocks for r in routed], names, alltoall_name(bucket), process_set)
    owned = [_own(member, r, blocks, world_size) for member, r, blocks in zip(members, routed, received)]
    gathered = buckets.gather([payload for payload, _ in owned], names, process_set,
                              name=owners_allgather_name(bucket))
    return [_apply(member, r, residual, kept, world_size)
            for member, r, (_, residual), kept in zip(members, routed, owned, gathered)]
