"""Telemetry for the TensorFlow ``TopKEF`` (``log_every=N``, ``summary_writer=``): the same line and scalars as
PyTorch (horovod_topk.core.telemetry), from a compressor whose work runs inside ``tf.function`` graphs.

Why this shape. The traffic counters already live in per-tensor ``tf.Variable``s updated in the graph (see
compressor.py), so the numbers cost nothing extra to keep; what the graph cannot do is call ``logging`` or a
writer. A ``tf.py_function`` on every step would stop the graph on the host every step; reporting from the user's
Python loop would need a call the user must remember (there is no hook of ours outside the graph with
``DistributedGradientTape``). So each tensor's step gets a scalar predicate ``steps % N == 0`` and a ``tf.cond``
whose true branch is the ``tf.py_function`` that reports: the host is entered once per tensor every N steps (the
first tensor of step N + 1 reports, the others find it done) and never in between. Per step and compressed tensor
the graph gains a 4-element snapshot assign and two ``tf.timestamp`` ops; nothing of this is built when
``log_every`` is 0.

Exact numbers although tensors run in parallel. The report for step N is made while step N + 1 runs, and another
tensor may already have counted its step N + 1. Each tensor therefore copies its counters into a ``before``
variable at the start of its step, before it updates them; the report takes a tensor's ``before`` when that holds
step N, and its live counters otherwise (read first, so they cannot have moved on yet: the copy precedes every
update). The residual norm is read live ("now", as in PyTorch).

Compress time is the time between the gradient being ready and its payload being packed, measured in the graph
with ``tf.timestamp`` (on a GPU: when the host saw those ops done). Not available under XLA (``jit_compile``),
where ``tf.py_function`` is not either.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, Optional

import tensorflow as tf

from .state import state_variable

__all__ = ["GraphTelemetry", "SummaryWriterScalars", "adapt_writer"]


def _scalar_metadata() -> Any:
    """What ``tf.summary.scalar`` attaches to a scalar (TensorBoard's "scalars" plugin, scalar data class)."""
    from tensorflow.core.framework import summary_pb2

    metadata = summary_pb2.SummaryMetadata(data_class=summary_pb2.DATA_CLASS_SCALAR)
    metadata.plugin_data.plugin_name = "scalars"
    return metadata


class SummaryWriterScalars:
    """``add_scalar(tag, value, step)`` over a ``tf.summary.SummaryWriter``, which core.telemetry writes to.

    Writes with ``tf.summary.write`` and the scalar metadata, i.e. the record ``tf.summary.scalar`` writes: that
    one lives in the ``tensorboard`` package, which a training job need not have installed."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self._metadata = _scalar_metadata()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        with self.writer.as_default():
            tf.summary.write(tag, tf.constant(float(value), tf.float32), step=int(step), metadata=self._metadata)


def adapt_writer(writer: Any) -> Any:
    """A ``tf.summary.SummaryWriter`` wrapped for core.telemetry; anything else (an object with ``add_scalar``, or
    None) as it is, so that core.telemetry judges it."""
    if writer is None or callable(getattr(writer, "add_scalar", None)):
        return writer
    if isinstance(writer, tf.summary.SummaryWriter):
        return SummaryWriterScalars(writer)
    return writer


class GraphTelemetry:
    """The graph side of one TF TopKEF's telemetry: per-tensor snapshot and timing variables, the gate that
    reports every N steps, and the report itself (core.telemetry's line and scalars)."""

    def __init__(self, compressor: Any) -> None:
        self._compressor = compressor
        self._lock = threading.Lock()
        #: Per tensor name: seconds spent compressing (float64 scalar), and (steps, bytes sent, bytes dense,
        #: seconds) as they were when the tensor's latest step began (float64[4]).
        self.seconds: Dict[str, tf.Variable] = {}
        self.before: Dict[str, tf.Variable] = {}

    def _variable(self, table: Dict[str, tf.Variable], name: str, initial: Any, label: str) -> tf.Variable:
        var = table.get(name)
        if var is None:
            var = state_variable(initial, label, tf.float64)  # created once, outside any traced function
            table[name] = var
        return var

    def gate(self, name: str, counters: tf.Variable, rank: Callable[[], int]) -> tf.Tensor:
        """Ops that must run before this tensor's step updates ``counters``: the snapshot, and the report when
        ``steps`` (completed before this one) is a multiple of log_every. The caller orders its updates after."""
        every = int(self._compressor.config.log_every)
        seconds = self._variable(self.seconds, name, 0.0, "topk_compress_seconds")
        before = self._variable(self.before, name, [0.0] * 4, "topk_counters_before")
        done = counters[0]
        snapshot = before.assign(tf.concat([tf.cast(counters[:3], tf.float64), tf.reshape(seconds.read_value(), [1])],
                                           axis=0))

        def report() -> tf.Tensor:
            return tf.reshape(tf.py_function(lambda step: self.report(int(step), rank()), [done], tf.int64), [])

        with tf.control_dependencies([snapshot]):
            due = tf.logical_and(done > 0, tf.equal(done % every, 0))
            return tf.cond(due, report, lambda: tf.constant(0, tf.int64))

    def clock(self, after: tf.Tensor) -> tf.Tensor:
        """A timestamp taken once ``after`` (the gradient) is ready."""
        with tf.control_dependencies([after]):
            return tf.timestamp()

    def timed(self, name: str, started: tf.Tensor, payload: tf.Tensor) -> tf.Tensor:
        """``payload``, once the time since ``started`` is added to this tensor's compress seconds."""
        with tf.control_dependencies([payload]):
            elapsed = tf.timestamp() - started
        with tf.control_dependencies([self.seconds[name].assign_add(elapsed)]):
            return tf.identity(payload)

    def report(self, step: int, rank: Optional[int]) -> int:
        """Called from the graph (tf.py_function) by each tensor that starts step ``step + 1`` on a multiple of
        log_every; the first one reports, the others find it done."""
        with self._lock:
            if self._compressor.telemetry.due(step):
                self._compressor.telemetry.report(step, self.totals_at(step), rank)
        return 0

    def totals_at(self, step: int) -> Dict[str, Any]:
        """bytes_sent, bytes_dense, compress_seconds summed over tensors as of the end of ``step`` (see the
        module docstring), and the residual norm now: what core.telemetry.interval_scalars reads."""
        sent = dense = 0
        seconds = 0.0
        for name, counters in list(self._compressor._counter_vars.items()):
            live = counters.numpy()
            live_seconds = float(self.seconds[name].numpy()) if name in self.seconds else 0.0
            before = self.before[name].numpy() if name in self.before else None
            if before is not None and int(before[0]) == step and int(live[0]) > step:
                sent, dense, seconds = sent + int(before[1]), dense + int(before[2]), seconds + float(before[3])
            else:
                sent, dense, seconds = sent + int(live[1]), dense + int(live[2]), seconds + live_seconds
        squared = sum(self._compressor._residual_squared_norm(var)
                      for var in list(self._compressor._residual_vars.values()))
        return {"bytes_sent": sent, "bytes_dense": dense, "compress_seconds": seconds,
                "residual_norm": math.sqrt(squared)}

    def compress_seconds(self, name: str) -> Optional[float]:
        """This tensor's compress seconds so far, or None when it has no timing variable."""
        var = self.seconds.get(name)
        return None if var is None else float(var.numpy())

    def zero(self) -> None:
        """Start the timing over (reset, load: the counters start over too)."""
        for var in list(self.seconds.values()) + list(self.before.values()):
            var.assign(tf.zeros_like(var))
