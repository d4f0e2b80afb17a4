"""ratio="auto"'s fp16 and int8 routes for the members of one bucket on one step: one wire buffer per route.

Both front ends that bucket gradients hand whole buckets to the routes here: the DDP hook's bucket step
(torch.bucket_step, members are slices of DDP's flat bucket) and Horovod's bucketed exchange (torch.buckets, members
are the parameters' own gradients). Each member keeps its own residual, grid and non-finite handling, so a member's
result is what it would be on its own (torch.half_route, torch.int8_route); the bucket decides that the fp16 members'
float16 values travel back to back as one tensor and the int8 members' words as another, each summed by one
allreduce, instead of one collective per tensor. The executor never calls a collective: the front end sums
:attr:`HeldRoutes.half` and :attr:`HeldRoutes.int8` and hands the sums to :meth:`HeldRoutes.finish`.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .half_route import to_half
from .int8_route import from_int8, int8_words, largest_finite

__all__ = ["HeldMember", "HeldRoutes"]


class HeldMember(NamedTuple):
    """One gradient of a bucket that goes dense on ratio="auto"'s fp16 or int8 route this step."""

    name: str
    #: Its record (core.registry): residual, counters and the int8 grid's reference.
    record: Any
    #: Its flat gradient: read by the send, the reduced gradient written over it.
    flat: torch.Tensor


class HeldRoutes:
    """The fp16 and int8 members of one bucket on one step.

    Args:
        state: the front end's state (a ``TorchResiduals`` + ``core.CompressorState``).
        half: the members on the fp16 route, in bucket order.
        int8: the members on the int8 route, in bucket order; those without a grid yet (their first step on the
            route, a load without one) go fp16 this step, after ``half``, and their result sets their grid.
        scale: what the sum over ranks is multiplied by (core.pending.reduction_scale).
        world_size: ranks that reduce the bucket.
        op_name: the reduction ("average" or "sum": a residual built under another world size is rescaled by it).
        span: the fp16 members' gradients as one tensor where they lie end to end in one buffer (a DDP bucket),
            else None.
    """

    def __init__(self, state: Any, half: Sequence[HeldMember], int8: Sequence[HeldMember], scale: float,
                 world_size: int, op_name: str, span: Optional[torch.Tensor] = None) -> None:
        self.scale = scale
        self.world_size = world_size
        #: The int8 members' int32 words (torch.int8_route), member after member, ready for a sum-allreduce, or
        #: None; each such member with its grid step.
        self.int8: Optional[torch.Tensor] = None
        self._int8_sent: List[Tuple[HeldMember, float]] = []
        #: The records of the int8 members that go fp16 this step, by name: their result sets their grid.
        self._int8_unset: Dict[str, Any] = {}
        halved = list(half)
        if int8:
            halved += self._send_int8(state, int8, op_name)
            span = None if len(halved) > len(half) else span
        #: The fp16 members' float16 values back to back, ready for a sum-allreduce, or None; the members they are.
        self.half: Optional[torch.Tensor] = None
        self.half_members: Tuple[HeldMember, ...] = tuple(halved)
        if halved:
            self.half = torch.empty(sum(m.flat.numel() for m in halved), dtype=torch.float16,
                                    device=halved[0].flat.device)
            self._send_half(state, op_name, span)

    def _send_int8(self, state: Any, members: Sequence[HeldMember], op_name: str) -> List[HeldMember]:
        """The int8 members' words into :attr:`int8`, each on its own grid (its record's reference: the largest
        magnitude of its last result, the same on every rank). Returns the members without a grid yet."""
        words, without = [], []
        for member in members:
            if member.record.int8_reference > 0.0:
                sent, delta = state._send_int8(member.name, member.record, member.flat, self.scale, self.world_size,
                                               op_name)
                words.append(sent)
                self._int8_sent.append((member, delta))
            else:
                without.append(member)
                self._int8_unset[member.name] = member.record
        if words:
            self.int8 = torch.cat(words) if len(words) > 1 else words[0]
        return without

    def _send_half(self, state: Any, op_name: str, span: Optional[torch.Tensor]) -> None:
        """The fp16 members into :attr:`half` (torch.half_route). On the CPU member by member (one pass of the fused
        kernel each). Elsewhere, given their ``span``, as one tensor: their residuals joined, one run of the torch
        operations over the bucket, the residuals copied back -- about ten launches per bucket instead of eight per
        member (ResNet-50's 161 tensors: 12 ms of the host's time per step on an H100). A non-finite gradient there
        is counted for every member of the bucket (which member had it is not read: no host wait)."""
        assert self.half is not None
        members = self.half_members
        if span is not None and span.device.type != "cpu" and len(members) > 1:
            residuals = [state._residual_for(m.name, m.record, m.flat, self.world_size, op_name)[0] for m in members]
            joined = torch.cat(residuals)
            _, nonfinite = to_half(span, joined, self.scale, self.world_size, self.half)
            torch._foreach_copy_(residuals, list(joined.split([m.flat.numel() for m in members])))
            for member in members:
                state._sent_half(member.record, member.flat.numel(), nonfinite)
            return
        at = 0
        for member in members:
            numel = member.flat.numel()
            state._send_half(member.name, member.record, member.flat, self.scale, self.world_size, op_name,
                             self.half[at:at + numel])
            at += numel

    def finish(self, half_sum: Optional[torch.Tensor], int8_sum: Optional[torch.Tensor]) -> None:
        """Write each member's reduced gradient over its flat gradient from the sum-allreduces of :attr:`half` and
        :attr:`int8`, and keep each int8 member's next grid reference."""
        if half_sum is not None:
            members = self.half_members
            sizes = [m.flat.numel() for m in members]
            torch._foreach_copy_([m.flat for m in members], list(half_sum.split(sizes)))
            at = 0
            for member, numel in zip(members, sizes):  # an int8 member's fp16 step: its result sets the grid
                record = self._int8_unset.get(member.name)
                if record is not None:
                    record.int8_reference = largest_finite(half_sum[at:at + numel])
                at += numel
        if int8_sum is not None:
            at = 0
            for member, delta in self._int8_sent:
                numel = member.flat.numel()
                words = int8_words(numel)
                _, member.record.int8_reference = from_int8(int8_sum[at:at + words], numel, self.world_size, delta,
                                                            member.flat)
                at += words
