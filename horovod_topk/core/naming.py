"""Deterministic names for the collectives we issue.

Horovod matches collectives across ranks by name; unnamed ones are numbered by a per-process counter that only
matches when every rank issues them in the same order. Every allgather of ours is named from the tensor's own name,
with a prefix of its own so it never collides with Horovod's dense allreduce of the same tensor.
"""
from __future__ import annotations

__all__ = ["ALLGATHER_PREFIX", "allgather_name", "alltoall_name", "owners_allgather_name", "half_allreduce_name",
           "int8_allreduce_name", "group_member_name"]

ALLGATHER_PREFIX = "topk."


def allgather_name(tensor_name: str) -> str:
    return ALLGATHER_PREFIX + tensor_name


def alltoall_name(tensor_name: str) -> str:
    """Phase 1 of the sparse allreduce of ``tensor_name`` (core.exchange): the alltoall to the region owners.

    A prefix of its own ("topk-", not "topk."), so no tensor name can make it equal another tensor's allgather."""
    return "topk-sar1." + tensor_name


def owners_allgather_name(tensor_name: str) -> str:
    """Phase 2 of the sparse allreduce of ``tensor_name``: the allgather of the owners' kept sums."""
    return "topk-sar2." + tensor_name


def half_allreduce_name(tensor_name: str) -> str:
    """The float16 allreduce of ``tensor_name`` (ratio="auto"'s fp16, core.exchange.DENSE_HALF)."""
    return "topk-fp16." + tensor_name


def int8_allreduce_name(tensor_name: str) -> str:
    """The int32-word allreduce of ``tensor_name`` on the int8 route (ratio="auto"'s int8, core.exchange.DENSE_INT8)."""
    return "topk-int8." + tensor_name


def group_member_name(group_name: str, position: int) -> str:
    """Name of the tensor at ``position`` of a Horovod group reduction called ``group_name``.

    Horovod hands a group's collective only the group's name (that of its first tensor); the group's member order is
    made identical on every rank by Horovod itself (broadcast from rank 0), so the position identifies a tensor.
    """
    return f"{group_name}#{position}"
