"""One plan per bucket of gradients: which members are selected (and their k and payload), which go dense, and
the fingerprint every rank checks before the bucket's collectives.

A front end that is handed whole buckets (PyTorch DDP's communication hook hands it one flat buffer of several
parameters' gradients) asks core for this plan once and only executes it: one compensation + selection over the
compressed members (the grouped kernels on a GPU), one payload, one collective for all of them, and one dense
allreduce for the members that travel dense. Each member keeps the decision core.policy takes for it on its own
(its own k, so a bucket changes how many launches and collectives run, not what is selected: see core.buckets for
why one k over the whole bucket is not built), and its residual stays keyed by its name.

Pure functions and frozen dataclasses; standard library only.
"""
from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Tuple

from .autodensity import dense_plan, half_plan, int8_plan
from .buckets import BucketLayout
from .config import TopKConfig
from .consistency import fingerprint
from .exchange import ALLGATHER, DENSE, DENSE_HALF, DENSE_INT8
from .payload import PayloadLayout
from .policy import TensorPlan, plan_tensor, tensor_payload_layout, warmup_phase

__all__ = ["MemberPlan", "BucketPlan", "plan_bucket", "bucket_fingerprint"]


@dataclass(frozen=True)
class MemberPlan:
    """One member of a bucket on one step: where its gradient lies in the bucket's flat buffer and what happens
    to it (``layout`` is its payload's layout when it is compressed, else None)."""

    name: str
    offset: int
    numel: int
    plan: TensorPlan
    layout: Optional[PayloadLayout]

    @property
    def compressed(self) -> bool:
        return self.plan.compressed

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketPlan:
    """What one bucket does on one step, the same on every rank (every input is). Immutable: its derived views
    (dense, compressed, name, ...) are computed once per plan, and plan_bucket hands back the same plan while its
    inputs stay the same, so a bucket's per-step planning is a lookup in steady state."""

    members: Tuple[MemberPlan, ...]
    #: The exchanges the compressed members take this step (core.exchange), in the order of the first member
    #: that takes each; empty when no member is compressed.
    exchanges: Tuple[str, ...]

    @cached_property
    def exchange(self) -> str:
        """The exchange of the compressed members when they share one ("allgather" or "sparse_allreduce"),
        "mixed" when they do not, "dense" when no member is compressed."""
        if not self.exchanges:
            return DENSE
        return self.exchanges[0] if len(self.exchanges) == 1 else "mixed"

    @cached_property
    def compressed(self) -> Tuple[MemberPlan, ...]:
        return tuple(m for m in self.members if m.compressed)

    def taking(self, exchange: str) -> Tuple[MemberPlan, ...]:
        """The compressed members whose entries travel by ``exchange``, in bucket order."""
        return tuple(m for m in self.members if m.compressed and m.plan.exchange == exchange)

    @cached_property
    def dense(self) -> Tuple[MemberPlan, ...]:
        """The members that go dense as they are (their dense allreduce)."""
        return tuple(m for m in self.members if not m.compressed and m.plan.exchange not in (DENSE_HALF, DENSE_INT8))

    @cached_property
    def halved(self) -> Tuple[MemberPlan, ...]:
        """The members that go dense in float16 (ratio="auto"'s fp16: core.exchange.DENSE_HALF)."""
        return tuple(m for m in self.members if m.plan.exchange == DENSE_HALF)

    @cached_property
    def bytewise(self) -> Tuple[MemberPlan, ...]:
        """The members that go dense one byte a value (ratio="auto"'s int8: core.exchange.DENSE_INT8)."""
        return tuple(m for m in self.members if m.plan.exchange == DENSE_INT8)

    @cached_property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @cached_property
    def payload(self) -> Optional[BucketLayout]:
        """The allgather members' payloads back to back (one rank's share of the bucket's allgather)."""
        members = self.taking(ALLGATHER)
        if not members:
            return None
        return BucketLayout(tuple(m.name for m in members), tuple(m.layout.nbytes for m in members))  # type: ignore[union-attr]

    @cached_property
    def compressed_contiguous(self) -> bool:
        """Whether the compressed members lie end to end in the bucket's buffer (then the grouped kernels read
        the gradient in place instead of from a gathered copy)."""
        members = self.compressed
        return all(a.end == b.offset for a, b in zip(members, members[1:]))

    @cached_property
    def name(self) -> str:
        """A readable, deterministic name (first and last member, count, checksum of every name)."""
        names = [m.name for m in self.members]
        digest = zlib.crc32("\0".join(names).encode("utf-8")) & 0xFFFFFFFF
        last = f"..{names[-1]}" if len(names) > 1 else ""
        return f"bucket.{names[0]}{last}.{len(names)}.{digest:08x}"


#: plan_bucket's recent results: a model's buckets in steady state (after any warm-up) plan the same every step.
_PLANS: "OrderedDict[tuple, BucketPlan]" = OrderedDict()
_PLANS_KEPT = 256
_PLANS_LOCK = threading.Lock()


def plan_bucket(
    members: Sequence[Tuple[str, int]],
    config: Optional[TopKConfig],
    *,
    is_floating: bool,
    world_size: int,
    step: int,
    value_itemsize: int,
    grad_itemsize: int,
    sparse_available: bool = False,
    held: str = DENSE,
) -> BucketPlan:
    """The plan of a bucket whose flat buffer holds ``members`` ((name, numel), in buffer order) at ``step``.

    Each member is planned as on its own (core.policy.plan_tensor: min_numel, dense_fallback, warm-up, the
    exchange's cost model, which weighs the sparse allreduce where ``sparse_available``). The members that take
    the allgather share one payload and one allgather; those that take the sparse allreduce share one alltoall
    and one allgather. ``config`` None: every member dense, its values in float16 where ``held`` is DENSE_HALF and
    in bytes where it is DENSE_INT8 (ratio="auto" while dense, fp16 or int8 is in force: core.autodensity's
    half_plan, int8_plan).
    """
    if not members:
        raise ValueError("horovod-topk: a bucket needs at least one member")
    phase = warmup_phase(config, step) if config is not None else 0
    key = (tuple(members), config, is_floating, world_size, phase, value_itemsize, grad_itemsize, sparse_available,
           held if config is None else DENSE)
    with _PLANS_LOCK:  # hooks of several models may plan from several threads
        found = _PLANS.get(key)
        if found is not None:
            _PLANS.move_to_end(key)
            return found
    plan = _plan_bucket(members, config, is_floating=is_floating, world_size=world_size, step=step,
                        value_itemsize=value_itemsize, grad_itemsize=grad_itemsize, sparse_available=sparse_available,
                        held=held)
    with _PLANS_LOCK:
        plan = _PLANS.setdefault(key, plan)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan


def _plan_bucket(members: Sequence[Tuple[str, int]], config: Optional[TopKConfig], *, is_floating: bool,
                 world_size: int, step: int, value_itemsize: int, grad_itemsize: int,
                 sparse_available: bool, held: str) -> BucketPlan:
    planned, offset = [], 0
    for name, numel in members:
        if config is None:
            plan = (half_plan(numel, is_floating, grad_itemsize) if held == DENSE_HALF
                    else int8_plan(numel, is_floating, grad_itemsize) if held == DENSE_INT8 else dense_plan(numel))
            planned.append(MemberPlan(name, offset, numel, plan, None))
            offset += numel
            continue
        plan = plan_tensor(name, numel, is_floating, config, world_size=world_size, step=step,
                           value_itemsize=value_itemsize, grad_itemsize=grad_itemsize,
                           sparse_available=sparse_available)
        layout = (tensor_payload_layout(config, plan.k, numel, value_itemsize) if plan.k is not None else None)
        planned.append(MemberPlan(name, offset, numel, plan, layout))
        offset += numel
    exchanges: list = []
    for m in planned:
        if m.compressed and m.plan.exchange not in exchanges:
            exchanges.append(m.plan.exchange)
    return BucketPlan(tuple(planned), tuple(exchanges))


def bucket_fingerprint(config: TopKConfig, plan: BucketPlan, dtype: object, step: int) -> list:
    """The integers every rank must agree on for a bucket (core.consistency.fingerprint): the configuration, the
    bucket's size, dtype, step, total k and exchange, and as its "shape" (total elements, members, a checksum of
    every member's size and k), so that ranks whose buckets hold other members or other k's disagree by name."""
    detail = ",".join(f"{m.numel}:{m.plan.k if m.compressed else -1}:{m.plan.exchange}" for m in plan.members)
    # 20 bits: the fingerprint also holds the product of the "shape", which must stay within int64
    checksum = zlib.crc32(detail.encode("ascii")) & 0xFFFFF
    total_k = sum(m.plan.k for m in plan.compressed) if plan.compressed else None  # type: ignore[misc]
    route = plan.exchange if plan.exchange != "mixed" else None  # the checksum above names each member's
    return fingerprint(config, (plan.numel, len(plan.members), checksum), dtype, step, total_k, route)
