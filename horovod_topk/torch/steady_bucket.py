"""A DDP bucket's step in steady state: what a full BucketStep works out member by member, kept from its last run
and checked by identity instead of being worked out again.

Why: on a GPU the training step waits for the host, and the host's time in the hook was mostly Python per member
(record lookups, buffer slices, residual and layout checks: ~10 us each, hundreds per step for a transformer;
docs/performance.md, "A bucket in a training step"). In steady state none of it changes between steps: the same plan
(core memoises it), the same bucket buffer, the same records and residual views. A step that finds all of them
unchanged only bumps each member's counters and runs the bucket's kernels; anything else (the first steps, a
warm-up moving k, a load, a world-size change, buckets rebuilt, a member going dense) takes the full path.

Only the plain case is kept: every compressed member takes the allgather and is selected by one grouped run, no
spike guard and no DGC momentum (they read or change state per member and step).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from ..core.bucket_plan import BucketPlan

__all__ = ["SteadyBucket", "gather_ranges", "kept", "scatter_ranges"]


class SteadyBucket:
    """What one bucket's full step found, for the next steps of the same plan over the same buffer."""

    def __init__(self, state: Any, plan: BucketPlan, buffer: torch.Tensor, world_size: int, selection: Any) -> None:
        self.plan = plan
        self.address = buffer.data_ptr()
        self.world_size = world_size
        itemsize = buffer.element_size()
        records = state.registry.records
        self.names = [m.name for m in plan.members]
        self.records = [records[n] for n in self.names]
        #: Each member's gradient bytes (what it would send dense), in plan order.
        self.member_nbytes = [m.numel * itemsize for m in plan.members]
        #: Where the dense members lie in the buffer. Nothing here holds the buffer itself: its views are made
        #: again each step, so a buffer DDP has replaced is freed at once.
        self.dense_ranges = [(m.offset, m.end) for m in plan.dense]
        #: (record, bytes sent, place) of each dense member: their leftovers go out if they ever hold a residual
        self.dense = [(records[m.name], m.numel * itemsize, place) for m, place in zip(plan.dense, self.dense_ranges)]
        self._dense_key = ("dense", tuple(self.dense_ranges), world_size)
        self.selection = selection.steady_part(plan)
        self.sent = [m.layout.nbytes for m in selection.members]
        #: This bucket's whole step as one CUDA graph (torch.bucket_graph), once asked for: it lives and dies with
        #: this object, which is used only while everything the graph reads is what it was recorded over.
        self.whole: Optional[Any] = None

    @staticmethod
    def applies(state: Any, plan: BucketPlan, sparse: bool, selection: Any) -> bool:
        """Whether a step of ``plan`` may be kept: the plain grouped case (module docstring)."""
        return (selection is not None and selection.grouped and not sparse and state.config.spike_guard is None
                and state.config.momentum == 0)

    def matches(self, state: Any, plan: BucketPlan, buffer: torch.Tensor, world_size: int) -> bool:
        """Whether this step is the kept one's again: same plan object, buffer, world size, records (a load
        replaces them), residual views (a move replaces them) and group layout (still held)."""
        if plan is not self.plan or buffer.data_ptr() != self.address or world_size != self.world_size:
            return False
        records = state.registry.records
        for name, record in zip(self.names, self.records):
            if records.get(name) is not record:
                return False
        return self.selection.still_valid(state)

    def run(self, state: Any, buffer: torch.Tensor) -> Any:
        """The step's bookkeeping and selection; returns the bucket's BucketSelection, whose ``beside`` holds the
        dense members' gradients divided by the world size, gathered for their allreduce (or None if none): work on
        the same buffer, so recorded with the selection where that is a CUDA graph."""
        self.count(state, buffer)
        beside = None
        if self.dense_ranges:
            beside = ((*self._dense_key, buffer.data_ptr()), lambda: self.gather_dense(buffer))
        return self.selection.run(state, buffer, beside)

    @property
    def leftovers_due(self) -> bool:
        """Whether a dense member holds a residual whose leftovers go out with this step's gradient (a member
        compressed before: on a GPU its residual stays, see TorchResiduals._send_leftovers)."""
        return any(record.residual is not None for record, _, _ in self.dense)

    def count(self, state: Any, buffer: torch.Tensor) -> None:
        """The step's host bookkeeping: every member's counters and bytes, the dense members' leftovers."""
        for record, nbytes in zip(self.records, self.member_nbytes):
            record.steps += 1
            record.bytes_dense += nbytes
        for record, nbytes, (a, b) in self.dense:
            record.bytes_sent += nbytes
            if record.residual is not None:  # leftovers from compressed steps go out with the dense gradient
                state._send_leftovers(record, buffer[a:b])
        for record, nbytes in zip(self.selection.records, self.sent):
            record.bytes_sent += nbytes

    def dense_views(self, buffer: torch.Tensor) -> list:
        """The dense members' slices of ``buffer``, in plan order."""
        return [buffer[a:b] for a, b in self.dense_ranges]

    def gather_dense(self, buffer: torch.Tensor) -> torch.Tensor:
        """:func:`gather_ranges` of the dense members."""
        return gather_ranges(buffer, self.dense_ranges, self.world_size)

    def scatter_dense(self, buffer: torch.Tensor, dense_sum: torch.Tensor) -> None:
        """:func:`scatter_ranges` of the dense members' averages."""
        scatter_ranges(buffer, self.dense_ranges, dense_sum)


def gather_ranges(buffer: torch.Tensor, ranges: Sequence[Tuple[int, int]], world_size: int) -> torch.Tensor:
    """The slices ``ranges`` of ``buffer`` (a bucket's dense members) back to back, divided by the world size:
    ready for a sum-allreduce."""
    return torch.cat([buffer[a:b] for a, b in ranges]).div_(world_size)


def scatter_ranges(buffer: torch.Tensor, ranges: Sequence[Tuple[int, int]], values: torch.Tensor) -> None:
    """``values`` (laid out as :func:`gather_ranges` made them) written back over the slices ``ranges`` of
    ``buffer``: one batched copy (one multi-tensor kernel on CUDA)."""
    torch._foreach_copy_([buffer[a:b] for a, b in ranges], list(values.split([b - a for a, b in ranges])))


def kept(slot: Optional[dict], state: Any, plan: BucketPlan, buffer: torch.Tensor,
         world_size: int) -> Optional[SteadyBucket]:
    """The SteadyBucket in ``slot`` (a bucket buffer's cache entry) if it matches this step, else None."""
    if slot is None:
        return None
    found = slot.get("steady")
    return found if found is not None and found.matches(state, plan, buffer, world_size) else None
