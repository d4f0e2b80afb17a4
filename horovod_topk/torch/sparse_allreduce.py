"""The sparse allreduce exchange for PyTorch (core.exchange): an alltoall to region owners, then an allgather.

Phase 1 (started with the tensor's reduction): this rank's k selected entries are bucketed by owner
(core.exchange.region_of) into P fixed blocks of ``capacity`` entries and sent with one ``alltoall`` (equal
splits, so the response cache and the fast equal-size paths apply). Entries beyond a block's capacity go straight
back into this rank's residual.

Phase 2 (started as soon as phase 1 is seen complete: polled whenever another sparse allreduce of the same
compressor starts, and at the latest in ``synchronize()``): the owner sums what it received in float32 (float64 for
float64 gradients), keeps the ceil(k/P) largest sums of its region (non-finite sums first, so a NaN reaches the
update as it would with a dense allreduce), keeps the rounding of each kept sum to the wire dtype in its own
residual, and allgathers the kept (index, value) pairs. Every rank builds the same dense update from them.

Several tensors (a bucket, core.buckets) travel in one sparse allreduce: each destination's block is the
concatenation of every member's block for it (each member keeps its own k, capacity and kept count, so the result
is the per-tensor one bit for bit), and the owners' kept sums of every member go out in one allgather: two
collectives per bucket instead of two per tensor. The arithmetic of the three phases is torch.sparse_rounds (shared
with the DDP hook); this module issues Horovod's collectives and chains them.

Error feedback stays exact: after phase 2 each rank returns to its residual its own sent entries at indices no
owner kept. So over all ranks, new residuals + (sum of applied entries) == old residuals + gradients, up to float
rounding (tests/parallel_torch/test_torch_sparse_allreduce.py, tests/launched/test_sparse_allreduce_4.py).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from ..core.naming import alltoall_name, owners_allgather_name
from .exchange import ExchangeRequest
from .sparse_rounds import SparseRounds, regions

__all__ = ["SparseAllreduce", "SparseAllreduceFlight", "SparseAllreduceHandle", "SparseRounds", "regions"]


class SparseAllreduceFlight:
    """One sparse allreduce in flight: one tensor's, or a bucket's (the members side by side in both phases)."""

    def __init__(self, requests: Sequence[ExchangeRequest], name: str, exchange: "SparseAllreduce") -> None:
        from horovod.torch.mpi_ops import alltoall_async

        self.name = name
        self._exchange = exchange
        self.rounds = SparseRounds(requests)
        self.requests = self.rounds.requests
        self.world_size = self.rounds.world_size
        buf = self.rounds.send
        splits = torch.full((self.world_size,), buf.shape[1], dtype=torch.int32)
        self._phase1: Optional[Any] = alltoall_async(buf.view(-1), splits=splits, name=alltoall_name(name),
                                                     process_set=self.requests[0].process_set)
        self._phase2: Optional[Any] = None
        self._gathered: Optional[torch.Tensor] = None
        self._results: List[Optional[torch.Tensor]] = [None] * len(self.requests)

    @property
    def waiting_for_phase1(self) -> bool:
        return self._phase1 is not None

    def poll(self) -> None:
        """Start phase 2 now if phase 1 has completed (never blocks)."""
        from horovod.torch.mpi_ops import poll

        if self._phase1 is not None and poll(self._phase1):
            self._exchange.phase2_started_early += 1
            self.start_phase2()

    def start_phase2(self) -> None:
        from horovod.torch.mpi_ops import allgather_async, synchronize

        received = synchronize(self._phase1)
        self._phase1 = None
        received = received[0] if isinstance(received, (tuple, list)) else received
        self._phase2 = allgather_async(self.rounds.owned(received), name=owners_allgather_name(self.name),
                                       process_set=self.requests[0].process_set)

    def result(self, member: int) -> torch.Tensor:
        """The reduced gradient of member ``member`` (waits for both phases the first time)."""
        if self._results[member] is not None:
            return self._results[member]
        from horovod.torch.mpi_ops import synchronize

        # Every phase 2 of this compressor starts before this rank blocks on any of them: ranks may wait for their
        # tensors in different orders (Horovod matches collectives by name), and a rank waiting on phase 2 of A
        # while another waits on phase 2 of B, each before starting the other's, would hang.
        self._exchange.start_all_phase2()
        if self._phase1 is not None:  # a flight its exchange abandoned (a loaded state) still finishes when called
            self.start_phase2()
        if self._gathered is None:
            self._gathered = self.rounds.gathered_rows(synchronize(self._phase2))
        self._results[member] = self.rounds.apply(member, self._gathered)
        return self._results[member]


class SparseAllreduceHandle:
    """One tensor's part of a sparse allreduce in flight; calling it waits and returns its reduced gradient."""

    def __init__(self, flight: SparseAllreduceFlight, member: int) -> None:
        self.flight = flight
        self.member = member

    @property
    def request(self) -> ExchangeRequest:
        return self.flight.requests[self.member]

    def __call__(self) -> torch.Tensor:
        return self.flight.result(self.member)


class SparseAllreduce:
    """The sparse allreduce exchange of one compressor; keeps its flights to start phase 2 early."""

    def __init__(self) -> None:
        self._in_flight: List[SparseAllreduceFlight] = []
        #: How many phase 2s started before synchronize() (phase 1 seen complete when a later tensor started)
        #: and how many only in synchronize(): how much of the chaining the polling hides.
        self.phase2_started_early = 0
        self.phase2_started_in_synchronize = 0

    def abandon_in_flight(self) -> None:
        """Forget the flights of a step that will never be synchronized (TopKEF._after_load): polling them later
        would ask Horovod about handles it no longer has."""
        self._in_flight = []

    def start_all_phase2(self) -> None:
        """Start phase 2 of every flight still waiting for phase 1 (blocking on their phase 1: by the time
        synchronize() waits, Horovod's optimizer has started every tensor's phase 1 on every rank)."""
        waiting, self._in_flight = self._in_flight, []
        for flight in waiting:
            if flight.waiting_for_phase1:
                self.phase2_started_in_synchronize += 1
                flight.start_phase2()

    def start_flight(self, requests: Sequence[ExchangeRequest], name: str) -> SparseAllreduceFlight:
        """Phase 1 of ``requests`` (one tensor, or a bucket's members in its order) under collective ``name``."""
        self._in_flight = [f for f in self._in_flight if f.waiting_for_phase1]
        for earlier in self._in_flight:  # phase 2 of earlier flights need not wait for synchronize()
            earlier.poll()
        flight = SparseAllreduceFlight(requests, name, self)
        self._in_flight.append(flight)
        return flight

    def start(self, request: ExchangeRequest) -> SparseAllreduceHandle:
        """One tensor's sparse allreduce, its collectives named from the tensor."""
        return SparseAllreduceHandle(self.start_flight([request], request.name), 0)
