"""One bucket plan (core.bucket_plan) executed on one step over the bucket's flat gradient buffer.

A front end that is handed whole buckets (the DDP communication hook) asks core for the plan, builds a
:class:`BucketStep`, hands :attr:`BucketStep.payload`, :attr:`BucketStep.sparse` and :attr:`BucketStep.dense` to its
collectives (one allgather; the sparse allreduce's alltoall and allgather; one allreduce each for the dense, the
fp16 and the int8 members), and calls
:meth:`BucketStep.finish` with what they returned. The step never calls a collective
itself, so it can be tested and timed without a process group, and the same executor serves any collective library.

Each compressed member keeps its own k, residual, momentum and non-finite handling, so a member's result is what it
would be alone; the bucket decides that all payloads travel as one, and on a GPU that the allgather members are
selected by one run of the grouped kernels (torch.bucket_select). Dense members carry their residual's leftovers
and are averaged by one allreduce.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.bucket_plan import BucketPlan, MemberPlan
from ..core.exchange import DENSE_HALF, DENSE_INT8, SPARSE_ALLREDUCE
from ..core.pending import reduction_scale
from .exchange import ExchangeRequest
from .held_routes import HeldMember, HeldRoutes
from .bucket_select import BucketSelection
from .sparse_allreduce import SparseRounds
from .steady_bucket import SteadyBucket, gather_ranges, kept, scatter_ranges

__all__ = ["BucketStep"]


class BucketStep:
    """The work of one bucket on one step.

    Args:
        state: the front end's state (a ``TorchResiduals`` + ``core.CompressorState``): records, residuals, selection.
        plan (BucketPlan): what each member does this step, the same on every rank.
        buffer (torch.Tensor): the bucket's flat gradients; the averaged gradients are written over it.
        shapes: each member's shape, in plan order (the records keep them, so checkpoints show them).
        world_size (int): ranks that average the bucket.
        slot (dict, optional): where this bucket buffer's steps keep what the next can reuse
            (torch.steady_bucket; the DDP hook gives one per buffer), or None.
    """

    def __init__(self, state: Any, plan: BucketPlan, buffer: torch.Tensor, shapes: Sequence[Tuple[int, ...]],
                 world_size: int, slot: Optional[Dict[str, Any]] = None) -> None:
        self.plan = plan
        self.buffer = buffer
        self.world_size = world_size
        self.scale = reduction_scale("average", 1.0, 1.0, world_size)
        #: The allgather members selected (torch.bucket_select: the grouped kernels on a GPU), or None.
        self.selection: Optional[BucketSelection] = None
        #: This rank's share of the bucket's allgather (uint8), or None when no member takes the allgather.
        self.payload: Optional[torch.Tensor] = None
        #: The sparse allreduce of the members that take it (its send blocks are ready), or None.
        self.sparse: Optional[SparseRounds] = None
        #: The dense members' gradients divided by the world size, ready for a sum-allreduce (the whole buffer
        #: itself, in place, when every member is dense: DDP's own allreduce, bit for bit), or None.
        self.dense: Optional[torch.Tensor] = None
        #: ratio="auto"'s fp16 and int8 members (torch.held_routes), or None; their float16 values back to back and
        #: their int32 words, each ready for a sum-allreduce, or None.
        self.held: Optional[HeldRoutes] = None
        self.half: Optional[torch.Tensor] = None
        self.int8: Optional[torch.Tensor] = None
        steady = kept(slot, state, plan, buffer, world_size)
        if steady is not None:  # the same bucket as last step in every respect: its kept work, not member by member
            self.selection = steady.run(state, buffer)
            self.payload = self.selection.payload
            self.dense = self.selection.beside
            return
        self._full_step(state, plan, buffer, shapes, world_size)
        if slot is not None:  # what a later step of this bucket can reuse (torch.steady_bucket), or nothing
            slot.pop("steady", None)
            if SteadyBucket.applies(state, plan, self.sparse is not None, self.selection):
                slot["steady"] = SteadyBucket(state, plan, buffer, world_size, self.selection)

    def _full_step(self, state: Any, plan: BucketPlan, buffer: torch.Tensor, shapes: Sequence[Tuple[int, ...]],
                   world_size: int) -> None:
        """Every member worked out from its record: its counters, spike guard, route, residual and layout."""
        itemsize = buffer.element_size()
        gathered: List[Tuple[str, Any, torch.Tensor, torch.Tensor, int]] = []
        layouts = []
        gathered_plan = []
        sparse: List[ExchangeRequest] = []
        for member, shape in zip(plan.members, shapes):
            record = state.registry.record(member.name, tuple(shape))
            flat = buffer[member.offset:member.end]
            state._guard_spike(record, flat)
            record.steps += 1
            record.bytes_dense += member.numel * itemsize
            if member.plan.exchange in (DENSE_HALF, DENSE_INT8):  # sent below, with the others of their route
                continue
            if not member.compressed:
                record.bytes_sent += member.numel * itemsize
                state._send_leftovers(record, flat)
                continue
            assert member.plan.k is not None
            record.exchange = member.plan.exchange
            if member.plan.exchange == SPARSE_ALLREDUCE:  # its rounds count its bytes
                payload, layout, wire_dtype, backend, residual = state._select(
                    member.name, record, flat, flat, member.plan.k, world_size, "average")
                sparse.append(ExchangeRequest(member.name, payload, layout, wire_dtype, flat, (member.numel,),
                                              self.scale, world_size, None, backend, residual, record))
                continue
            gathered.append((member.name, record, flat, flat, member.plan.k))
            layouts.append(member.layout)
            gathered_plan.append(member)
        if gathered:
            # every compressed member takes the allgather and they lie back to back: the kernels read them in place
            span = (buffer[gathered_plan[0].offset:gathered_plan[-1].end]
                    if not sparse and plan.compressed_contiguous else None)
            self.selection = BucketSelection(state, gathered, world_size, "average", layouts, span)
        self.payload = self.selection.payload if self.selection is not None else None
        self.sparse = SparseRounds(sparse) if sparse else None
        if plan.halved or plan.bytewise:  # ratio="auto"'s fp16 and int8: one buffer each (torch.held_routes)
            halved = plan.halved
            end_to_end = all(a.end == b.offset for a, b in zip(halved, halved[1:]))
            span = buffer[halved[0].offset:halved[-1].end] if halved and end_to_end else None
            self.held = HeldRoutes(state, [self._held_member(state, m, buffer) for m in halved],
                                   [self._held_member(state, m, buffer) for m in plan.bytewise], self.scale,
                                   world_size, "average", span)
            self.half, self.int8 = self.held.half, self.held.int8
        dense = plan.dense
        if len(dense) == len(plan.members):
            self.dense = buffer.div_(world_size)
        elif dense:
            self.dense = gather_ranges(buffer, [(m.offset, m.end) for m in dense], world_size)

    @staticmethod
    def _held_member(state: Any, member: MemberPlan, buffer: torch.Tensor) -> HeldMember:
        return HeldMember(member.name, state.registry.records[member.name], buffer[member.offset:member.end])

    def gathered_buffer(self) -> torch.Tensor:
        """Where the allgather of every rank's :attr:`payload` should land (a buffer the selection may keep, so
        that its adding back can replay as a CUDA graph): pass it to :meth:`finish` as ``gathered``."""
        assert self.selection is not None
        return self.selection.gathered_buffer(self.world_size)

    @property
    def all_dense(self) -> bool:
        return self.dense is self.buffer

    def finish(self, gathered: Optional[torch.Tensor], dense_sum: Optional[torch.Tensor],
               owners: Optional[torch.Tensor] = None, half_sum: Optional[torch.Tensor] = None,
               int8_sum: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the bucket's averaged gradients over the buffer from the allgather of every rank's payload
        (``gathered``, P payloads back to back), the sum-allreduce of :attr:`dense`, the sparse allreduce's
        allgather of the owners' kept sums (``owners``) and the sum-allreduces of :attr:`half` and :attr:`int8`;
        returns the buffer."""
        if self.held is not None:
            self.held.finish(half_sum, int8_sum)
        copy_back = None
        if dense_sum is not None and not self.all_dense:
            ranges, buffer = [(m.offset, m.end) for m in self.plan.dense], self.buffer

            def copy_back() -> None:
                scatter_ranges(buffer, ranges, dense_sum)
        if self.selection is not None:
            assert gathered is not None and self.payload is not None
            per_rank = self.payload.numel()
            if gathered.numel() != per_rank * self.world_size:
                raise ValueError(f"horovod-topk: the bucket {self.plan.name!r} received {gathered.numel()} bytes, "
                                 f"this rank expects {self.world_size} x {per_rank}: ranks disagree about it")
            # The dense members' copy back goes with the adding back (one CUDA graph, where that is one) only when
            # their sum lies in the selection's own output, the same address every step: a full step's sum is a
            # new tensor each time, and keyed by its address it would record a graph again and again.
            with_it = None
            if copy_back is not None and dense_sum is self.selection.beside:  # its graph's key, built only here
                with_it = ((dense_sum.data_ptr(), self.buffer.data_ptr(), tuple(ranges)), copy_back)
                copy_back = None
            self.selection.finish(gathered.view(self.world_size, per_rank), self.scale, with_it)
        if self.sparse is not None:
            assert owners is not None
            rows = self.sparse.gathered_rows(owners)
            for i in range(len(self.sparse.requests)):
                self.sparse.apply(i, rows)  # written over the member's slice of the buffer
        if copy_back is not None:
            copy_back()
        return self.buffer
