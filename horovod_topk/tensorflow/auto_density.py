"""ratio="auto" in TensorFlow: the density in force looked up by the traced step, chosen on the host.

A traced graph has fixed ops, so a compressed tensor's graph holds one branch per route its choices take
(core.autodensity.auto_schedule: dense, fp16, allgather, sparse allreduce) and looks up the sizes of the density in
force (horovod_topk.tensorflow.sizes), as the sparsity warm-up does by step. The density in force is decided on the
host: once per step, before any compressed collective of that step is launched, one ``tf.py_function`` (the *tick*)

1. closes the last step's measurement from what the graph stamped (per tensor, in a variable of its own: when
   its gradient was ready, when its reduction was done): wait = the last done - the last ready (what a PyTorch
   step waits in ``synchronize()``), read only for the steps whose wait counts toward the next decision (one
   read costs ~0.8 ms: AutoDensity.wait_counts). The selection's time is not stamped (it would need a value out of every
   route's branch); the decision takes it from the selection it times (core.linkprobe);
2. when a decision is due (core.autodensity), probes the link with Horovod's eager collectives and decides (the
   sequence is core.linkprobe's, the same as PyTorch's), from a measurement gathered from every rank: every rank
   takes the same decision at the same step;
3. after a start, a load or a reset, checks that every rank holds the same density and step (one allgather), so
   that ranks that disagree raise RankMismatch instead of exchanging payloads of different sizes;
4. returns the position of the density in force in CHOICES, which every compressed tensor's branch waits for.

A step is one run of a traced graph (the tick is built once per graph, by its first compressed tensor, outside the
``tf.cond`` branches the reductions are built in: a step whose reductions are skipped by a condition still counts);
in eager mode, one pass of the tensors in program order (the tick runs at the first tensor's reduction). What is not
stamped: tensors that are dense whatever the choice (not floating; under ``min_numel`` where fp16 is not offered),
which go to Horovod's own allreduce.
"""
from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..core import RankMismatch, linkprobe
from ..core.autodensity import choice_index
from ..core.exchange import DENSE
from ..core.policy import RouteSchedule, sample_size
from . import ops

__all__ = ["TensorFlowProbes", "measure", "AutoTick", "AutoState", "AGREEMENT_NAME"]

#: The collective that checks, after a start, a load or a reset, that every rank holds the same density and step.
AGREEMENT_NAME = "topk.auto.agree"
#: Slots of a tensor's stamp variable: when its gradient was ready, when its reduction was done.
_READY, _DONE = 0, 1


class AutoState(tf.train.experimental.PythonState):
    """ratio="auto"'s state (core.autodensity.AutoDensity.state_dict) in the compressor's ``trackable``, so that a
    job resumed from ``tf.train.Checkpoint(..., topk=compressor.trackable)`` continues as one resumed from
    ``state_dict()``: the density in force, the decisions' schedule, and which update-mode optimizers run the
    gradient route (their residuals hold gradient there, not update)."""

    def __init__(self, compressor: Any) -> None:
        self._compressor = weakref.ref(compressor)

    def serialize(self) -> str:
        return json.dumps(self._compressor().auto.state_dict())

    def deserialize(self, string_value: Any) -> None:
        compressor = self._compressor()
        text = string_value.decode() if isinstance(string_value, bytes) else str(string_value)
        compressor.auto.load_state_dict(json.loads(text))
        compressor._forget_agreements()  # every rank checks again that it holds the same density and step


def _latest_stamps(stamps: List[tf.Variable]) -> tf.Tensor:
    return tf.reduce_max(tf.stack([v.read_value() for v in stamps]), axis=0)


@dataclass
class TensorFlowProbes:
    """core.linkprobe.LinkProbes over Horovod's TensorFlow collectives on ``process_set``, run eagerly."""

    process_set: Any

    def allreduce_seconds(self, numel: int, name: str, repeats: int) -> List[float]:
        from horovod.tensorflow.mpi_ops import Sum, _allreduce

        buf = tf.zeros([numel], tf.float32)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            _allreduce(buf, name=name, op=Sum, ignore_name_scope=True, process_set=self.process_set).numpy()
            times.append(time.perf_counter() - started)
        return times

    def burst_seconds(self, count: int) -> float:
        """One grouped allgather of ``count`` one-float tensors: eager TensorFlow has no asynchronous handles, and
        a group is what Horovod submits together (and fuses, as it fuses a step's allgathers)."""
        from horovod.tensorflow.mpi_ops import grouped_allgather

        ones = [tf.zeros([1], tf.float32) for _ in range(count)]
        started = time.perf_counter()
        for out in grouped_allgather(ones, name=linkprobe.burst_name(0), ignore_name_scope=True,
                                     process_set=self.process_set):
            out.numpy()
        return time.perf_counter() - started

    def select_seconds_per_entry(self, numel: int) -> float:
        """Best of 3 eager runs of the selection the compressed step runs (ops.error_feedback_step)."""
        flat = tf.random.normal([numel])
        residual = tf.zeros([numel])
        k = max(1, -(-numel // 100))
        sampling = ops.sample_geometry(numel, k, sample_size(k, numel))
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            out = ops.error_feedback_step(flat, residual, k, tf.float32, sampling)
            out[1].numpy()
            best = min(best, time.perf_counter() - started)
        return best / numel

    def gather_rows(self, row: Sequence[float]) -> List[List[float]]:
        from horovod.tensorflow.mpi_ops import allgather

        mine = tf.constant([list(row)], tf.float64)
        return allgather(mine, name=linkprobe.MEASURE_NAME, ignore_name_scope=True,
                         process_set=self.process_set).numpy().tolist()


def measure(auto: Any, tensors: Sequence[Any], process_set: Any) -> Any:
    """Probe the link, time a selection, and gather every rank's row: the Measurement every rank decides from."""
    return linkprobe.measure(auto, tensors, TensorFlowProbes(process_set), process_set.size())


def _step_graph(graph: Any) -> Any:
    """The graph that runs once per step around ``graph``: out of every ``tf.cond`` branch (Horovod wraps each
    reduction in one, on the world size), so that the tensors of a step share one tick; a while-loop body (several
    steps per call) is kept."""
    from tensorflow.python.ops.control_flow_v2_func_graphs import CondBranchFuncGraph

    while isinstance(graph, CondBranchFuncGraph):
        graph = graph.outer_graph
    return graph


class AutoTick:
    """The per-step host call of one ratio="auto" compressor, and the graph stamps its measurement comes from."""

    def __init__(self, compressor: Any) -> None:
        #: The compressor whose ``auto`` (core.autodensity.AutoDensity) decides; held weakly (it holds this).
        self._compressor = weakref.ref(compressor)
        #: The tick of each traced graph: built once per graph, by its first compressed tensor.
        self._ticks: "weakref.WeakKeyDictionary[Any, tf.Tensor]" = weakref.WeakKeyDictionary()
        #: The process set the probes and the agreement run on (the compressed tensors').
        self._process_set: Any = None
        #: The first tensor name of a step in eager mode (its reduction runs the tick), and that tick's position.
        self._eager_first: Optional[str] = None
        self._eager_position: Optional[tf.Tensor] = None
        #: Each compressed tensor's routes per density: what stats()["exchanges"] reports for the one in force.
        self._schedules: Dict[str, RouteSchedule] = {}
        #: Every rank checks it holds the same density and step at its next tick (after a start, load or reset).
        self._agree = True
        #: Per compressed tensor: when its gradient was last ready and when its reduction was last done (seconds
        #: since the epoch). The latest of each over the tensors is the last step's (stamps only grow).
        self._stamps: Dict[str, tf.Variable] = {}
        #: What the stamps held when last read: a step whose stamps did not move measured no wait.
        self._last_stamps = (0.0, 0.0)
        #: The latest (ready, done) over the tensors' stamps: one traced read of them all (eager reads cost ~0.1 ms
        #: each); this tick's own function, traced again only when its tensors change.
        self._read_stamps = tf.function(_latest_stamps)

    def forget(self) -> None:
        """A load or a reset: the ranks check again that they hold the same density and step."""
        self._agree = True

    # ---- graph side --------------------------------------------------------------------------------------------
    def follow(self, name: str, schedule: RouteSchedule) -> None:
        """Tensor ``name`` takes ``schedule``'s route of the density in force at each step."""
        self._schedules[name] = schedule

    def choice(self, name: str, process_set: Any) -> tf.Tensor:
        """The position in CHOICES of the density in force at this step (an int32 scalar): this graph's tick."""
        if self._process_set is None:
            self._process_set = process_set
        elif process_set.process_set_id != self._process_set.process_set_id:
            raise ValueError("horovod-topk: ratio='auto' decides one density for one process set; this compressor "
                             "already reduces tensors of another one (use one TopKEF per process set)")
        if tf.executing_eagerly():
            if self._eager_first is None:
                self._eager_first = name
            if name == self._eager_first or self._eager_position is None:
                self._eager_position = self._call()
            return self._eager_position
        graph = _step_graph(tf.compat.v1.get_default_graph())
        tick = self._ticks.get(graph)
        if tick is None:
            with graph.as_default():
                tick = self._call()
            self._ticks[graph] = tick
        return tick

    def _call(self) -> tf.Tensor:
        position = tf.py_function(self._tick, [], tf.int32, name="topk_auto_tick")
        position.set_shape([])
        return position

    def ready(self, name: str, tensor: tf.Tensor, position: tf.Tensor) -> Any:
        """Stamp when ``tensor`` (the gradient of ``name``) is ready for this step's reduction (after the tick);
        returns the stamp's op for :meth:`done`. The tensor itself does not wait for the stamp.

        The tick comes in through an op of this graph: the reductions are built inside Horovod's ``tf.cond``, and a
        control dependency on a tensor of an outer graph is only recorded for the branch function's call, which
        does not keep it: the stamp would run while the tick still reads the last step's stamps, the tick would
        read a mix of two steps, see a done before its ready and record no wait at all (ratio="auto" would take
        every step for compute and stay dense over 100 Mbit/s)."""
        position = tf.identity(position)
        with tf.control_dependencies([tensor, position]):
            now = tf.timestamp()
        return self._stamp(name).scatter_update(tf.IndexedSlices(tf.reshape(now, [1]), [_READY]))

    def done(self, name: str, reduced: tf.Tensor, ready_stamp: Any) -> tf.Tensor:
        """``reduced``, its completion time stamped; it also depends on ``ready_stamp`` (from :meth:`ready`), so
        that no graph prunes that stamp (tf.function keeps every stateful op; a TF1 graph keeps what is fetched)."""
        with tf.control_dependencies([reduced]):
            now = tf.timestamp()
        with tf.control_dependencies([ready_stamp, self._stamp(name).scatter_update(
                tf.IndexedSlices(tf.reshape(now, [1]), [_DONE]))]):
            return tf.identity(reduced)

    def _stamp(self, name: str) -> tf.Variable:
        """Tensor ``name``'s own (ready, done) variable: one per tensor, because ops on one shared variable would be
        ordered by TensorFlow's automatic control dependencies, and with them every reduction after the previous."""
        var = self._stamps.get(name)
        if var is None:
            with tf.init_scope():
                var = tf.Variable(tf.zeros([2], tf.float64), trainable=False, name="topk_auto_stamps")
            self._stamps[name] = var
        return var

    # ---- host side ---------------------------------------------------------------------------------------------
    def _tick(self) -> np.int32:
        compressor = self._compressor()
        auto = compressor.auto
        if self._stamps and auto.wait_counts():  # reading the stamps costs ~0.8 ms: only when they count
            ready, done = (float(v) for v in self._read_stamps(list(self._stamps.values())).numpy())
            if (ready, done) != self._last_stamps and done >= ready > 0.0:
                auto.waited(done - ready)
            self._last_stamps = (ready, done)
        if auto.begin(auto.step + 1, time.time()):
            compressor._auto_decide(measure(auto, compressor._auto_tensors(), self._process_set),
                                    self._process_set.rank())
        position = choice_index(auto.ratio)
        if self._agree:
            self._check_agreement(position, auto.step)
        for name, schedule in self._schedules.items():
            route = schedule.routes[schedule.phase[position]]
            record = compressor.registry.records.get(name)
            if record is not None and route != DENSE:
                record.exchange = route
        return np.int32(position)

    def _check_agreement(self, position: int, step: int) -> None:
        from horovod.tensorflow.mpi_ops import allgather

        mine = tf.constant([[position, step]], tf.int64)
        rows = allgather(mine, name=AGREEMENT_NAME, ignore_name_scope=True,
                         process_set=self._process_set).numpy().tolist()
        self._agree = False
        if any(row != rows[0] for row in rows):
            raise RankMismatch(
                "horovod-topk: ranks disagree about ratio='auto': (density position, step) per rank "
                f"{[tuple(r) for r in rows]}. Load the same checkpoint on every rank, or none.")
