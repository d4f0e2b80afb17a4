"""Buckets for PyTorch (core.buckets): the selected payloads of a bucket's members, one exchange.

Each member is compensated, selected and packed when its gradient arrives, exactly as on its own
(``TopKEF.start_exchange``); instead of its own collectives its :class:`~.exchange.ExchangeRequest` waits here until
every member of its bucket has arrived on this step (members planned dense count as arrived: they go through
Horovod's allreduce on their own). Then the members planned for the allgather are concatenated in the bucket's static
order and sent with one allgather, and those planned for the sparse allreduce travel in one sparse allreduce (one
alltoall and one allgather, :mod:`.sparse_allreduce`), each named from its members (core.buckets). A member's
handle is an ordinary :class:`~.compressor.TopKHandle` whose wait returns that member's P payloads cut out of the
gathered buffer (so every backend and the compact encoding decompress as per tensor), or its part of the sparse
allreduce.

An allgather member whose backend is the Triton one (GPUs) or the fused kernel (CPUs) is not selected when it
arrives: it waits, unselected, and when its bucket is complete all such members are selected at once
(torch.bucket_select: one run of the grouped kernels, or one call of the fused kernel) into the front of the bucket's
payload; their handles add the gathered payloads back at once too. On a GPU kernel launches queue on the device, so
nothing is gained by launching each member's ~20 as it arrives, and everything by launching ~10 for the whole
bucket; on a CPU the selection's work is the same either way (the hooks run on the thread that runs backward), and
one call saves the Python around each member's.

A member on ratio="auto"'s fp16 or int8 route waits, unsent, in a bucket of its route's own (core.buckets,
held_bucket_bytes); when that bucket is complete its members' float16 values go in one allreduce and their int8
words in another (torch.held_routes), and the first member's wait writes every member's result.

A bucket whose last member never arrives on a step (a parameter whose gradient Horovod sends another way, such as
a sparse one) is sent with what it has when ``synchronize()`` first waits for one of its members: Horovod's
optimizer starts every parameter's reduction before it waits for any, so every rank sends the same members.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from ..core import PayloadSizeMismatch
from ..core.buckets import BucketLayout, BucketTable, bucket_collective_name
from ..core.exchange import ALLGATHER, SPARSE_ALLREDUCE
from ..core.naming import half_allreduce_name, int8_allreduce_name
from .bucket_select import BucketSelection
from .exchange import ExchangeRequest
from .held_routes import HeldMember, HeldRoutes
from .sparse_allreduce import SparseAllreduce, SparseAllreduceFlight

__all__ = ["BucketFlight", "BucketedExchange", "BucketMemberHandle", "UnselectedMember", "HeldArrival",
           "bucket_member_names"]


@dataclass
class UnselectedMember:
    """An allgather member whose selection waits for its bucket to be complete (on a GPU: torch.bucket_select)."""

    name: str
    record: Any
    tensor: torch.Tensor
    #: The gradient's flat buffer: read by the selection, the reduced gradient written over it.
    flat: torch.Tensor
    k: int
    world_size: int
    op_name: str
    scale: float
    process_set: Any


@dataclass
class HeldArrival:
    """A member on ratio="auto"'s fp16 or int8 route, waiting for its bucket (torch.held_routes)."""

    member: HeldMember
    int8: bool
    shape: tuple
    scale: float
    world_size: int
    op_name: str
    process_set: Any


class BucketFlight:
    """One bucket on one step: the requests that wait for it, then its collectives."""

    def __init__(self, members: tuple, owner: "BucketedExchange") -> None:
        self.members = members
        self.arrived: set = set()
        #: exchange ("allgather" / "sparse_allreduce") -> member name -> its request
        self.requests: Dict[str, Dict[str, ExchangeRequest]] = {ALLGATHER: {}, SPARSE_ALLREDUCE: {}}
        #: allgather members to be selected together at launch, and their selection then
        self.unselected: Dict[str, UnselectedMember] = {}
        self.selection: Optional[BucketSelection] = None
        #: members on ratio="auto"'s fp16 or int8 route, their wire buffers at launch, and those buffers' allreduces
        self.held: Dict[str, HeldArrival] = {}
        self.held_routes: Optional[HeldRoutes] = None
        self._held_handles: Optional[tuple] = None
        self._added_back = False
        self.layout: Optional[BucketLayout] = None
        self.sparse: Optional[SparseAllreduceFlight] = None
        self.launched = False
        self._owner = owner
        self._handle: Any = None
        self._rows: Optional[torch.Tensor] = None

    @property
    def complete(self) -> bool:
        return len(self.arrived) == len(self.members)

    @property
    def carried(self) -> int:
        return sum(len(r) for r in self.requests.values()) + len(self.unselected) + len(self.held)

    def launch(self) -> None:
        """One allgather of the allgather members' payloads (those selected together first, then those selected
        on arrival) and one sparse allreduce of the others, each in the bucket's order."""
        from horovod.torch.mpi_ops import allgather_async

        self.launched = True
        names: List[str] = []
        sizes: List[int] = []
        parts: List[torch.Tensor] = []
        process_set = None
        together = [self.unselected[n] for n in self.members if n in self.unselected]
        if together:
            first = together[0]
            self.selection = BucketSelection(self._owner.state, [(m.name, m.record, m.tensor, m.flat, m.k)
                                                                 for m in together], first.world_size, first.op_name)
            for m in self.selection.members:
                names.append(m.name)
                sizes.append(m.layout.nbytes)
            parts.append(self.selection.payload)
            process_set = first.process_set
        gathered = self.requests[ALLGATHER]
        for name in self.members:
            if name in gathered:
                names.append(name)
                sizes.append(gathered[name].layout.nbytes)
                parts.append(gathered[name].payload)
                process_set = gathered[name].process_set
        if names:
            self.layout = BucketLayout(tuple(names), tuple(sizes))
            payload = torch.cat(parts) if len(parts) > 1 else parts[0]
            self._handle = allgather_async(payload, name=self.layout.collective_name, process_set=process_set)
        sparse = self.requests[SPARSE_ALLREDUCE]
        ordered = [name for name in self.members if name in sparse]
        if ordered:
            self.sparse = self._owner.sparse().start_flight([sparse[n] for n in ordered],
                                                             bucket_collective_name(ordered))
        held = [self.held[n] for n in self.members if n in self.held]
        if held:
            self._launch_held(held)

    def _launch_held(self, held: List[HeldArrival]) -> None:
        """The fp16 members' float16 values in one allreduce and the int8 members' words in another, each named
        from the members it carries."""
        from horovod.torch.mpi_ops import Sum, allreduce_async_

        first = held[0]
        self.held_routes = routes = HeldRoutes(
            self._owner.state, [a.member for a in held if not a.int8], [a.member for a in held if a.int8],
            first.scale, first.world_size, first.op_name)
        name = bucket_collective_name([a.member.name for a in held])
        self._held_handles = tuple(
            None if wire is None else allreduce_async_(wire, name=named(name), op=Sum, process_set=first.process_set)
            for wire, named in ((routes.half, half_allreduce_name), (routes.int8, int8_allreduce_name)))

    def _gathered_rows(self, world_size: int) -> torch.Tensor:
        """The bucket's allgather as P rows; sends the bucket first if it still waits for members, and waits for
        its allgather the first time."""
        if not self.launched:
            self._owner.flush()
        if self._rows is None:
            from horovod.torch.mpi_ops import synchronize

            assert self.layout is not None
            gathered = synchronize(self._handle)
            message = self.layout.mismatch_message(world_size, gathered.numel())
            if message is not None:
                raise PayloadSizeMismatch(message)
            self._rows = gathered.view(world_size, self.layout.total_nbytes)
        return self._rows

    def member_payloads(self, name: str) -> torch.Tensor:
        """The P payloads of allgather member ``name`` selected on arrival (contiguous, as a per-tensor allgather
        returns them)."""
        rows = self._gathered_rows(self.requests[ALLGATHER][name].world_size)
        assert self.layout is not None
        start, end = self.layout.member_slice(name)
        return rows[:, start:end].contiguous().view(-1)

    def result(self, name: str) -> torch.Tensor:
        """The reduced gradient of member ``name``, selected together with others or travelling by the sparse
        allreduce."""
        if not self.launched:
            self._owner.flush()
        arrival = self.held.get(name)
        if arrival is not None:
            return self._held_result(arrival)
        member = self.unselected.get(name)
        if member is None:
            assert self.sparse is not None
            return self.sparse.result(list(self.sparse_members).index(name))
        if not self._added_back:  # every member selected together is written at once
            assert self.selection is not None
            rows = self._gathered_rows(member.world_size)
            self.selection.finish(rows[:, :self.selection.payload.numel()], member.scale)
            self._added_back = True
        return member.flat.view(member.tensor.shape)

    def _held_result(self, arrival: HeldArrival) -> torch.Tensor:
        """A held member's reduced gradient: the first call waits for the bucket's allreduces and writes every held
        member's result at once."""
        if self._held_handles is not None:
            from horovod.torch.mpi_ops import synchronize

            handles, self._held_handles = self._held_handles, None
            assert self.held_routes is not None
            self.held_routes.finish(*(None if h is None else synchronize(h) for h in handles))
        return arrival.member.flat.view(arrival.shape)

    @property
    def sparse_members(self) -> List[str]:
        return [name for name in self.members if name in self.requests[SPARSE_ALLREDUCE]]


class BucketMemberHandle:
    """A bucket member's part of its bucket's sparse allreduce, or of the payloads selected together; calling it
    waits and returns its reduced gradient."""

    def __init__(self, flight: BucketFlight, name: str) -> None:
        self._flight = flight
        self._name = name

    def __call__(self) -> torch.Tensor:
        return self._flight.result(self._name)


class BucketedExchange:
    """The exchanges of a compressor's bucketed tensors: holds each bucket's requests for the step until the bucket
    is complete."""

    def __init__(self, table: BucketTable, sparse: Callable[[], SparseAllreduce], state: Any) -> None:
        self.table = table
        #: The compressor's sparse allreduce (made on first use).
        self.sparse = sparse
        #: The compressor (a TorchResiduals): members selected together at launch use its state.
        self.state = state
        self._open: Dict[int, BucketFlight] = {}
        #: Buckets sent, the member payloads they carried, and those sent before all members had arrived
        #: (stats()["buckets"]).
        self.collectives = 0
        self.tensors = 0
        self.flushed_incomplete = 0
        #: Buckets whose allgather members were selected by one run of the grouped kernels.
        self.grouped = 0

    def covers(self, name: str) -> bool:
        return self.table.bucket_of(name) is not None

    def arrive(self, name: str, request: Optional[ExchangeRequest], exchange: str,
               allgather_handle: Callable[[ExchangeRequest, Any, Callable[[Any], torch.Tensor]], Any],
               unselected: Optional[UnselectedMember] = None, held: Optional[HeldArrival] = None) -> Any:
        """Member ``name`` has arrived on this step with the payload it sends by ``exchange``, or unselected (an
        allgather member selected with the others at launch), or on ratio="auto"'s fp16 or int8 route (``held``:
        sent with the bucket's others of its route at launch), or without any (it went dense). Returns the
        member's handle (``allgather_handle`` builds an allgather member's from the request, the flight and the
        wait), or None when it went dense."""
        index = self.table.bucket_of(name)
        assert index is not None
        flight = self._open.get(index)
        if flight is not None and name in flight.arrived:  # the bucket of an earlier step never completed
            self._send(index, flight)
            flight = None
        if flight is None:
            flight = self._open[index] = BucketFlight(self.table.buckets[index], self)
        flight.arrived.add(name)
        handle = None
        if unselected is not None:
            flight.unselected[name] = unselected
            handle = BucketMemberHandle(flight, name)
        elif held is not None:
            flight.held[name] = held
            handle = BucketMemberHandle(flight, name)
        elif request is not None:
            flight.requests[exchange][name] = request
            if exchange == ALLGATHER:
                handle = allgather_handle(request, flight, lambda f: f.member_payloads(name))
            else:
                handle = BucketMemberHandle(flight, name)
        if flight.complete:
            self._send(index, flight)
        return handle

    def _send(self, index: int, flight: BucketFlight) -> None:
        del self._open[index]
        if flight.carried:
            self.collectives += 1
            self.tensors += flight.carried
            self.flushed_incomplete += not flight.complete
            flight.launch()
            self.grouped += flight.selection is not None and flight.selection.grouped

    def flush(self) -> None:
        """Send every bucket still waiting for members, in bucket order (the same on every rank)."""
        for index in sorted(self._open):
            self._send(index, self._open[index])

    def abandon_in_flight(self) -> None:
        """Forget the buckets of a step that will never be synchronized (a loaded state, an elastic reset)."""
        self._open = {}

    def stats(self) -> Dict[str, int]:
        return {"buckets": len(self.table), "collectives": self.collectives, "tensors": self.tensors,
                "flushed_incomplete": self.flushed_incomplete, "grouped": self.grouped}


def bucket_member_names(named: List[tuple]) -> List[tuple]:
    """(name, gradient bytes) of the parameters that get gradients, in the order backward usually produces them:
    the reverse of the parameter list (what PyTorch DDP assumes before it has seen a backward pass)."""
    return [(name, p.numel() * p.element_size()) for name, p in reversed(named)
            if getattr(p, "requires_grad", False) and p.is_floating_point()]
