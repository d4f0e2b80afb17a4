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

Error feedback stays exact: after phase 2 each rank returns to its residual its own sent entries at indices no
owner kept. So over all ranks, new residuals + (sum of applied entries) == old residuals + gradients, up to float
rounding (tests/parallel_torch/test_torch_sparse_allreduce.py, tests/launched/test_sparse_allreduce_4.py).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ..core import PayloadSizeMismatch
from ..core.exchange import HASH_MULTIPLIER, SparseAllreduceLayouts
from ..core.naming import alltoall_name, owners_allgather_name
from . import ops
from .exchange import ExchangeRequest

__all__ = ["SparseAllreduce", "SparseAllreduceHandle", "regions"]


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


class SparseAllreduceHandle:
    """One tensor's sparse allreduce in flight; calling it waits and returns the dense reduced gradient."""

    def __init__(self, request: ExchangeRequest, layouts: SparseAllreduceLayouts, phase1: Any,
                 sent_indices: torch.Tensor, sent_values: torch.Tensor, exchange: "SparseAllreduce") -> None:
        self.request = request
        self._exchange = exchange
        self.layouts = layouts
        self._phase1: Optional[Any] = phase1
        self._phase2: Optional[Any] = None
        self._sent_indices = sent_indices
        self._sent_values = sent_values
        self._result: Optional[torch.Tensor] = None

    @property
    def waiting_for_phase1(self) -> bool:
        return self._phase1 is not None

    def poll(self) -> None:
        """Start phase 2 now if phase 1 has completed (never blocks)."""
        from horovod.torch.mpi_ops import poll

        if self._phase1 is not None and poll(self._phase1):
            self._exchange.phase2_started_early += 1
            self._start_phase2()

    def _start_phase2(self) -> None:
        from horovod.torch.mpi_ops import allgather_async, synchronize

        req, send, kept = self.request, self.layouts.send, self.layouts.kept
        received = synchronize(self._phase1)
        self._phase1 = None
        received = received[0] if isinstance(received, (tuple, list)) else received
        expected = req.world_size * send.nbytes
        if received.numel() != expected:
            raise PayloadSizeMismatch(
                f"horovod-topk: ranks disagree about tensor {req.name!r}: the sparse allreduce received "
                f"{received.numel()} bytes, this rank expects {expected} (k={req.layout.k}). Check that every rank "
                f"uses the same TopKEF configuration and the same model."
            )
        indices, values = _entries(received.view(req.world_size, send.nbytes), send.k, send.values_offset,
                                   req.wire_dtype)
        indices, values = indices.reshape(-1), values.reshape(-1)
        used = indices >= 0
        acc_dtype = req.residual.dtype
        indices, values = indices[used].long(), values[used].to(acc_dtype)
        unique, inverse = torch.unique(indices, return_inverse=True)
        sums = torch.zeros(unique.numel(), dtype=acc_dtype, device=values.device).index_add_(0, inverse, values)
        priority = torch.where(torch.isfinite(sums), sums.abs(), torch.full_like(sums, float("inf")))
        top = torch.topk(priority, min(kept.k, unique.numel()), sorted=False).indices
        kept_indices, kept_sums = unique[top], sums[top]
        kept_values = kept_sums.to(req.wire_dtype)
        # The owner re-sends its sums rounded to the wire dtype: the rounding stays here, in its residual.
        _return_to_residual(req.residual, kept_indices, kept_sums - kept_values.to(acc_dtype))
        buf, out_indices, out_values = _empty_blocks(1, kept.k, kept, req.wire_dtype, values.device)
        out_indices[0, : top.numel()] = kept_indices.to(torch.int32)
        out_values[0, : top.numel()] = kept_values
        self._phase2 = allgather_async(buf.view(-1), name=owners_allgather_name(req.name),
                                       process_set=req.process_set)

    def __call__(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        from horovod.torch.mpi_ops import synchronize

        # Every phase 2 of this compressor starts before this rank blocks on any of them: ranks may wait for their
        # tensors in different orders (Horovod matches collectives by name), and a rank waiting on phase 2 of A
        # while another waits on phase 2 of B, each before starting the other's, would hang.
        self._exchange.start_all_phase2()
        if self._phase1 is not None:  # a handle its exchange abandoned (a loaded state) still finishes when called
            self._start_phase2()
        req, kept = self.request, self.layouts.kept
        gathered = synchronize(self._phase2)
        if gathered.numel() != req.world_size * kept.nbytes:
            raise PayloadSizeMismatch(kept.mismatch_message(req.name, req.world_size, gathered.numel()))
        indices, values = _entries(gathered.view(req.world_size, kept.nbytes), kept.k, kept.values_offset,
                                   req.wire_dtype)
        indices, values = indices.reshape(-1), values.reshape(-1)
        used = indices >= 0
        applied = indices[used].long()
        # This rank's sent entries that no owner kept go back to its residual: nothing is lost.
        dropped = ~torch.isin(self._sent_indices, applied)
        _return_to_residual(req.residual, self._sent_indices[dropped], self._sent_values[dropped])
        dense = ops.scatter_sum(applied, values[used].to(req.residual.dtype) * req.scale, req.out.numel(),
                                req.residual.dtype)
        req.out.copy_(dense)
        self._result = req.out.view(req.shape)
        return self._result


class SparseAllreduce:
    """The sparse allreduce exchange of one compressor; keeps its handles in flight to start phase 2 early."""

    def __init__(self) -> None:
        self._in_flight: List[SparseAllreduceHandle] = []
        #: How many phase 2s started before synchronize() (phase 1 seen complete when a later tensor started)
        #: and how many only in synchronize(): how much of the chaining the polling hides.
        self.phase2_started_early = 0
        self.phase2_started_in_synchronize = 0

    def abandon_in_flight(self) -> None:
        """Forget the handles of a step that will never be synchronized (TopKEF._after_load): polling them later
        would ask Horovod about handles it no longer has."""
        self._in_flight = []

    def start_all_phase2(self) -> None:
        """Start phase 2 of every handle still waiting for phase 1 (blocking on their phase 1: by the time
        synchronize() waits, Horovod's optimizer has started every tensor's phase 1 on every rank)."""
        waiting, self._in_flight = self._in_flight, []
        for handle in waiting:
            if handle.waiting_for_phase1:
                self.phase2_started_in_synchronize += 1
                handle._start_phase2()

    def start(self, request: ExchangeRequest) -> SparseAllreduceHandle:
        from horovod.torch.mpi_ops import alltoall_async

        self._in_flight = [h for h in self._in_flight if h.waiting_for_phase1]
        for earlier in self._in_flight:  # phase 2 of earlier tensors need not wait for synchronize()
            earlier.poll()
        world_size, layout = request.world_size, request.layout
        layouts = SparseAllreduceLayouts(layout.k, world_size, layout.value_itemsize, request.out.numel())
        send = layouts.send
        indices, values = ops.unpack(request.payload, 1, layout, request.wire_dtype)
        indices, values = indices.reshape(-1).long(), values.reshape(-1)
        owner = regions(indices, world_size)
        order = torch.argsort(owner, stable=True)
        owner_sorted = owner[order]
        counts = torch.bincount(owner, minlength=world_size)
        slot = torch.arange(indices.numel(), device=indices.device) - (torch.cumsum(counts, 0) - counts)[owner_sorted]
        fits = slot < send.k
        if not bool(fits.all()):  # over a destination's capacity: stays in this rank's residual for later steps
            over = order[~fits]
            _return_to_residual(request.residual, indices[over], values[over])
        chosen = order[fits]
        buf, block_indices, block_values = _empty_blocks(world_size, send.k, send, request.wire_dtype,
                                                         values.device)
        block_indices[owner_sorted[fits], slot[fits]] = indices[chosen].to(torch.int32)
        block_values[owner_sorted[fits], slot[fits]] = values[chosen]
        splits = torch.full((world_size,), send.nbytes, dtype=torch.int32)
        phase1 = alltoall_async(buf.view(-1), splits=splits, name=alltoall_name(request.name),
                                process_set=request.process_set)
        request.record.bytes_sent += layouts.alltoall_nbytes + layouts.kept.nbytes
        handle = SparseAllreduceHandle(request, layouts, phase1, indices[chosen], values[chosen].clone(), self)
        self._in_flight.append(handle)
        return handle
