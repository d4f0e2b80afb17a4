"""``TopKEF`` for ``horovod.torch``: Top-K sparsification with error feedback behind Horovod's compressor API.

Horovod calls ``compress(tensor)`` without the tensor's name, and then hands the result to a dense allreduce. So
``compress`` only *marks* the tensor (a storage-sharing alias carrying a :class:`PendingReduction`); the routing
installed by :mod:`horovod_topk.torch.routing` sees the mark where Horovod launches the collective, knows the
name there, and calls :meth:`TopKEF.start_reduction`, which does the error-feedback selection and one allgather of
the packed payload. Outside ``hvd.DistributedOptimizer`` (e.g. ``hvd.allreduce(t, compression=TopKEF)``) nothing
routes the mark and the tensor is simply reduced dense.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from ..core import (
    PayloadLayout,
    PendingReduction,
    RankMismatch,
    TensorPlan,
    TopKEFBase,
    allgather_name,
    check_name,
    fingerprint,
    mismatch_message,
    plan_tensor,
    reduction_scale,
)
from ..core.buckets import BucketTable, held_bucket_bytes
from ..core.exchange import ALLGATHER, DENSE_HALF, DENSE_INT8
from ..core.naming import half_allreduce_name, int8_allreduce_name
from ..core.update_mode import update_tensor_name
from . import auto_density
from .buckets import BucketedExchange, HeldArrival, UnselectedMember, bucket_member_names
from .exchange import ExchangeRequest
from .gradient_route import GRADIENT_ROUTE, LOCAL_ROUTE
from .half_route import HalfHandle
from .held_routes import HeldMember
from .int8_route import Int8Handle
from .selection import Backend, decompress_tensor, dtype_token as _dtype_token
from .sparse_allreduce import SparseAllreduce
from .state import TorchResiduals
from .update_mode import LocalHandle

__all__ = ["TopKEF", "TopKHandle", "AgreementCheck", "start_allgather", "allgather_handle"]

#: The backends whose bucket members are selected together when their bucket is complete (torch.bucket_select).
_GROUPED = ("triton", "fused")


class AgreementCheck:
    """The fingerprint allgather of one tensor's first step (core.consistency); calling it waits and raises
    RankMismatch, on every rank alike, unless all ranks agree."""

    def __init__(self, name: str, handle: Any, wait: Callable[[Any], torch.Tensor]) -> None:
        self.name = name
        self._handle = handle
        self._wait = wait
        self._message: Optional[str] = None
        self._done = False

    def __call__(self) -> None:
        if not self._done:
            self._message = mismatch_message(self.name, self._wait(self._handle).tolist())
            self._done = True
        if self._message is not None:
            raise RankMismatch(self._message)


class TopKHandle:
    """Handle of one in-flight compressed reduction; calling it waits and returns the dense reduced gradient.

    Horovod's optimizer accepts a callable handle in ``synchronize()``. The result is written over ``out`` (the
    gradient's own buffer, which compression only read: until this call it holds this rank's gradient, as with
    Horovod's dense allreduce): no N-sized allocation per step.
    """

    def __init__(
        self,
        name: str,
        allgather_handle: Any,
        wait: Callable[[Any], torch.Tensor],
        layout: PayloadLayout,
        world_size: int,
        value_dtype: torch.dtype,
        out: torch.Tensor,
        shape: Tuple[int, ...],
        scale: float,
        backend: Backend,
    ) -> None:
        self.name = name
        self._allgather_handle = allgather_handle
        self._wait = wait
        self._layout = layout
        self._world_size = world_size
        self._value_dtype = value_dtype
        self._out = out
        self._shape = shape
        self._scale = scale
        self._backend = backend
        self._result: Optional[torch.Tensor] = None

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            gathered = self._wait(self._allgather_handle)
            self._layout.check_gathered(self.name, gathered.numel(), self._world_size)
            decompress_tensor(self._backend, gathered, self._world_size, self._layout, self._value_dtype, self._scale,
                              self._out.view(-1))
            self._result = self._out.view(self._shape)
        return self._result


def allgather_handle(request: ExchangeRequest, handle: Any, wait: Callable[[Any], torch.Tensor]) -> TopKHandle:
    """The handle of ``request``'s payload carried by an allgather (its own, or its bucket's: ``wait(handle)``
    returns this tensor's P payloads); counts the payload in the tensor's bytes sent."""
    request.record.bytes_sent += request.layout.nbytes
    return TopKHandle(
        request.name, handle, wait, request.layout, request.world_size, request.wire_dtype, request.out,
        request.shape, request.scale, request.backend,
    )


def start_allgather(request: ExchangeRequest) -> TopKHandle:
    """The allgather exchange (core.exchange): every rank receives every rank's payload, one collective."""
    from horovod.torch.mpi_ops import allgather_async, synchronize

    handle = allgather_async(request.payload, name=allgather_name(request.name), process_set=request.process_set)
    return allgather_handle(request, handle, synchronize)


class TopKEF(TorchResiduals, TopKEFBase[torch.Tensor]):
    """Top-K with error feedback for ``hvd.DistributedOptimizer(..., compression=TopKEF)``.

    Each step, per compressed gradient: add this rank's residual, send the k largest-magnitude entries as one packed
    (int32 index, value) payload with one allgather named ``topk.<parameter name>``, keep the rest as the new
    residual, and build the dense average from all ranks' payloads. Pass the class for the defaults (ratio 0.01)
    or an object for other options; see :class:`horovod_topk.core.TopKConfig`.

    The class or one object may be given to several optimizers: each gets its own error-feedback state in it
    (residuals are keyed by parameter name, prefixed per optimizer where names overlap; see core.scopes).
    ``TopKEF(log_every=N, summary_writer=w)`` reports every N steps (core.telemetry).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Which bucket each gradient travels in (core.buckets), filled when an optimizer is wrapped, and the
        #: exchange that holds a bucket's payloads until its last member arrives (torch.buckets).
        self.bucket_table = BucketTable()
        self._bucketed = BucketedExchange(self.bucket_table, self._sparse, self)
        #: The same for ratio="auto"'s fp16 and int8 routes, by route, in buckets of their own, smaller
        #: (core.buckets.held_bucket_bytes): their payloads are a dense gradient's, and a bucket leaves only when
        #: its last member is ready.
        self._held = {route: BucketedExchange(BucketTable(), self._sparse, self) for route in (DENSE_HALF, DENSE_INT8)}
        #: The update steps (torch.update_mode.UpdateStep) of the optimizers that run update mode (TopKConfig.target
        #: resolved for each by core.update_mode.resolve_target when it was wrapped), by scope (core.scopes): their
        #: gradients stay on their rank, except on the gradient route (core.update_mode).
        self.update_scopes: Dict[str, Any] = {}
        #: Names of gradients held in update mode whose first-step agreement check has started (again after a load,
        #: as for every record; the update's own record is keyed by parameter name, not by these names).
        self._held_verified: Set[str] = set()

    def _alias(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()  # shares storage with the gradient: a dense in-place allreduce still lands there

    # ---- called by the routing -----------------------------------------------------------------------------
    def start_reduction(
        self,
        tensor: torch.Tensor,
        pending: PendingReduction,
        name: str,
        *,
        op: Any,
        prescale_factor: float,
        postscale_factor: float,
        process_set: Any,
    ) -> Optional[Union[TopKHandle, LocalHandle]]:
        """Start the compressed reduction of the gradient ``tensor`` called ``name``; None if it must go dense.

        The caller issues the dense allreduce itself for a None, so that dense tensors of a group stay one
        grouped collective. For an optimizer in update mode the gradient stays on this rank (torch.update_mode
        exchanges the update after the local step), except while ratio="auto" holds dense or fp16: then the step
        runs as gradient mode (core.update_mode, "The gradient route"), the gradient exchanged in its update's
        record (one residual and step count per parameter whichever the route).
        """
        update_step = self.update_scopes.get(pending.scope)
        if update_step is None:
            return self.start_exchange(tensor, pending, name, op=op, prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor, process_set=process_set)
        if not update_step.gradient_route_allowed or not self._update_runs_as_gradient(name, tensor, process_set):
            update_step.take_route(LOCAL_ROUTE)
            pending.route = "local"
            pending.check = self._held_check(tensor, name, process_set)
            return LocalHandle(tensor)
        update_step.take_route(GRADIENT_ROUTE)  # the step's first gradient takes the update residuals out
        held_check = self._held_check(tensor, name, process_set)
        handle = self.start_exchange(tensor, pending, update_tensor_name(name), op=op,
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                     process_set=process_set)
        pending.check = _both_checks(held_check, pending.check)
        return handle

    def _update_runs_as_gradient(self, name: str, tensor: torch.Tensor, process_set: Any) -> bool:
        """Whether this step of an update-mode optimizer runs as gradient mode: ratio="auto" holds dense or fp16.
        Asked at each gradient; the step's first one takes the step's decision when one is due (every rank reaches
        the same step's first gradient, and nothing of the step is in flight yet), so the route holds for the step."""
        if self.auto is None:
            return False
        record = self.registry.record(update_tensor_name(name), tuple(tensor.shape))
        self._auto_begin(record.steps, tensor, process_set)
        return self.auto.holds_dense

    def _held_check(self, tensor: torch.Tensor, name: str, process_set: Any) -> Optional["AgreementCheck"]:
        """On an update-mode gradient's first step, the ranks' agreement check under the name gradient mode gives
        it, so that a rank in the other mode meets it and both raise instead of hanging; None after."""
        if name in self._held_verified:  # no registry record: the update's own is keyed by parameter name
            return None
        self._held_verified.add(name)
        update = torch.empty((), dtype=torch.float32).expand(tensor.shape)  # what will travel: a float32 update
        record = self.registry.records.get(update_tensor_name(name))
        step = record.steps if record is not None else 0
        plan = self._plan(name, update, step, process_set.size())
        return self._agreement_check(name, update, step, plan.k, process_set, plan.exchange)

    def _plan(self, name: str, tensor: torch.Tensor, step: int, world_size: int) -> TensorPlan:
        """core's plan for ``tensor`` at ``step``: dense or Top-K, k, and the exchange (with ratio="auto", under
        the density in force)."""
        config = self.config
        if self.auto is not None:
            held = self.auto.held_plan(tensor.numel(), tensor.is_floating_point(), tensor.element_size())
            if held is not None:  # dense, or fp16, for every tensor
                return held
            config = self.auto.effective_config()
        return plan_tensor(
            name, tensor.numel(), tensor.is_floating_point(), config, world_size=world_size,
            step=step, value_itemsize=_dtype_token(self._wire_dtype(tensor)).element_size(),
            grad_itemsize=tensor.element_size(), sparse_available=True,
        )

    def start_exchange(
        self,
        tensor: torch.Tensor,
        pending: PendingReduction,
        name: str,
        *,
        op: Any,
        prescale_factor: float,
        postscale_factor: float,
        process_set: Any,
    ) -> Optional[Union[TopKHandle, HalfHandle]]:
        """Error feedback, selection and the exchange of ``tensor`` (a gradient, or in update mode an update) called
        ``name``; None if it must go dense (the caller then allreduces it: the residual's leftovers are in it)."""
        from horovod.torch.mpi_ops import Average, Sum, allreduce_async_, synchronize

        op_name = "average" if op == Average else "sum" if op == Sum else repr(op)
        world_size = process_set.size()
        scale = reduction_scale(op_name, prescale_factor, postscale_factor, world_size)
        record = self.registry.record(name, tuple(tensor.shape))
        if self.auto is not None:
            self._auto_begin(record.steps, tensor, process_set)
        plan = self._plan(name, tensor, record.steps, world_size)
        dense_nbytes = tensor.numel() * tensor.element_size()
        self._guard_spike(record, tensor)
        if not record.verified:
            record.verified = True
            pending.check = self._agreement_check(name, tensor, record.steps, plan.k, process_set, plan.exchange)
        if self.telemetry.due(record.steps):  # the rank only then: Horovod's process_set.rank() is not free
            self._report_if_due(record.steps, process_set.rank())
        record.steps += 1
        record.bytes_dense += dense_nbytes
        if plan.exchange in (DENSE_HALF, DENSE_INT8):  # ratio="auto"'s fp16 or int8
            if self._bucketed.covers(name):  # it travels on its own; its bucket-mates need not wait for it
                self._bucketed.arrive(name, None, plan.exchange, allgather_handle)
            flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
            held_buckets = self._held[plan.exchange]
            if held_buckets.covers(name):  # with its bucket's others of its route: one allreduce (torch.held_routes)
                int8 = plan.exchange == DENSE_INT8
                pending.route = "int8" if int8 and record.int8_reference > 0.0 else "fp16"
                held = HeldArrival(HeldMember(name, record, flat), int8, tuple(tensor.shape), scale, world_size,
                                   op_name, process_set)
                return held_buckets.arrive(name, None, plan.exchange, allgather_handle, held=held)
            # the grid's reference comes from int8 steps (and the fp16 step of one without a grid yet), not from
            # fp16 steps while fp16 is held: that would cost every such step a pass for a grid it may never use
            keep = self._keep_int8_reference(record) if plan.exchange == DENSE_INT8 else None
            if plan.exchange == DENSE_INT8 and record.int8_reference > 0.0:  # torch.int8_route
                pending.route = "int8"
                words, delta = self._send_int8(name, record, flat, scale, world_size, op_name)
                handle = allreduce_async_(words, name=int8_allreduce_name(name), op=Sum, process_set=process_set)
                assert keep is not None
                return Int8Handle(handle, synchronize, flat, tuple(tensor.shape), world_size, delta, keep)
            # fp16 (torch.half_route); on the int8 route also its first step, whose result gives the grid
            pending.route = "fp16"
            half = self._send_half(name, record, flat, scale, world_size, op_name)
            handle = allreduce_async_(half, name=half_allreduce_name(name), op=Sum, process_set=process_set)
            return HalfHandle(handle, synchronize, flat, tuple(tensor.shape), keep)
        if not plan.compressed:
            pending.route = "dense"
            record.bytes_sent += dense_nbytes
            self._send_leftovers(record, tensor)
            if self._bucketed.covers(name):  # it travels on its own; its bucket-mates need not wait for it
                self._bucketed.arrive(name, None, plan.exchange, allgather_handle)
            return None

        pending.route = "topk"
        assert plan.k is not None
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        record.exchange = plan.exchange
        if plan.exchange == ALLGATHER and self._bucketed.covers(name) and self._backend(tensor).name in _GROUPED:
            # selected with its bucket-mates at once: on a GPU by the grouped kernels, on the CPU by one call of the
            # fused kernel (torch.buckets, torch.bucket_select)
            member = UnselectedMember(name, record, tensor, flat, plan.k, world_size, op_name, scale, process_set)
            return self._bucketed.arrive(name, None, plan.exchange, allgather_handle, member)
        payload, layout, wire_dtype, backend, residual = self._select(name, record, tensor, flat, plan.k,
                                                                      world_size, op_name)
        request = ExchangeRequest(name, payload, layout, wire_dtype, flat, tuple(tensor.shape), scale, world_size,
                                  process_set, backend, residual, record)
        if self._bucketed.covers(name):  # waits for its bucket's exchange (torch.buckets)
            return self._bucketed.arrive(name, request, plan.exchange, allgather_handle)
        return self._exchange(plan.exchange)(request)

    def add_buckets(self, named_parameters: List[Tuple[str, Any]], scope: str = "") -> None:
        """Bucket the gradients of one optimizer's ``named_parameters`` (under the names the routing sees:
        ``scope`` + Horovod's name) by TopKConfig.bucket_bytes (core.buckets)."""
        members = [(scope + name, nbytes) for name, nbytes in bucket_member_names(named_parameters)]
        self.bucket_table.add(members, self.config.bucket_bytes)
        for route, held_buckets in self._held.items():
            held_buckets.table.add(members, held_bucket_bytes(route, self.config.bucket_bytes))

    def add_group_buckets(self, groups: List[List[str]], scope: str = "") -> None:
        """One bucket per group of Horovod's ``groups=`` (member names as the routing sees them, without
        ``scope``), instead of buckets by bytes: see core.buckets.BucketTable.add_groups."""
        scoped = [[scope + name for name in group] for group in groups]
        self.bucket_table.add_groups(scoped, self.config.bucket_bytes)
        for held_buckets in self._held.values():  # Horovod sends a group at once anyway: nothing to lose
            held_buckets.table.add_groups(scoped, self.config.bucket_bytes)

    def _extra_stats(self) -> Dict[str, Any]:
        stats = {"buckets": self._bucketed.stats()} if len(self.bucket_table) else {}
        held = {route: held_buckets.stats() for route, held_buckets in self._held.items() if len(held_buckets.table)}
        if held:
            stats["held_buckets"] = held
        return stats

    def _auto_begin(self, step: int, tensor: torch.Tensor, process_set: Any) -> None:
        """ratio="auto": at the first tensor of a step whose decision is due, measure (torch.auto_density) and
        decide, before this tensor is planned; every rank reaches the same step's first tensor."""
        assert self.auto is not None
        if self.auto.int8 and not tensor.is_cpu:
            self.auto.withdraw_int8()  # int8's grid reference is read on the host (torch.int8_route)
        if not self.auto.begin(step, time.perf_counter()):
            return
        measurement = auto_density.measure(self.auto, self._auto_tensors(), process_set, tensor.device,
                                           self.config.selector)
        self._auto_decide(measurement, process_set.rank())

    @staticmethod
    def _keep_int8_reference(record: Any) -> Callable[[float], None]:
        """What a reduced fp16 or int8 result hands its largest magnitude to: the record's int8 grid reference
        (torch.int8_route), the same on every rank."""
        def keep(reference: float) -> None:
            record.int8_reference = reference
        return keep

    def _forget_agreements(self) -> None:
        self._held_verified.clear()

    def _after_load(self) -> None:
        self._forget_agreements()
        for update_step in self.update_scopes.values():  # a loaded state ends the step in progress
            update_step.forget_step()
        self._bucketed.abandon_in_flight()
        for held_buckets in self._held.values():
            held_buckets.abandon_in_flight()
        if getattr(self, "_sparse_allreduce", None) is not None:
            self._sparse_allreduce.abandon_in_flight()

    def _exchange(self, exchange: str) -> Callable[[ExchangeRequest], Any]:
        """The function that carries a selected payload under ``exchange`` (core.exchange) and returns its handle."""
        if exchange == "sparse_allreduce":
            return self._sparse().start
        return start_allgather

    def _sparse(self) -> SparseAllreduce:
        """This compressor's sparse allreduce exchange (made on first use)."""
        if getattr(self, "_sparse_allreduce", None) is None:
            self._sparse_allreduce = SparseAllreduce()
        return self._sparse_allreduce

    def _agreement_check(
        self, name: str, tensor: torch.Tensor, step: int, k: Optional[int], process_set: Any,
        route: Optional[str] = None,
    ) -> "AgreementCheck":
        """Start the fingerprint allgather of this tensor's first step (core.consistency)."""
        from horovod.torch.mpi_ops import allgather_async, synchronize

        rows = torch.tensor([fingerprint(self.config, tuple(tensor.shape), tensor.dtype, step, k, route)],
                            dtype=torch.int64)
        return AgreementCheck(name, allgather_async(rows, name=check_name(name), process_set=process_set), synchronize)


def _both_checks(first: Optional[Callable[[], None]], second: Optional[Callable[[], None]]
                 ) -> Optional[Callable[[], None]]:
    """One agreement check that runs ``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first if second is None else second

    def both() -> None:
        first()
        second()

    return both
