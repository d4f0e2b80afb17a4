"""The bucketed allgather for PyTorch (core.buckets): the selected payloads of a bucket's members, one collective.

Each member is compensated, selected and packed when its gradient arrives, exactly as on its own
(``TopKEF.start_exchange``); instead of its own allgather its :class:`~.exchange.ExchangeRequest` waits here until
every member of its bucket has arrived on this step (members planned dense or for the sparse allreduce count as
arrived: they travel on their own). Then the waiting payloads are concatenated in the bucket's static order and
sent with one allgather named from its members (core.buckets). Each member's handle is an ordinary
:class:`~.compressor.TopKHandle` whose wait returns that member's P payloads cut out of the gathered buffer, so the
decompression (every backend, the compact encoding) is the per-tensor one.

A bucket whose last member never arrives on a step (a parameter whose gradient Horovod sends another way, such as
a sparse one) is sent with what it has when ``synchronize()`` first waits for one of its members: Horovod's
optimizer starts every parameter's reduction before it waits for any, so every rank sends the same members.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..core import PayloadSizeMismatch
from ..core.buckets import BucketLayout, BucketTable
from .exchange import ExchangeRequest

__all__ = ["BucketFlight", "BucketedAllgather"]


class BucketFlight:
    """One bucket on one step: the requests that wait for it, then its allgather."""

    def __init__(self, members: tuple, on_launch: Callable[["BucketFlight"], None]) -> None:
        self.members = members
        self.arrived: set = set()
        self.requests: Dict[str, ExchangeRequest] = {}
        self.layout: Optional[BucketLayout] = None
        self._on_launch = on_launch
        self._handle: Any = None
        self._rows: Optional[torch.Tensor] = None

    @property
    def complete(self) -> bool:
        return len(self.arrived) == len(self.members)

    @property
    def launched(self) -> bool:
        return self.layout is not None

    def launch(self) -> None:
        """One allgather of the waiting members' payloads, in the bucket's order."""
        from horovod.torch.mpi_ops import allgather_async

        ordered = [name for name in self.members if name in self.requests]
        self.layout = BucketLayout(tuple(ordered), tuple(self.requests[n].layout.nbytes for n in ordered))
        first = self.requests[ordered[0]]
        payload = torch.cat([self.requests[n].payload for n in ordered])
        self._handle = allgather_async(payload, name=self.layout.collective_name, process_set=first.process_set)
        self._on_launch(self)

    def member_payloads(self, name: str) -> torch.Tensor:
        """The P payloads of member ``name`` (contiguous, as a per-tensor allgather returns them); waits for the
        bucket's allgather the first time."""
        if self._rows is None:
            from horovod.torch.mpi_ops import synchronize

            assert self.layout is not None
            request = self.requests[name]
            gathered = synchronize(self._handle)
            message = self.layout.mismatch_message(request.world_size, gathered.numel())
            if message is not None:
                raise PayloadSizeMismatch(message)
            self._rows = gathered.view(request.world_size, self.layout.total_nbytes)
        start, end = self.layout.member_slice(name)
        return self._rows[:, start:end].contiguous().view(-1)


class BucketedAllgather:
    """The allgather exchange of a compressor's bucketed tensors: holds each bucket's requests for the step until
    the bucket is complete."""

    def __init__(self, table: BucketTable) -> None:
        self.table = table
        self._open: Dict[int, BucketFlight] = {}
        #: Bucket allgathers launched and the member payloads they carried (stats()["buckets"]).
        self.collectives = 0
        self.tensors = 0
        self.flushed_incomplete = 0

    def covers(self, name: str) -> bool:
        return self.table.bucket_of(name) is not None

    def arrive(self, name: str, request: Optional[ExchangeRequest],
               handle_for: Callable[[ExchangeRequest, Any, Callable[[Any], torch.Tensor]], Any]) -> Any:
        """Member ``name`` has arrived on this step, with the payload it sends by allgather (``request``) or
        without one (it went dense or by the sparse allreduce). Returns the member's handle (``handle_for``
        builds it from the request, the flight and the wait), or None without a request."""
        index = self.table.bucket_of(name)
        assert index is not None
        flight = self._open.get(index)
        if flight is not None and name in flight.arrived:  # the bucket of an earlier step never completed
            self._launch_or_drop(index, flight)
            flight = None
        if flight is None:
            flight = self._open[index] = BucketFlight(self.table.buckets[index], self._count)
        flight.arrived.add(name)
        handle = None
        if request is not None:
            flight.requests[name] = request
            handle = handle_for(request, flight, self._wait_for(name))
        if flight.complete:
            self._launch_or_drop(index, flight)
        return handle

    def _wait_for(self, name: str) -> Callable[[BucketFlight], torch.Tensor]:
        def wait(flight: BucketFlight) -> torch.Tensor:
            if not flight.launched:
                self.flush()
            return flight.member_payloads(name)
        return wait

    def _launch_or_drop(self, index: int, flight: BucketFlight) -> None:
        del self._open[index]
        if flight.requests:
            if not flight.complete:
                self.flushed_incomplete += 1
            flight.launch()

    def _count(self, flight: BucketFlight) -> None:
        self.collectives += 1
        self.tensors += len(flight.requests)

    def flush(self) -> None:
        """Send every bucket still waiting for members, in bucket order (the same on every rank)."""
        for index in sorted(self._open):
            self._launch_or_drop(index, self._open[index])

    def abandon_in_flight(self) -> None:
        """Forget the buckets of a step that will never be synchronized (a loaded state, an elastic reset)."""
        self._open = {}

    def stats(self) -> Dict[str, int]:
        return {"buckets": len(self.table), "collectives": self.collectives, "tensors": self.tensors,
                "flushed_incomplete": self.flushed_incomplete}


def bucket_member_names(named: List[tuple]) -> List[tuple]:
    """(name, gradient bytes) of the parameters that get gradients, in the order backward usually produces them:
    the reverse of the parameter list (what PyTorch DDP assumes before it has seen a backward pass)."""
    return [(name, p.numel() * p.element_size()) for name, p in reversed(named)
            if getattr(p, "requires_grad", False) and p.is_floating_point()]
