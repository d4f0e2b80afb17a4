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
collectives per bucket instead of two per tensor.

Error feedback stays exact: after phase 2 each rank returns to its residual its own sent entries at indices no
owner kept. So over all ranks, new residuals + (sum of applied entries) == old residuals + gradients, up to float
rounding (tests/parallel_torch/test_torch_sparse_allreduce.py, tests/launched/test_sparse_allreduce_4.py).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..core import PayloadSizeMismatch
from ..core.exchange import HASH_MULTIPLIER, SparseAllreduceLayouts
from ..core.naming import alltoall_name, owners_allgather_name
from . import ops
from .exchange import ExchangeRequest

__all__ = ["SparseAllreduce", "SparseAllreduceFlight", "SparseAllreduceHandle", "SparseRounds", "regions"]


def regions(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """core.exchange.region_of on a tensor of indices (int64 result)."""
    return (((indices.long() * HASH_MULTIPLIER) & 0xFFFFFFFF) * world_size) >> 32


def _entries(rows: torch.Tensor, count: int, values_offset: int, wire_dtype: torch.dtype):
    """Views (no copies: writes land in ``rows``) of the indices and values, each (rows, count), of a (rows,
    nbytes) buffer of PayloadLayouts of ``count`` entries."""
    indices = rows[:, : count * 4].view(torch.int32)
    values = rows[:, values_offset : values_offset + count * torch.empty(0, dtype=wire_dtype).element_size()]
    return indices, values.view(wire_dtype)


def _empty_blocks(blocks: int, count: int, layout: Any, wire_dtype: torch.dtype, device: torch.device):
    """``blocks`` zeroed payloads of ``count`` entries whose indices are all -1 (unused slots)."""
    buf = torch.zeros(blocks, layout.nbytes, dtype=torch.uint8, device=device)
    indices, values = _entries(buf, count, layout.values_offset, wire_dtype)
    indices.fill_(-1)
    return buf, indices, values


def _return_to_residual(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """residual[indices] += values, skipping non-finite values (those never enter a residual, see ops)."""
    values = values.to(residual.dtype)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        indices, values = indices[finite], values[finite]
    residual.index_add_(0, indices.long(), values)


def _blocks(request: ExchangeRequest, layouts: SparseAllreduceLayouts) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1 of one member: its k selected entries sorted into P blocks of ``capacity`` by owner; entries over
    a block's capacity go back to its residual at once. Returns (blocks (P, send.nbytes) uint8, the indices and
    values sent)."""
    world_size, send = request.world_size, layouts.send
    indices, values = ops.unpack(request.payload, 1, request.layout, request.wire_dtype)
    indices, values = indices.reshape(-1).long(), values.reshape(-1)
    owner = regions(indices, world_size)
    order = torch.argsort(owner, stable=True)
    owner_sorted = owner[order]
    counts = torch.bincount(owner, minlength=world_size)
    slot = torch.arange(indices.numel(), device=indices.device) - (torch.cumsum(counts, 0) - counts)[owner_sorted]
    fits = slot < send.k
    chosen = order
    if not bool(fits.all()):  # over a destination's capacity: stays in this rank's residual for later steps
        over = order[~fits]
        _return_to_residual(request.residual, indices[over], values[over])
        chosen, owner_sorted, slot = order[fits], owner_sorted[fits], slot[fits]
    buf, _, _ = _empty_blocks(world_size, send.k, send, request.wire_dtype, values.device)
    sent_indices, sent_values = indices[chosen], values[chosen]
    # Written through flat views of the whole buffer (the layout keeps every field aligned to its item size): one
    # index_put over one dimension each, much cheaper than two-dimensional indexing of the strided blocks.
    itemsize = sent_values.element_size()
    row = owner_sorted * send.nbytes
    flat = buf.view(-1)
    flat.view(torch.int32)[row // 4 + slot] = sent_indices.to(torch.int32)
    flat.view(request.wire_dtype)[(row + send.values_offset) // itemsize + slot] = sent_values
    return buf, sent_indices, sent_values


def _owned_sums(request: ExchangeRequest, layouts: SparseAllreduceLayouts, received: torch.Tensor) -> torch.Tensor:
    """Phase 2 of one member on its owner: sum what the P ranks sent it (``received``, (P, send.nbytes)), keep the
    ceil(k/P) largest sums (non-finite first), keep their rounding to the wire dtype in the residual. Returns the
    kept payload (1, kept.nbytes) uint8."""
    send, kept = layouts.send, layouts.kept
    indices, values = _entries(received, send.k, send.values_offset, request.wire_dtype)
    indices, values = indices.reshape(-1), values.reshape(-1)
    used = indices >= 0
    acc_dtype = request.residual.dtype
    indices, values = indices[used].long(), values[used].to(acc_dtype)
    unique, inverse = torch.unique(indices, return_inverse=True)
    sums = torch.zeros(unique.numel(), dtype=acc_dtype, device=values.device).index_add_(0, inverse, values)
    priority = torch.where(torch.isfinite(sums), sums.abs(), torch.full_like(sums, float("inf")))
    top = torch.topk(priority, min(kept.k, unique.numel()), sorted=False).indices
    kept_indices, kept_sums = unique[top], sums[top]
    kept_values = kept_sums.to(request.wire_dtype)
    # The owner re-sends its sums rounded to the wire dtype: the rounding stays here, in its residual.
    _return_to_residual(request.residual, kept_indices, kept_sums - kept_values.to(acc_dtype))
    buf, out_indices, out_values = _empty_blocks(1, kept.k, kept, request.wire_dtype, values.device)
    out_indices[0, : top.numel()] = kept_indices.to(torch.int32)
    out_values[0, : top.numel()] = kept_values
    return buf


def _apply(request: ExchangeRequest, layouts: SparseAllreduceLayouts, gathered: torch.Tensor,
           sent_indices: torch.Tensor, sent_values: torch.Tensor) -> torch.Tensor:
    """The end of one member: every owner's kept sums (``gathered``, (P, kept.nbytes)) become the reduced gradient
    over ``request.out``; this rank's sent entries that no owner kept go back to its residual."""
    kept = layouts.kept
    indices, values = _entries(gathered, kept.k, kept.values_offset, request.wire_dtype)
    indices, values = indices.reshape(-1), values.reshape(-1)
    used = indices >= 0
    applied = indices[used].long()
    # Which sent entries were kept: a mark per entry (N bytes), much cheaper than torch.isin's sort of both sets
    kept_mark = torch.zeros(request.out.numel(), dtype=torch.bool, device=applied.device)
    kept_mark[applied] = True
    dropped = ~kept_mark[sent_indices]
    _return_to_residual(request.residual, sent_indices[dropped], sent_values[dropped])
    sums = values[used].to(request.residual.dtype) * request.scale
    out = request.out
    if out.dtype == request.residual.dtype:  # in place: no N-sized temporary, one pass less
        out.zero_().index_add_(0, applied, sums)
    else:  # half precision: sum in float32, then round once
        out.copy_(ops.scatter_sum(applied, sums, out.numel(), request.residual.dtype))
    return out.view(request.shape)


def _columns(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Members' (rows, nbytes_i) buffers side by side: (rows, sum of nbytes_i), row r holding every member's row r
    (a destination's block, or one owner's payload)."""
    return buffers[0] if len(buffers) == 1 else torch.cat(list(buffers), dim=1)


class SparseRounds:
    """The arithmetic of one sparse allreduce over ``requests`` (one tensor, or a bucket's members side by side),
    with no collective in it: the Horovod flight below and the DDP hook (torch.ddp) each issue the two collectives
    their own way and hand what arrived back here.

    1. :attr:`send` -- this rank's blocks, one row per destination (alltoall them, equal splits);
    2. :meth:`owned` -- from the (P, width) rows received, this rank's kept sums of every member (allgather them);
    3. :meth:`apply` -- from every owner's kept sums, member ``i``'s reduced gradient written over its output.
    """

    def __init__(self, requests: Sequence[ExchangeRequest]) -> None:
        self.requests = list(requests)
        self.world_size = self.requests[0].world_size
        self.layouts = [SparseAllreduceLayouts(r.layout.k, r.world_size, r.layout.value_itemsize, r.out.numel())
                        for r in self.requests]
        self.send_offsets = _offsets([l.send.nbytes for l in self.layouts])
        self.kept_offsets = _offsets([l.kept.nbytes for l in self.layouts])
        blocks, self._sent = [], []
        for request, layouts in zip(self.requests, self.layouts):
            buf, sent_indices, sent_values = _blocks(request, layouts)
            blocks.append(buf)
            self._sent.append((sent_indices, sent_values))
            request.record.bytes_sent += layouts.alltoall_nbytes + layouts.kept.nbytes
        #: (P, width) uint8: row r goes to rank r.
        self.send = _columns(blocks).contiguous()

    def mismatch(self, what: str, received: int, expected: int) -> PayloadSizeMismatch:
        names = ", ".join(r.name for r in self.requests)
        return PayloadSizeMismatch(
            f"horovod-topk: ranks disagree about {names!r}: the sparse allreduce's {what} received {received} "
            f"bytes, this rank expects {expected} (k={', '.join(str(r.layout.k) for r in self.requests)}). Check "
            f"that every rank uses the same TopKEF configuration and the same model."
        )

    def owned(self, received: torch.Tensor) -> torch.Tensor:
        """This rank's kept sums of every member, one row (flat uint8), from the alltoall's ``received`` bytes."""
        width = self.send_offsets[-1]
        if received.numel() != self.world_size * width:
            raise self.mismatch("alltoall", received.numel(), self.world_size * width)
        rows = received.view(self.world_size, width)
        kept = [_owned_sums(request, layouts, rows[:, start:end])
                for request, layouts, start, end in zip(self.requests, self.layouts, self.send_offsets,
                                                        self.send_offsets[1:])]
        return _columns(kept).reshape(-1)

    def gathered_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """The allgather of every owner's :meth:`owned` row as (P, width), checked."""
        width = self.kept_offsets[-1]
        if gathered.numel() != self.world_size * width:
            if len(self.requests) == 1:
                kept = self.layouts[0].kept
                raise PayloadSizeMismatch(kept.mismatch_message(self.requests[0].name, self.world_size,
                                                                gathered.numel()))
            raise self.mismatch("allgather", gathered.numel(), self.world_size * width)
        return gathered.view(self.world_size, width)

    def apply(self, member: int, rows: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s reduced gradient from :meth:`gathered_rows`; its unkept entries back to its residual."""
        start, end = self.kept_offsets[member], self.kept_offsets[member + 1]
        sent_indices, sent_values = self._sent[member]
        return _apply(self.requests[member], self.layouts[member], rows[:, start:end], sent_indices, sent_values)


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


def _offsets(sizes: Sequence[int]) -> List[int]:
    """[0, s0, s0 + s1, ...]: where each member starts in a row, and the row's width last."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


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
