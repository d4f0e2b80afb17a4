"""``TopKEF`` for ``horovod.tensorflow``: DistributedGradientTape, DistributedOptimizer and the Keras wrapper.

Same design as the PyTorch one (see horovod_topk.core.pending): ``compress`` marks, the routing of
:mod:`horovod_topk.tensorflow.routing` calls :meth:`TopKEF.start_reduction` where Horovod launches its allreduce.
Horovod runs that inside a ``tf.function``, so the state lives in ``tf.Variable``s created once per tensor (under
``tf.init_scope``, i.e. outside the traced graph) and updated by ops in the graph: the residual, the momentum
buffer (``momentum``), the running gradient-norm level (``spike_guard``), and an int64 counter vector (steps,
bytes sent, bytes dense, non-finite steps, guarded steps) that ``stats()`` reads back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from ..core.autodensity import auto_schedule, held_schedule
from ..core.policy import RouteSchedule, bucket_routes, spike_guard_scale, warmup_schedule

from ..core import (
    PendingReduction,
    RankMismatch,
    TensorRecord,
    TopKEFBase,
    allgather_name,
    check_name,
    fingerprint,
    mismatch_message,
    plan_tensor,
    reduction_scale,
)
from ..core.exchange import ALLGATHER, DENSE, DENSE_HALF, SPARSE_ALLREDUCE
from ..core.naming import half_allreduce_name
from . import buckets, half_route, ops, shared, sizes, sparse_allreduce, steps
from .auto_density import AutoState, AutoTick
from .state import state_variable
from .telemetry import GraphTelemetry, adapt_writer

__all__ = ["TopKEF"]


@dataclass(frozen=True)
class _Step:
    """What one compressed reduction of one tensor works on (built while tracing)."""

    tensor: tf.Tensor
    shape: tuple  # the gradient's static shape, which every route returns
    name: str
    numel: int
    wire_dtype: tf.DType
    residual: tf.Variable
    momentum: Optional[tf.Variable]
    counters: tf.Variable
    guarded: Union[int, tf.Tensor]
    dense_nbytes: int
    scale: float
    process_set: Any


@dataclass(frozen=True)
class _Bucketable:
    """A compressed tensor up to its selection, with its ``exchange`` and ``k`` (a fixed int; or, with a
    ``position``, the counts of a schedule and the position in force): it may share a bucket's collectives."""

    step: _Step
    exchange: str
    k: Union[int, Sequence[int]]
    position: Optional[tf.Tensor] = None


@dataclass(frozen=True)
class _Scheduled:
    """A tensor whose route and k change from step to step inside the graph (a sparsity warm-up, ratio="auto"), up
    to its exchange: members with the same ``key`` take the same position every step, so they may share a bucket
    (horovod_topk.core.policy.bucket_routes)."""

    step: _Step
    schedule: RouteSchedule
    position: tf.Tensor  # this step's position in the schedule (int32 scalar)
    #: Members with equal keys share buckets: ("auto", pattern): the tick's density; ("warmup", t, pattern): the
    #: warm-up step at trace time, capped at its last. ``pattern`` (:func:`_route_pattern`) keeps a bucket's branches
    #: as few as one member's: members that change route at other positions go to other buckets.
    key: tuple


def _route_pattern(schedule: RouteSchedule) -> Tuple[str, ...]:
    """The route ``schedule`` takes at each position."""
    return tuple(schedule.routes[phase] for phase in schedule.phase)


@dataclass(frozen=True)
class _Sent:
    """One tensor's allgather payload on its way out (steps.send), and what its receive needs."""

    payload: tf.Tensor
    finite: tf.Tensor
    plan: sizes.SizePlan
    row: tf.Tensor


_WIRE_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16,
                "float8": tf.dtypes.experimental.float8_e4m3fn}


class TopKEF(TopKEFBase[Any]):
    """Top-K with error feedback for ``hvd.DistributedGradientTape(tape, compression=TopKEF)`` and
    ``hvd.DistributedOptimizer(opt, compression=TopKEF(ratio=0.001))``.

    Residual keys are the names Horovod gives the reduction (the gradient's graph name, or ``grad_<i>`` with
    ``use_generic_names``): the same program gives the same keys on every rank and every run.

    ``TopKEF(log_every=N, summary_writer=w)`` reports every N steps like PyTorch (core.telemetry); ``w`` has
    ``add_scalar(tag, value, step)`` or is a ``tf.summary.SummaryWriter`` (see horovod_topk.tensorflow.telemetry).
    """

    #: ratio="auto" may choose fp16: its traced graph holds a float16 branch (:meth:`_half_reduce`).
    _sends_half = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "summary_writer" in kwargs:
            kwargs["summary_writer"] = adapt_writer(kwargs["summary_writer"])
        super().__init__(*args, **kwargs)
        #: ratio="auto": the per-step host call that decides the density in force, and the graph's stamps it
        #: measures from (horovod_topk.tensorflow.auto_density).
        self._auto_tick: Optional[AutoTick] = AutoTick(self) if self.config.auto else None
        #: The graph side of log_every (None when off: nothing is added to the graph).
        self._telemetry: Optional[GraphTelemetry] = GraphTelemetry(self) if self.config.log_every else None
        #: Each tensor's reduction op ("average"/"sum") as traced: what an elastic reset rescales by (elastic.py).
        self._reductions: Dict[str, str] = {}
        #: Per tensor name: the residual, momentum-buffer, gradient-level and counter variables (_counter_values).
        # Kept in the dicts of a tf.Module so that tf.train.Checkpoint can save them (see ``trackable``); adding
        # through these tracked dicts is what lets a restore reach variables created after it.
        self._trackable = tf.Module(name="horovod_topk")
        self._trackable.residuals = {}
        self._trackable.momentum = {}
        self._trackable.levels = {}
        self._trackable.counters = {}
        self._residual_vars: Dict[str, tf.Variable] = self._trackable.residuals
        self._momentum_vars: Dict[str, tf.Variable] = self._trackable.momentum
        self._level_vars: Dict[str, tf.Variable] = self._trackable.levels
        self._counter_vars: Dict[str, tf.Variable] = self._trackable.counters
        if self.config.auto:  # the density in force, its schedule and update mode's route saved with the residuals
            self._trackable.auto = AutoState(self)
        #: Update mode's calibrated second moment: each update's last noise share (telemetry, not checkpointed).
        self._noise_share_vars: Dict[str, tf.Variable] = {}
        #: Gradient reduction names whose update-mode agreement check ran (horovod_topk.tensorflow.update_mode):
        #: forgotten with the tensors' own checks after a load or an elastic reset, so every rank checks again.
        self.checked_gradients: set = set()

    def elastic_state(self, state: Any) -> Any:
        """``state`` (``hvd.elastic.TensorFlowKerasState`` or ``TensorFlowState``), made to commit, restore and
        sync this compressor's residuals too; see horovod_topk.tensorflow.elastic."""
        from .elastic import track

        return track(state, self)

    @property
    def trackable(self) -> tf.Module:
        """This rank's residuals and counters as a TensorFlow trackable, to save next to the model:
        ``tf.train.Checkpoint(model=model, optimizer=opt, topk=compressor.trackable)``. After a restore, each
        tensor's variables get their saved values when they are created on its first step (TensorFlow's deferred
        restoration). One checkpoint per rank, as residuals differ per rank; see horovod_topk.tensorflow.checkpoint
        for one file holding every rank's state."""
        return self._trackable

    # ---- compressor API hooks ------------------------------------------------------------------------------
    def _alias(self, tensor: tf.Tensor) -> tf.Tensor:
        return tf.identity(tensor)

    def _static_shape(self, tensor: tf.Tensor) -> tuple:
        return tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else (None,)

    def _graph_name(self, tensor: tf.Tensor) -> Optional[str]:
        return None if tf.executing_eagerly() else tensor.name

    # ---- called by the routing -----------------------------------------------------------------------------
    # Horovod's reduction runs under AutoGraph, which would convert everything called from here, core's pure-Python
    # planning included (warmup_schedule plans every warm-up step of every tensor): measured, that conversion was
    # most of the trace cost. This code builds its control flow with explicit tf.cond / tf.switch_case, so it
    # needs no conversion.
    @tf.autograph.experimental.do_not_convert
    def start_reduction(
        self,
        tensor: tf.Tensor,
        pending: PendingReduction,
        name: str,
        *,
        op_name: str,
        prescale_factor: float,
        postscale_factor: float,
        process_set: Any,
    ) -> Optional[tf.Tensor]:
        """The dense reduced gradient, computed from the Top-K entries of every rank (an allgather or the sparse
        allreduce, as core.exchange chooses); None to go dense."""
        return self.start_group([(tensor, pending, name)], 0, op_name=op_name, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set)[0]

    @tf.autograph.experimental.do_not_convert
    def start_group(
        self,
        members: Sequence[Tuple[tf.Tensor, PendingReduction, str]],
        cap_bytes: Optional[int],
        *,
        op_name: str,
        prescale_factor: float,
        postscale_factor: float,
        process_set: Any,
        held: bool = False,
    ) -> List[Optional[tf.Tensor]]:
        """:meth:`start_reduction` of each of a group's ``members`` ((gradient, its mark, its name) in Horovod's
        order), the compressed members in buckets of ``cap_bytes`` (None: the group is one bucket; 0: every member
        on its own): per bucket one allgather of its allgather members and one sparse allreduce (an alltoall and an
        allgather) of its sparse-allreduce members; members whose route changes per step (a warm-up, ratio="auto")
        share buckets with those at the same position, one branch per combination of routes
        (horovod_topk.tensorflow.buckets). None where a member goes dense. Under Horovod elastic every member
        travels on its own (buckets.cap_in_force). ``held``: under ratio="auto", a step of update mode's gradient
        route, where only dense or fp16 is ever in force (core.autodensity.held_schedule): their branches alone."""
        if cap_bytes is not None:
            cap_bytes = buckets.cap_in_force(cap_bytes)
        outputs: List[Optional[tf.Tensor]] = []
        waiting: Dict[str, Tuple[int, _Bucketable]] = {}
        scheduled: Dict[tuple, Dict[str, Tuple[int, _Scheduled]]] = {}
        for position, (tensor, pending, name) in enumerate(members):
            prepared = self._prepare(tensor, pending, name, op_name, prescale_factor, postscale_factor, process_set,
                                     held)
            if isinstance(prepared, _Bucketable):
                waiting[name] = (position, prepared)
                prepared = None
            elif isinstance(prepared, _Scheduled):
                scheduled.setdefault(prepared.key, {})[name] = (position, prepared)
                prepared = None
            outputs.append(prepared)
        dense = functools.partial(self._dense_reduce, op_name=op_name, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor)
        # ratio="auto": every gradient's ready stamp before any reduction. TensorFlow runs timestamps in program
        # order (they are stateful), so a ready stamp made after a bucket's done stamp would wait for that bucket's
        # collectives, and the step's "last ready" would be the end of the one before last: the wait would come out
        # as the last bucket's alone.
        tick = self._auto_tick
        ready = {} if tick is None else {
            held.step.name: tick.ready(held.step.name, held.step.tensor, held.position)
            for same_positions in scheduled.values() for _, held in same_positions.values() if held.key[0] == "auto"}
        for same_positions in scheduled.values():
            sizes_in_order = [(name, held.step.dense_nbytes) for name, (_, held) in same_positions.items()]
            for bucket in buckets.assign(sizes_in_order, cap_bytes):
                self._scheduled_bucket([same_positions[name] for name in bucket], outputs, dense, ready)
        sizes_in_order = [(name, held.step.dense_nbytes) for name, (_, held) in waiting.items()]
        for bucket in buckets.assign(sizes_in_order, cap_bytes):
            held = [waiting[name] for name in bucket]
            reduced = self._exchange_bucket([member for _, member in held])
            for (position, _), value in zip(held, reduced):
                outputs[position] = value
        return outputs

    def _exchange_bucket(self, members: Sequence["_Bucketable"]) -> List[tf.Tensor]:
        """The compressed members of a bucket: the allgather's in one allgather, the sparse allreduce's in one
        alltoall and one allgather; a member alone on its exchange travels as on its own. Returns each member's
        reduced gradient, in order."""
        out: List[Optional[tf.Tensor]] = [None] * len(members)
        for exchange in (ALLGATHER, SPARSE_ALLREDUCE):
            chosen = [i for i, member in enumerate(members) if member.exchange == exchange]
            held = [members[i] for i in chosen]
            names = [m.step.name for m in held]
            if len(held) == 1:
                out[chosen[0]] = self._topk_reduce(held[0].step, exchange, held[0].k, held[0].position)
            elif held and exchange == ALLGATHER:
                sent = [self._send(m.step, ALLGATHER, m.k, m.position) for m in held]
                gathered = buckets.gather([p.payload for p in sent], names, held[0].step.process_set)
                for i, m, payload, rows in zip(chosen, held, sent, gathered):
                    out[i] = self._receive(m.step, payload, rows)
            elif held:
                selected = [self._sparse_select(m.step, m.k, m.position) for m in held]
                results = sparse_allreduce.reduce_bucket([s[0] for s in selected], names, held[0].step.process_set)
                for i, m, (part, momentum, finite), (dense, residual) in zip(chosen, held, selected, results):
                    out[i] = self._sparse_finish(m.step, dense, residual, momentum, finite, part.layouts.sent_nbytes)
        assert all(value is not None for value in out)
        return out  # type: ignore[return-value]

    def _prepare(self, tensor: tf.Tensor, pending: PendingReduction, name: str, op_name: str, prescale_factor: float,
                 postscale_factor: float, process_set: Any, held: bool = False
                 ) -> Union[None, "_Bucketable", "_Scheduled"]:
        """Everything of a tensor's reduction up to its exchange: the agreement check, the counters, the state,
        the spike guard. Returns None (dense) or what its exchange needs, at a fixed k or by schedule: it may
        share a bucket."""
        world_size = process_set.size()
        scale = reduction_scale(op_name, prescale_factor, postscale_factor, world_size)
        if any(d is None for d in pending.shape):
            pending.route = "dense"  # a shape known only at run time cannot have a fixed k
            return None
        numel = int(np.prod(pending.shape, dtype=np.int64))
        wire_dtype = self._wire_dtype(tensor.dtype)
        record = self.registry.record(name, pending.shape)
        record.world_size, self._reductions[name] = world_size, op_name  # traced for this world (elastic.py)
        counters = self._counters(name, record)
        schedule: Optional[RouteSchedule] = None
        if self._auto_tick is not None:  # every density's route, the one in force looked up per step
            schedule = self._auto_schedule(name, numel, tensor.dtype, world_size)
            compressed, k, exchange = schedule is not None, None, None
        else:  # the route is traced once: with a warm-up, the plan after it (its steps are branches)
            plan = plan_tensor(name, numel, tensor.dtype.is_floating, self.config, world_size=world_size,
                               step=self.config.warmup_steps, value_itemsize=wire_dtype.size,
                               grad_itemsize=tensor.dtype.size, sparse_available=True)
            compressed, k, exchange = plan.compressed, plan.k, plan.exchange
        if not record.verified:
            self._verify(name, record, counters, tensor.dtype, k, process_set, exchange)
        # log_every: this tensor's counter updates below run after the telemetry gate (snapshot, report)
        gate = [self._telemetry.gate(name, counters, process_set.rank)] if self._telemetry is not None else []
        dense_nbytes = numel * tensor.dtype.size
        if not compressed:
            pending.route = "dense"
            with tf.control_dependencies(gate):
                counters.assign_add(tf.constant([1, dense_nbytes, dense_nbytes, 0, 0], tf.int64))
            return None
        if gate:
            with tf.control_dependencies(gate):
                tensor = tf.identity(tensor)

        pending.route = "topk"
        state_dtype = ops.residual_dtype(tensor.dtype)
        residual = self._buffer(self._residual_vars, "residual", name, record, numel, state_dtype)
        # the momentum buffer serves the selection: not a tensor that ratio="auto" only ever sends dense or in fp16
        selected = schedule is None or any(route not in (DENSE, DENSE_HALF) for route in schedule.routes)
        momentum = self._buffer(self._momentum_vars, "momentum", name, record, numel, state_dtype) \
            if self.config.momentum and selected else None
        guarded: Union[int, tf.Tensor] = 0  # without spike_guard: no input for it in steps.receive
        if self.config.spike_guard is not None:
            tensor, guarded = self._guard_spike(name, record, tensor, counters[0])
        step = _Step(tensor, tuple(pending.shape), name, numel, wire_dtype, residual, momentum, counters, guarded,
                     dense_nbytes, scale, process_set)
        if schedule is not None:
            assert self._auto_tick is not None
            if held:  # the full schedule, which stats()' exchanges report, is followed by update mode's own branch
                schedule = held_schedule(schedule)
            else:
                self._auto_tick.follow(name, schedule)
            return _Scheduled(step, schedule, self._auto_tick.choice(name, process_set),
                              ("auto", _route_pattern(schedule)))
        assert k is not None and exchange is not None
        record.exchange = exchange  # (traced once: the exchange of the traced step function)
        if not self.config.warmup_steps:
            return _Bucketable(step, exchange, k)
        schedule = warmup_schedule(name, numel, True, self.config, world_size=world_size,
                                   value_itemsize=wire_dtype.size, grad_itemsize=tensor.dtype.size,
                                   sparse_available=True)
        assert schedule is not None  # this step is compressed, hence the last one is
        last = len(schedule.phase) - 1
        with tf.init_scope():  # members at the same warm-up step stay together: every step reduces all of them
            at_trace = min(int(counters.numpy()[0]), last)
        return _Scheduled(step, schedule, tf.minimum(counters[0], last), ("warmup", at_trace, _route_pattern(schedule)))

    def _wire_dtype(self, dtype: tf.DType) -> tf.DType:
        return _WIRE_DTYPES.get(self.config.value_dtype or "", dtype) if dtype.is_floating else dtype

    def _auto_schedule(self, name: str, numel: int, dtype: tf.DType, world_size: int) -> Optional[RouteSchedule]:
        """ratio="auto"'s route of tensor ``name`` at every density; None where it goes dense whatever the choice."""
        return auto_schedule(name, numel, dtype.is_floating, self.config, world_size=world_size,
                             value_itemsize=self._wire_dtype(dtype).size, grad_itemsize=dtype.size,
                             sparse_available=True, half=self.auto is not None and self.auto.half)

    def auto_position(self, name: str, process_set: Any) -> tf.Tensor:
        """Under ratio="auto": the position in core.autodensity.CHOICES of the density in force at this step (the
        step's tick, horovod_topk.tensorflow.auto_density; ``name`` is the caller's, as a tensor's name is)."""
        assert self._auto_tick is not None
        return self._auto_tick.choice(name, process_set)

    def auto_residual(self, name: str, shape: tuple, dtype: tf.DType, world_size: int) -> Optional[tf.Variable]:
        """Under ratio="auto": the residual variable that tensor ``name``'s reduction keeps (created here when this
        trace reaches it first, from a loaded value or zeros), or None for a tensor that goes dense whatever the
        choice and so keeps none. Update mode's gradient route (horovod_topk.tensorflow.gradient_route) moves what
        a residual holds at the route's edges."""
        numel = int(np.prod(shape, dtype=np.int64))
        if self._auto_tick is None or self._auto_schedule(name, numel, dtype, world_size) is None:
            return None
        record = self.registry.record(name, shape)
        return self._buffer(self._residual_vars, "residual", name, record, numel, ops.residual_dtype(dtype))

    def _scheduled_bucket(self, held: Sequence[Tuple[int, "_Scheduled"]], outputs: List[Optional[tf.Tensor]],
                          dense: Any, ready: Dict[str, Any]) -> None:
        """A bucket of members that change route and k per step (a warm-up, ratio="auto"): one ``tf.switch_case``
        branch per combination of the members' routes (core.policy.bucket_routes), each executing the bucket at
        the sizes of the position in force; a bucket of one is the tensor's own switch (:meth:`_scheduled_reduce`).
        With ratio="auto" each member is stamped for the next decision's measurement (``ready``: its ready stamp,
        made by start_group before any reduction)."""
        members = [member for _, member in held]
        tick = self._auto_tick if members[0].key[0] == "auto" else None
        stamps = [ready[m.step.name] for m in members] if tick is not None else []
        if len(members) == 1:
            reduced = [self._scheduled_reduce(members[0].step, members[0].schedule, members[0].position, dense)]
        else:
            combinations, which = bucket_routes([m.schedule for m in members])
            branches = [functools.partial(self._bucket_at, members, combination, members[0].position, dense)
                        for combination in combinations]
            reduced = branches[0]() if len(branches) == 1 else tf.switch_case(
                tf.gather(tf.constant(which, tf.int32), members[0].position), branches)
        for i, ((position, member), value) in enumerate(zip(held, reduced)):
            outputs[position] = tick.done(member.step.name, value, stamps[i]) if tick is not None else value

    def _bucket_at(self, members: Sequence["_Scheduled"], routes: Sequence[str], position: tf.Tensor,
                   dense: Any) -> List[tf.Tensor]:
        """The members of a scheduled bucket under one combination of ``routes``: the dense ones each by Horovod's
        allreduce (in float16 on the fp16 route: Horovod's fusion buffer joins them), the compressed ones as one
        bucket (:meth:`_exchange_bucket`) at their sizes of the bucket's ``position``. One position for every member:
        the route and the sizes always agree, even if a member's own warm-up counter drifted from its bucket-mates'
        after the trace (a state loaded into a traced step)."""
        out: List[Optional[tf.Tensor]] = [dense(member.step) if route == DENSE else
                                          self._half_reduce(member.step) if route == DENSE_HALF else None
                                          for member, route in zip(members, routes)]
        compressed = [i for i, route in enumerate(routes) if route not in (DENSE, DENSE_HALF)]
        reduced = self._exchange_bucket([
            _Bucketable(members[i].step, routes[i], members[i].schedule.count, position)
            for i in compressed]) if compressed else []
        for i, value in zip(compressed, reduced):
            out[i] = value
        return out  # type: ignore[return-value]

    def _scheduled_reduce(self, step: "_Step", schedule: RouteSchedule, position: tf.Tensor,
                          dense: Any) -> tf.Tensor:
        """A route and k that change from step to step inside one traced graph: one ``tf.switch_case`` branch per
        route of ``schedule`` (core.policy.RouteSchedule: dense, allgather, sparse allreduce), each built once for
        every k, whose sizes it looks up by ``position`` (horovod_topk.tensorflow.sizes), and for ratio="auto"'s fp16
        one branch of dense in float16 (:meth:`_half_reduce`). Used by the sparsity warm-up (position: the step, up to
        the schedule's last) and by ratio="auto" (position: the density in force). Each step therefore selects and
        sends exactly the k and exchange of core's plan for it, as PyTorch does, and the graph holds one copy of the
        compressed path per exchange instead of one per payload size. After a warm-up the same branch runs at the
        final k: a branch of static shapes for those steps would be a second copy of the compressed path in every
        tensor's graph, the trace cost this design removes (README, "First-step (tracing) cost", has the per-step
        times of both)."""
        branches = [
            functools.partial(dense, step) if route == DENSE
            else functools.partial(self._half_reduce, step) if route == DENSE_HALF
            else functools.partial(self._topk_reduce, step, route, schedule.count, position)
            for route in schedule.routes
        ]
        if len(branches) == 1:
            return branches[0]()
        return tf.switch_case(tf.gather(tf.constant(schedule.phase, tf.int32), position), branches)

    def _topk_reduce(self, step: "_Step", exchange: str, k: Union[int, Sequence[int]],
                     t: Optional[tf.Tensor] = None) -> tf.Tensor:
        """The Top-K entries of every rank, exchanged by ``exchange`` ("allgather" or "sparse_allreduce"), summed
        as a dense tensor of the gradient's shape; updates residual, momentum buffer and counters. ``k`` is
        the number of entries per step, or with ``t`` (a position) the number at each position of a
        RouteSchedule.

        Under the allgather this adds two calls of bodies shared by every tensor with the same options, whatever
        its size, around the tensor's allgather (horovod_topk.tensorflow.steps); its state variables' handles and
        its sizes (one row) are their inputs."""
        from horovod.tensorflow.mpi_ops import allgather

        if exchange == SPARSE_ALLREDUCE:
            member, new_momentum, finite = self._sparse_select(step, k, t)
            dense, new_residual, sent_nbytes = sparse_allreduce.reduce(
                member.indices, member.values, member.residual, member.layouts, numel=step.numel,
                wire_dtype=step.wire_dtype, name=step.name, process_set=step.process_set)
            return self._sparse_finish(step, dense, new_residual, new_momentum, finite, sent_nbytes)
        sent = self._send(step, exchange, k, t)
        gathered = allgather(sent.payload, name=allgather_name(step.name), ignore_name_scope=True,
                             process_set=step.process_set)
        return self._receive(step, sent, gathered)

    def _send(self, step: "_Step", exchange: str, k: Union[int, Sequence[int]],
              t: Optional[tf.Tensor] = None) -> "_Sent":
        """The allgather half before the collective: error-feedback selection and packing (steps.send)."""
        plan = self._size_plan(step, exchange, k, t)
        select_dtype = self._select_dtype(step, plan)
        started = self._telemetry.clock(step.tensor) if self._telemetry is not None else None
        row = plan.row(t, step.numel)
        # NaN/Inf entries are sent and never enter the residual (ops.compensate_nonfinite)
        payload, finite = shared.call_any_shape(
            steps.send, step.tensor, step.residual.handle, None if step.momentum is None else step.momentum.handle,
            row, options=plan.options, state_dtype=step.residual.dtype, select_dtype=select_dtype,
            momentum=self.config.momentum)
        if started is not None:
            payload = self._telemetry.timed(step.name, started, payload)
        if t is None:  # a fixed k: the payload's size is known here (the shared body is traced for any size)
            payload.set_shape([plan.layouts[0].nbytes])
        return _Sent(payload, finite, plan, row)

    def _size_plan(self, step: "_Step", exchange: str, k: Union[int, Sequence[int]],
                   t: Optional[tf.Tensor]) -> sizes.SizePlan:
        """The sizes of ``step``'s exchange: fixed (``k`` an int), or per position ``t`` of a schedule."""
        world_size = step.process_set.size()
        if t is None:
            assert isinstance(k, int)
            return sizes.fixed_plan(self.config, k, step.numel, step.wire_dtype.size, world_size, exchange)
        assert not isinstance(k, int)
        return sizes.step_plan(self.config, k, step.numel, step.wire_dtype.size, world_size, exchange)

    @staticmethod
    def _select_dtype(step: "_Step", plan: sizes.SizePlan) -> tf.DType:
        """float8 values are selected exactly; the compact encoder puts float8's rounding back into the residual."""
        return step.residual.dtype if plan.layouts[0].scaled else step.wire_dtype

    def _receive(self, step: "_Step", sent: "_Sent", gathered: tf.Tensor) -> tf.Tensor:
        """The allgather half after the collective: the size check, the counters and the decoded dense sum
        (steps.receive) of the ``gathered`` payloads."""
        world_size = step.process_set.size()
        reduced = shared.call_any_shape(
            steps.receive, gathered, step.counters.handle, sent.finite,
            None if isinstance(step.guarded, int) else step.guarded,
            tf.constant(sent.plan.mismatch_message(step.name, world_size)), sent.row,
            tf.constant(step.shape, tf.int32), options=sent.plan.options,
            world_size=world_size, wire_dtype=step.wire_dtype, acc_dtype=step.residual.dtype, scale=step.scale,
            out_dtype=step.tensor.dtype)
        reduced.set_shape(step.shape)
        return reduced

    def _sparse_select(self, step: "_Step", k: Union[int, Sequence[int]], t: Optional[tf.Tensor] = None
                       ) -> Tuple[sparse_allreduce.Member, Optional[tf.Tensor], tf.Tensor]:
        """The sparse allreduce's half before its collectives: the error-feedback selection of ``step``
        (ops.error_feedback_step). Returns (its part of the exchange, the new momentum buffer, whether the
        gradient was finite)."""
        plan = self._size_plan(step, SPARSE_ALLREDUCE, k, t)
        size = plan.at(t)
        assert size.sparse is not None
        indices, values, new_residual, new_momentum, finite = shared.call(
            ops.error_feedback_step, tf.reshape(step.tensor, [-1]), step.residual, size.k,
            self._select_dtype(step, plan), size.sampling, step.momentum, self.config.momentum)
        member = sparse_allreduce.Member(indices, values, new_residual, size.sparse, step.numel, step.wire_dtype)
        return member, new_momentum, finite

    def _sparse_finish(self, step: "_Step", dense: tf.Tensor, new_residual: tf.Tensor,
                       new_momentum: Optional[tf.Tensor], finite: tf.Tensor, sent_nbytes: ops.Size) -> tf.Tensor:
        """The sparse allreduce's half after its collectives (horovod_topk.tensorflow.sparse_allreduce): the
        residual is written after both phases, which put back into it the entries no owner applied."""
        updates = [step.residual.assign(new_residual), self._count_step(step, sent_nbytes, finite)]
        if step.momentum is not None:
            updates.append(step.momentum.assign(new_momentum))
        with tf.control_dependencies(updates):
            dense = tf.identity(dense)
        if step.scale != 1.0:
            dense = dense * tf.cast(step.scale, dense.dtype)
        return tf.reshape(tf.cast(dense, step.tensor.dtype), step.shape)

    def _dense_reduce(self, step: "_Step", *, op_name: str, prescale_factor: float,
                      postscale_factor: float) -> tf.Tensor:
        """A step that goes dense (a warm-up's, or ratio="auto"'s dense choice): Horovod's own allreduce of the
        gradient plus what the residual still holds (nothing is lost when a tensor changes route), in the gradient's
        shape."""
        from horovod.tensorflow.mpi_ops import Average, Sum, _allreduce

        flat = tf.reshape(step.tensor, [-1])
        finite = tf.reduce_all(tf.math.is_finite(flat))
        leftover = tf.where(finite, step.residual, tf.zeros_like(step.residual))  # kept for a finite step
        with tf.control_dependencies([step.residual.assign_sub(leftover)]):
            flat = flat + tf.cast(leftover, flat.dtype)
        reduced = _allreduce(flat, name=f"{step.name}.dense", op=Average if op_name == "average" else Sum,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             ignore_name_scope=True, process_set=step.process_set)
        with tf.control_dependencies([self._count_step(step, step.dense_nbytes, finite)]):
            return tf.reshape(reduced, step.shape)

    def _half_reduce(self, step: "_Step") -> tf.Tensor:
        """ratio="auto"'s fp16: the gradient plus its residual, scaled, in float16 by Horovod's allreduce (a sum of
        the scaled shares), what float16 did not carry kept in the residual (horovod_topk.tensorflow.half_route)."""
        from horovod.tensorflow.mpi_ops import Sum, _allreduce

        half, new_residual, finite = half_route.to_half(tf.reshape(step.tensor, [-1]), step.residual, step.scale,
                                                        step.process_set.size())
        with tf.control_dependencies([step.residual.assign(new_residual)]):
            half = tf.identity(half)
        summed = _allreduce(half, name=half_allreduce_name(step.name), op=Sum, ignore_name_scope=True,
                            process_set=step.process_set)
        with tf.control_dependencies([self._count_step(step, 2 * step.numel, finite)]):
            return tf.reshape(tf.cast(summed, step.tensor.dtype), step.shape)

    @staticmethod
    def _count_step(step: "_Step", sent_nbytes: Union[int, ops.Size], finite: tf.Tensor) -> Any:
        """One step of ``step``'s tensor into its counters: steps, bytes sent, dense bytes, non-finite, guarded."""
        return step.counters.assign_add(tf.stack([
            tf.constant(1, tf.int64), tf.cast(sent_nbytes, tf.int64), tf.constant(step.dense_nbytes, tf.int64),
            1 - tf.cast(finite, tf.int64), tf.cast(step.guarded, tf.int64)]))

    def _verify(self, name: str, record: TensorRecord[Any], counters: tf.Variable, dtype: tf.DType,
                k: Optional[int], process_set: Any, route: Optional[str] = None) -> None:
        """Check once (at trace time, or on the first eager step) that every rank agrees about this tensor
        (core.consistency), before any of its collectives is built: a disagreement raises RankMismatch on every
        rank instead of a hang. The fingerprint allgather runs eagerly (tf.init_scope), in program order, which
        is the same on every rank."""
        from horovod.tensorflow.mpi_ops import allgather

        record.verified = True
        with tf.init_scope():
            step = int(counters.numpy()[0])
            row = tf.constant([fingerprint(self.config, record.shape, dtype, step, k, route)], tf.int64)
            rows = allgather(row, name=check_name(name), ignore_name_scope=True, process_set=process_set).numpy()
        message = mismatch_message(name, rows.tolist())
        if message is not None:
            raise RankMismatch(message)

    # ---- variables -----------------------------------------------------------------------------------------
    def _guard_spike(self, name: str, record: TensorRecord[Any], tensor: tf.Tensor,
                     step: tf.Tensor) -> "tuple[tf.Tensor, tf.Tensor]":
        """TopKConfig.spike_guard: the gradient scaled down when its norm exceeds the guard times its running
        level, and 1 if it was (0 if not). The rule is core.policy.spike_guard_scale itself, run on the host
        (tf.numpy_function) on one scalar per tensor and step, so both frameworks cap alike."""
        guard = float(self.config.spike_guard)  # type: ignore[arg-type]
        level = self._level(name, record)
        norm = tf.norm(tf.cast(tf.reshape(tensor, [-1]), tf.float64))

        def rule(norm: np.ndarray, level: np.ndarray, step: np.ndarray) -> tuple:
            factor, new_level = spike_guard_scale(float(norm), float(level), guard, int(step))
            return np.float64(factor), np.float64(new_level)

        factor, new_level = tf.numpy_function(rule, [norm, level, step], [tf.float64, tf.float64], stateful=False)
        with tf.control_dependencies([level.assign(tf.reshape(new_level, []))]):
            scaled = tensor * tf.cast(tf.reshape(factor, []), tensor.dtype)  # a scalar: the shape stays known
        return scaled, tf.reshape(tf.cast(factor < 1.0, tf.int64), [])

    def _level(self, name: str, record: TensorRecord[Any]) -> tf.Variable:
        var = self._level_vars.get(name)
        if var is None:
            var = state_variable(float(record.gradient_level), "topk_gradient_level", tf.float64)
            self._level_vars[name] = var
        return var

    def _buffer(self, variables: Dict[str, tf.Variable], field: str, name: str, record: TensorRecord[Any],
                numel: int, dtype: tf.DType) -> tf.Variable:
        """The flat state variable ``field`` ("residual" or "momentum") of ``name``, created on first use from
        the record's loaded value (or zeros); the record then points at the variable."""
        var = variables.get(name)
        if var is None:
            loaded = getattr(record, field)
            if loaded is None:  # zeros made by TensorFlow: no host array of the tensor's size to build and copy
                var = state_variable(lambda: tf.zeros([numel], dtype), f"topk_{field}", dtype)
            elif np.shape(loaded) != (numel,):
                raise ValueError(f"horovod-topk: the {field} of {name!r} has {np.size(loaded)} elements, the "
                                 f"gradient {numel} (a state_dict of another model?)")
            else:
                var = state_variable(np.asarray(loaded).astype(dtype.as_numpy_dtype), f"topk_{field}")
            variables[name] = var
        setattr(record, field, var)
        return var

    def _counters(self, name: str, record: TensorRecord[Any]) -> tf.Variable:
        var = self._counter_vars.get(name)
        if var is None:
            var = state_variable(self._counter_values(record), "topk_counters", tf.int64)
            self._counter_vars[name] = var
        return var

    def count_sent(self, name: str, shape: tuple, nbytes: int) -> tf.Operation:
        """In the graph: add ``nbytes`` that a collective outside the exchange carried for tensor ``name`` (update
        mode's noise-share sketch) to its bytes sent (stats())."""
        counters = self._counters(name, self.registry.record(name, shape))
        return counters.assign_add(tf.constant([0, nbytes, 0, 0, 0], tf.int64))

    def noise_share_variable(self, name: str) -> tf.Variable:
        """The float32 scalar that update mode's calibrated second moment assigns tensor ``name``'s noise share to
        each step; stats() reads it into the tensor's record."""
        var = self._noise_share_vars.get(name)
        if var is None:
            var = self._noise_share_vars[name] = state_variable(0.0, "topk_noise_share", tf.float32)
        return var

    @staticmethod
    def _counter_values(record: TensorRecord[Any]) -> list:
        """The counter variable's layout: (steps, bytes sent, bytes dense, non-finite steps, guarded steps)."""
        return [record.steps, record.bytes_sent, record.bytes_dense, record.nonfinite_steps, record.guarded_steps]

    def _refresh_counters(self) -> None:
        for name, var in self._counter_vars.items():
            record = self.registry.records.get(name)
            if record is not None:
                (record.steps, record.bytes_sent, record.bytes_dense, record.nonfinite_steps,
                 record.guarded_steps) = (int(v) for v in var.numpy())
                if name in self._level_vars:
                    record.gradient_level = float(self._level_vars[name].numpy())
                seconds = self._telemetry.compress_seconds(name) if self._telemetry is not None else None
                if seconds is not None:
                    record.compress_seconds = seconds
        for name, var in self._noise_share_vars.items():
            if name in self.registry.records:
                record = self.registry.records[name]
                record.noise_share = float(var.numpy()) if record.steps else None

    def _after_load(self) -> None:
        self._forget_agreements()
        buffers = ((self._residual_vars, "residual"), (self._momentum_vars, "momentum"))
        if self._telemetry is not None:
            self._telemetry.zero()
        for name in set(self._counter_vars) - set(self.registry.records):  # not in the loaded state: start over
            for var in self._variables_of(name):
                var.assign(tf.zeros_like(var))
        for name, record in self.registry.records.items():
            if name in self._counter_vars:
                self._counter_vars[name].assign(self._counter_values(record))
            if name in self._level_vars:
                self._level_vars[name].assign(record.gradient_level)
            for variables, field in buffers:
                if name in variables:
                    loaded = getattr(record, field)
                    variables[name].assign(np.zeros(variables[name].shape) if loaded is None else loaded)
                    setattr(record, field, variables[name])

    def _forget_agreements(self) -> None:
        """Forget update mode's agreement checks and ratio="auto"'s too: after a load or a reset every rank checks
        again."""
        self.checked_gradients.clear()
        if self._auto_tick is not None:
            self._auto_tick.forget()

    def _variables_of(self, name: str) -> list:
        kinds = (self._counter_vars, self._residual_vars, self._momentum_vars, self._level_vars)
        return [variables[name] for variables in kinds if name in variables]

    def reset(self) -> None:
        super().reset()
        self._forget_agreements()
        if self._telemetry is not None:
            self._telemetry.zero()
        for name in self._counter_vars:
            for var in self._variables_of(name):
                var.assign(tf.zeros_like(var))

    # ---- state hooks ---------------------------------------------------------------------------------------
    def _export_residual(self, residual: Any) -> np.ndarray:
        return np.array(residual.numpy() if isinstance(residual, tf.Variable) else residual, copy=True)

    def _import_residual(self, name: str, value: Any) -> np.ndarray:
        array = np.asarray(value).reshape(-1).copy()
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise ValueError(f"horovod-topk: the saved residual of {name!r} holds NaN/Inf (a corrupted state); "
                             f"refusing to load it")
        return array

    def _residual_squared_norm(self, residual: Any) -> float:
        values = residual.numpy() if isinstance(residual, tf.Variable) else np.asarray(residual)
        return float(np.square(values.astype(np.float64)).sum())
