"""Buckets of gradients: many compressed tensors, one collective.

Horovod hands TopKEF one gradient at a time, and a model has many: ResNet-50 55 compressed tensors, GPT-2 small 148.
Each tensor's own allgather pays Horovod's negotiation and a turn of its background loop, so per-tensor costs, not
bytes, dominate a step's exchange once the payloads are small. A bucket groups the tensors of one optimizer, in the
order backward produces their gradients and up to a cap of gradient bytes (PyTorch DDP's 25 MiB by default), and
sends all its members' payloads as one: each member is still compensated and selected on its own, with its own k,
residual and non-finite handling, so a bucket changes how many collectives run, never what is selected or applied
(a bucketed step equals the per-tensor step bit for bit).

Why keep the per-tensor k rather than one k over the bucket: one k over a bucket lets large-gradient layers take
every slot and starves the others for many steps; per-tensor k is what every convergence number of this project
was measured with. One k over a bucket is not built.

The bucket layout is static -- decided once from the optimizer's parameter list, the same on every rank -- so the
members, their order in the payload and the collective's name never depend on which rank saw which gradient
first. The order is the reverse of the parameter list (the order in which backward usually produces gradients,
PyTorch DDP's starting assumption); a bucket starts as soon as its last member arrives, so the first buckets travel
while backward still runs. What each member does on a given step (dense, allgather, sparse allreduce) is still its
own plan (core.policy); only the members planned for the allgather wait for their bucket. Residuals and
checkpoints stay keyed by tensor name: a checkpoint loads whatever the bucket layout of the new job.

Pure functions and one small state object; standard library only, like the rest of core.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .exchange import DENSE_HALF, DENSE_INT8

__all__ = ["DEFAULT_BUCKET_BYTES", "HELD_BUCKET_BYTES", "held_bucket_bytes", "assign_buckets", "BucketTable", "BucketLayout", "bucket_collective_name"]

#: Gradient bytes per bucket unless the user says otherwise: PyTorch DDP's default bucket size (25 MiB). Large
#: enough that a ResNet-50 (102 MB of float32 weights) makes 4-5 collectives instead of 55, small enough that the
#: first bucket leaves while backward still computes the rest.
DEFAULT_BUCKET_BYTES = 25 * 2**20

#: Gradient bytes per bucket of ratio="auto"'s fp16 and int8 routes, by route (at most the user's bucket_bytes; 0:
#: one allreduce per tensor). Those routes send every entry, so a bucket's payload is half or a quarter of its
#: gradients' bytes, not a hundredth, and a bucket leaves only when its last member is ready: the link waits while
#: backward fills it, and the last bucket's exchange is all left after backward. What a bucket saves is the host's
#: time per tensor (one kernel call per member but one collective per bucket, not Horovod's per tensor). Measured
#: on the test bed (docs/auto-density.md, "The routes' buckets under Horovod"): int8's buckets of 1 MiB shorten the
#: step, fp16's lengthen it at every cap tried (its payload is twice int8's), so fp16 keeps one allreduce per tensor.
HELD_BUCKET_BYTES: Dict[str, int] = {DENSE_HALF: 0, DENSE_INT8: 2**20}


def held_bucket_bytes(route: str, bucket_bytes: int) -> int:
    """The bucket cap of ``route`` (core.exchange.DENSE_HALF or DENSE_INT8) under the user's ``bucket_bytes``
    (0 keeps every tensor on its own there too)."""
    return min(bucket_bytes, HELD_BUCKET_BYTES[route])


def assign_buckets(tensors: Sequence[Tuple[str, int]], cap_bytes: int) -> List[Tuple[str, ...]]:
    """Split ``tensors`` ((name, gradient bytes), in the order their gradients become ready) into consecutive
    buckets of at most ``cap_bytes`` each; a tensor of ``cap_bytes`` or more is a bucket of its own. ``cap_bytes``
    0 puts every tensor in a bucket of its own (no bucketing)."""
    if cap_bytes < 0:
        raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
    buckets: List[Tuple[str, ...]] = []
    current: List[str] = []
    used = 0
    for name, nbytes in tensors:
        if current and (cap_bytes == 0 or used + nbytes > cap_bytes):
            buckets.append(tuple(current))
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(tuple(current))
    return buckets


def bucket_collective_name(members: Sequence[str]) -> str:
    """The name of the allgather that carries ``members``' payloads (in this order): readable ends, the count and
    a checksum of every name, so that two different member sets never share a collective name (Horovod matches
    collectives by name) and every rank derives the same one."""
    digest = zlib.crc32("\0".join(members).encode("utf-8")) & 0xFFFFFFFF
    last = f"..{members[-1]}" if len(members) > 1 else ""
    return f"topk.bucket.{members[0]}{last}.{len(members)}.{digest:08x}"


class BucketTable:
    """Which bucket each tensor belongs to, for every optimizer a compressor serves (names carry the optimizer's
    scope, core.scopes). Built once when an optimizer is wrapped; read on every step."""

    def __init__(self) -> None:
        self.buckets: List[Tuple[str, ...]] = []
        self._index: Dict[str, int] = {}

    def add(self, tensors: Sequence[Tuple[str, int]], cap_bytes: int) -> None:
        """Bucket one optimizer's ``tensors`` ((name, gradient bytes) in ready order). Names already bucketed
        (the same optimizer wrapped twice) are left where they are."""
        fresh = [(n, b) for n, b in tensors if n not in self._index]
        if cap_bytes == 0:
            return  # per tensor: nothing waits for anything
        for members in assign_buckets(fresh, cap_bytes):
            self._append(members)

    def add_groups(self, groups: Sequence[Sequence[str]], cap_bytes: int) -> None:
        """Make each of the user's groups (Horovod's ``groups=``: member names in the order Horovod reduces them)
        one bucket, whatever its bytes: Horovod reduces a group in one call once all its members are ready, so its
        compressed members already travel together, and one payload costs them nothing more. ``cap_bytes`` 0 keeps
        every tensor on its own, as in :meth:`add`."""
        if cap_bytes == 0:
            return
        for members in groups:
            self._append(tuple(n for n in members if n not in self._index))

    def _append(self, members: Tuple[str, ...]) -> None:
        """One more bucket of ``members``; a bucket of one is the per-tensor exchange: not held, not recorded."""
        if len(members) < 2:
            return
        for name in members:
            self._index[name] = len(self.buckets)
        self.buckets.append(members)

    def bucket_of(self, name: str) -> Optional[int]:
        return self._index.get(name)

    def __len__(self) -> int:
        return len(self.buckets)


@dataclass(frozen=True)
class BucketLayout:
    """One bucket payload of one step: the payloads of the members that travel, back to back in bucket order.

    ``members`` and ``nbytes`` are the names and payload sizes (core.payload) of the members planned for the
    allgather this step, in the bucket's static order; each rank's payload is their concatenation.
    """

    members: Tuple[str, ...]
    nbytes: Tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.members) != len(self.nbytes) or not self.members:
            raise ValueError("a bucket layout needs one payload size per member, and at least one member")

    @property
    def offsets(self) -> Tuple[int, ...]:
        """Where each member's payload starts in one rank's bucket payload."""
        out, at = [], 0
        for n in self.nbytes:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def total_nbytes(self) -> int:
        return sum(self.nbytes)

    @property
    def collective_name(self) -> str:
        return bucket_collective_name(self.members)

    def member_slice(self, name: str) -> Tuple[int, int]:
        """(start, end) of ``name``'s payload within one rank's bucket payload."""
        i = self.members.index(name)
        start = self.offsets[i]
        return start, start + self.nbytes[i]

    def mismatch_message(self, world_size: int, gathered_nbytes: int) -> Optional[str]:
        """None when an allgather of this bucket returned the size every rank's payload implies; otherwise the
        error that names the bucket and the sizes (ranks that disagree about its members or their k)."""
        if gathered_nbytes == world_size * self.total_nbytes:
            return None
        return self.disagreement_message(world_size, f"received {gathered_nbytes} bytes")

    def disagreement_message(self, world_size: int, received: str = "received another size") -> str:
        """The error for a gathered bucket of the wrong size, ``received`` saying what arrived (a graph built
        before any step knows only that the size differs)."""
        return self.members_disagreement_message(
            self.members, f"{received}, this rank expects {world_size * self.total_nbytes} bytes ({world_size} x "
                          f"{self.total_nbytes})")

    @staticmethod
    def members_disagreement_message(members: Sequence[str], detail: str) -> str:
        """The same error where the sizes are known only per step (a warm-up's, ratio="auto"'s)."""
        return (f"horovod-topk: ranks disagree about the bucket {bucket_collective_name(members)!r} (members "
                f"{', '.join(members)}): {detail}. Every rank must run the same model with the same TopKEF "
                f"configuration (bucket_bytes included).")
