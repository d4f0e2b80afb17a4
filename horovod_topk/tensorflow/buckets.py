"""Buckets for TensorFlow (core.buckets): the allgather payloads of a group's members, one collective.

Horovod's TensorFlow reductions hand a group of gradients to one call (``groups=``; when the user gives none,
horovod-topk asks Horovod for one group per reduction, horovod_topk.tensorflow.routing). Each member planned for the
allgather with a fixed k is still compensated, selected and packed by its own send body
(horovod_topk.tensorflow.steps), exactly as on its own; the payloads of a bucket's members are concatenated in the
bucket's order and travel in one allgather named from its members (core.buckets.bucket_collective_name); each
member's receive body gets its P payloads cut out of the gathered buffer. Members planned for the sparse allreduce
share its two collectives the same way (horovod_topk.tensorflow.sparse_allreduce.reduce_bucket: row r of the
alltoall holds every member's block for rank r). A bucket therefore changes how many collectives run and how many
ops the traced step holds, never what is selected or applied (a bucketed step equals the per-tensor one bit for
bit).

Which members share a bucket (:func:`assign`): the members of one group, in the order backward produces them (the
reverse of Horovod's list, as core.buckets assumes) up to ``bucket_bytes`` of gradient; a group the user gave is one
bucket whatever its bytes, as in PyTorch. Members whose route and k change from step to step inside the graph (a
warm-up, ratio="auto") share buckets with members at the same position: the bucket holds one ``tf.switch_case``
branch per combination of its members' routes (core.policy.bucket_routes), and in a branch the compressed members
share their exchange's collectives at the sizes in force (tensors, looked up per step) while the dense ones take
Horovod's allreduce each.

Overlap: a bucket's concatenation depends only on its members' payloads, so TensorFlow's executor starts the
bucket's allgather once its last member is packed, while backward computes the gradients of the next buckets.
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from ..core.buckets import BucketLayout, assign_buckets, bucket_collective_name

__all__ = ["alltoall_rows", "assign", "gather", "cap_in_force"]


def cap_in_force(bucket_bytes: int) -> int:
    """``bucket_bytes``, or 0 (one collective per tensor) under Horovod elastic: Horovod's elastic wrapper turns a
    failed collective into a reset only when the error names HorovodAllreduce, HorovodAllgather or
    HorovodBroadcast, which a grouped allreduce (HorovodGroupedAllreduce) does not, so a worker's death during a
    grouped step would end the job instead of resetting it."""
    return 0 if int(os.environ.get("HOROVOD_ELASTIC", "0") or 0) else bucket_bytes


def assign(members: Sequence[Tuple[str, int]], cap_bytes: Optional[int]) -> List[Tuple[str, ...]]:
    """The buckets of one group's ``members`` ((name, gradient bytes) in Horovod's order): by ``cap_bytes`` in
    backward's order, or the whole group as one bucket (``cap_bytes`` None: the user's group)."""
    if cap_bytes is None:
        return [tuple(name for name, _ in members)] if members else []
    return assign_buckets(list(reversed(members)), cap_bytes)


def gather(payloads: Sequence[tf.Tensor], members: Sequence[str], process_set: object,
           name: Optional[str] = None) -> List[tf.Tensor]:
    """Every rank's payloads of the bucket of ``members`` (this rank's in ``payloads``, one per member, in the
    bucket's order), by one allgather (named from the members, or ``name``): per member, its P payloads back to
    back, as its own allgather would return them. The payloads' sizes are static (a fixed k) or tensors (a
    warm-up's or ratio="auto"'s k, looked up per step). A gathered size other than P times this rank's bucket
    payload (ranks that disagree about the bucket) fails the step on every rank with the bucket's name and
    members."""
    from horovod.tensorflow.mpi_ops import allgather

    world_size = process_set.size()  # type: ignore[attr-defined]
    flat = [tf.reshape(p, [-1]) for p in payloads]
    return _columns(lambda joined: allgather(joined, name=name or bucket_collective_name(members),
                                             ignore_name_scope=True, process_set=process_set),
                    flat, members, world_size, axis=0, what="the allgather")


def alltoall_rows(blocks: Sequence[tf.Tensor], members: Sequence[str], name: str,
                  process_set: object) -> List[tf.Tensor]:
    """The sparse allreduce's first phase for a bucket: ``blocks`` (one (P, width_i) uint8 tensor per member, row r
    for rank r) side by side in one alltoall named ``name``; per member, the P blocks every rank sent this one,
    back to back (flat), as its own alltoall would return them. Sizes and the check as :func:`gather`."""
    from horovod.tensorflow.mpi_ops import alltoall

    world_size = process_set.size()  # type: ignore[attr-defined]
    return _columns(lambda joined: alltoall(joined, name=name, ignore_name_scope=True, process_set=process_set),
                    list(blocks), members, world_size, axis=1, what="the sparse allreduce's alltoall")


def _columns(collective: Callable[[tf.Tensor], tf.Tensor], parts: List[tf.Tensor], members: Sequence[str],
             world_size: int, *, axis: int, what: str) -> List[tf.Tensor]:
    """``parts`` joined along ``axis`` (0: flat payloads; 1: (P, width) rows), through ``collective`` (which
    returns P rows of the joined width), and cut back into each part's P rows (flat)."""
    widths = [p.shape[axis] for p in parts]
    if all(w is not None for w in widths):
        layout = BucketLayout(tuple(members), tuple(int(w) for w in widths))
        sizes, starts, total = list(layout.nbytes), list(layout.offsets), layout.total_nbytes
        message = layout.disagreement_message(world_size, f"{what} received another size")
    else:
        sizes = [tf.shape(p, out_type=tf.int32)[axis] for p in parts]
        starts = tf.unstack(tf.cumsum(tf.stack(sizes), exclusive=True))
        total = tf.add_n(sizes)
        message = BucketLayout.members_disagreement_message(
            members, f"{what} received another size than this step's sizes imply")
    received = collective(tf.concat(parts, axis=axis))
    check = tf.debugging.Assert(tf.equal(tf.size(received), world_size * total), [tf.constant(message)])
    with tf.control_dependencies([check]):
        rows = tf.reshape(received, [world_size, total])
    if isinstance(total, int):  # static sizes: a strided slice each (fewer graph ops than tf.slice's)
        return [tf.reshape(rows[:, start:start + width], [-1]) for start, width in zip(starts, sizes)]
    return [tf.reshape(tf.slice(rows, [0, start], [world_size, width]), [-1]) for start, width in zip(starts, sizes)]
