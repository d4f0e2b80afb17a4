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
bucket whatever its bytes, as in PyTorch. Members whose route changes from step to step inside the graph (a
warm-up, ratio="auto") travel on their own.

Overlap: a bucket's concatenation depends only on its members' payloads, so TensorFlow's executor starts the
bucket's allgather once its last member is packed, while backward computes the gradients of the next buckets.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from ..core.buckets import BucketLayout, assign_buckets

__all__ = ["assign", "gather", "cap_in_force"]


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


def gather(payloads: Sequence[tf.Tensor], layout: BucketLayout, process_set: object) -> List[tf.Tensor]:
    """Every rank's payloads of the bucket ``layout`` (this rank's in ``payloads``, one per member, of the layout's
    sizes), by one allgather: per member, its P payloads back to back, as its own allgather would return them.
    A gathered size other than P times this rank's bucket payload (ranks that disagree about the bucket) fails the
    step on every rank with the bucket's name and members."""
    from horovod.tensorflow.mpi_ops import allgather

    world_size = process_set.size()  # type: ignore[attr-defined]
    joined = tf.concat([tf.reshape(p, [-1]) for p in payloads], axis=0)
    gathered = allgather(joined, name=layout.collective_name, ignore_name_scope=True, process_set=process_set)
    check = tf.debugging.Assert(tf.equal(tf.size(gathered), world_size * layout.total_nbytes),
                                [tf.constant(layout.disagreement_message(world_size))])
    with tf.control_dependencies([check]):
        rows = tf.reshape(gathered, [world_size, layout.total_nbytes])
    return [tf.reshape(rows[:, start:start + nbytes], [-1])
            for start, nbytes in zip(layout.offsets, layout.nbytes)]
