"""``TopKEF`` for ``horovod.tensorflow``: DistributedGradientTape, DistributedOptimizer and the Keras wrapper.

Same design as the PyTorch one (see horovod_topk.core.pending): ``compress`` marks, the routing of
:mod:`horovod_topk.tensorflow.routing` calls :meth:`TopKEF.start_reduction` where Horovod launches its allreduce.
Horovod runs that inside a ``tf.function``, so the state lives in ``tf.Variable``s created once per tensor (under
``tf.init_scope``, i.e. outside the traced graph) and updated by ops in the graph: the residual, and an int64
counter vector (steps, bytes sent, bytes dense, non-finite steps) that ``stats()`` reads back.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf

from ..core import (
    PayloadLayout,
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
    sample_size,
)
from ..core.policy import tensor_payload_layout
from . import encoding, ops

__all__ = ["TopKEF"]

_WIRE_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16,
                "float8": tf.dtypes.experimental.float8_e4m3fn}


class TopKEF(TopKEFBase[Any]):
    """Top-K with error feedback for ``hvd.DistributedGradientTape(tape, compression=TopKEF)`` and
    ``hvd.DistributedOptimizer(opt, compression=TopKEF(ratio=0.001))``.

    Residual keys are the names Horovod gives the reduction (the gradient's graph name, or ``grad_<i>`` with
    ``use_generic_names``): the same program gives the same keys on every rank and every run.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # k is part of the traced graph here (static shapes), so a k that changes with the step (warm-up) and the
        # extra momentum state are PyTorch-only for now: refuse them rather than ignore them.
        if self.config.warmup_steps:
            raise ValueError("horovod-topk: warmup_steps is not supported by the TensorFlow TopKEF yet (PyTorch only)")
        if self.config.momentum:
            raise ValueError("horovod-topk: momentum correction is not supported by the TensorFlow TopKEF yet "
                             "(PyTorch only)")
        if self.config.spike_guard is not None:
            raise ValueError("horovod-topk: spike_guard is not supported by the TensorFlow TopKEF yet (PyTorch only)")
        if self.config.exchange == "sparse_allreduce":
            raise ValueError("horovod-topk: exchange='sparse_allreduce' is PyTorch-only for now; the TensorFlow "
                             "TopKEF uses the allgather (exchange='auto' or 'allgather')")
        #: Per tensor name: the residual variable and the counter variable (see _counter_values).
        # Kept in the dicts of a tf.Module so that tf.train.Checkpoint can save them (see ``trackable``); adding
        # through these tracked dicts is what lets a restore reach variables created after it.
        self._trackable = tf.Module(name="horovod_topk")
        self._trackable.residuals = {}
        self._trackable.counters = {}
        self._residual_vars: Dict[str, tf.Variable] = self._trackable.residuals
        self._counter_vars: Dict[str, tf.Variable] = self._trackable.counters

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
        """The dense reduced gradient, computed from one allgather of Top-K payloads; None to go dense."""
        from horovod.tensorflow.mpi_ops import allgather

        world_size = process_set.size()
        scale = reduction_scale(op_name, prescale_factor, postscale_factor, world_size)
        if any(d is None for d in pending.shape):
            pending.route = "dense"  # a shape known only at run time cannot have a fixed k
            return None
        numel = int(np.prod(pending.shape, dtype=np.int64))
        wire_dtype = _WIRE_DTYPES.get(self.config.value_dtype or "", tensor.dtype) if tensor.dtype.is_floating else tensor.dtype
        plan = plan_tensor(name, numel, tensor.dtype.is_floating, self.config, world_size=world_size,
                           value_itemsize=wire_dtype.size, grad_itemsize=tensor.dtype.size)
        record = self.registry.record(name, pending.shape)
        counters = self._counters(name, record)
        if not record.verified:
            self._verify(name, record, counters, tensor.dtype, plan.k, process_set)
        dense_nbytes = numel * tensor.dtype.size
        if not plan.compressed:
            pending.route = "dense"
            counters.assign_add(tf.constant([1, dense_nbytes, dense_nbytes, 0], tf.int64))
            return None

        pending.route = "topk"
        assert plan.k is not None
        residual = self._residual(name, record, numel, ops.residual_dtype(tensor.dtype))
        samples = sample_size(plan.k, numel) if self.config.selector == "sampled" else 0
        layout = tensor_payload_layout(self.config, plan.k, numel, wire_dtype.size)
        # float8 values are selected exactly; the compact encoder puts float8's rounding back into the residual
        select_dtype = ops.residual_dtype(tensor.dtype) if layout.scaled else wire_dtype
        # NaN/Inf entries are sent and never enter the residual (ops.compensate_nonfinite)
        indices, values, new_residual, finite = ops.error_feedback_step(tensor, residual, plan.k, select_dtype, samples)
        if layout.compact:
            payload, new_residual = encoding.encode(indices, values, new_residual, layout)
        else:
            payload = ops.pack(indices, values, layout)
        with tf.control_dependencies([residual.assign(new_residual)]):
            payload = tf.identity(payload)
        gathered = allgather(payload, name=allgather_name(name), ignore_name_scope=True, process_set=process_set)
        checks = [
            tf.debugging.assert_equal(
                tf.size(gathered), world_size * layout.nbytes, message=layout.mismatch_message(name, world_size)
            ),
            counters.assign_add(tf.stack([tf.constant(1, tf.int64), tf.constant(layout.nbytes, tf.int64),
                                          tf.constant(dense_nbytes, tf.int64), 1 - tf.cast(finite, tf.int64)])),
        ]
        with tf.control_dependencies(checks):
            unpack = encoding.decode if layout.compact else ops.unpack
            all_indices, all_values = unpack(gathered, world_size, layout, wire_dtype)
        dense = ops.scatter_sum(all_indices, all_values, numel, ops.residual_dtype(tensor.dtype))
        if scale != 1.0:
            dense = dense * tf.cast(scale, dense.dtype)
        return tf.reshape(tf.cast(dense, tensor.dtype), pending.shape)

    def _verify(self, name: str, record: TensorRecord[Any], counters: tf.Variable, dtype: tf.DType,
                k: Optional[int], process_set: Any) -> None:
        """Check once (at trace time, or on the first eager step) that every rank agrees about this tensor
        (core.consistency), before any of its collectives is built: a disagreement raises RankMismatch on every
        rank instead of a hang. The fingerprint allgather runs eagerly (tf.init_scope), in program order, which
        is the same on every rank."""
        from horovod.tensorflow.mpi_ops import allgather

        record.verified = True
        with tf.init_scope():
            step = int(counters.numpy()[0])
            row = tf.constant([fingerprint(self.config, record.shape, dtype, step, k)], tf.int64)
            rows = allgather(row, name=check_name(name), ignore_name_scope=True, process_set=process_set).numpy()
        message = mismatch_message(name, rows.tolist())
        if message is not None:
            raise RankMismatch(message)

    # ---- variables -----------------------------------------------------------------------------------------
    def _residual(self, name: str, record: TensorRecord[Any], numel: int, dtype: tf.DType) -> tf.Variable:
        var = self._residual_vars.get(name)
        if var is None:
            initial = np.zeros(numel, dtype.as_numpy_dtype) if record.residual is None else record.residual
            if np.shape(initial) != (numel,):
                raise ValueError(f"horovod-topk: the residual of {name!r} has {np.size(initial)} elements, the "
                                 f"gradient {numel} (a state_dict of another model?)")
            with tf.init_scope():  # created once, outside any traced function
                var = tf.Variable(initial.astype(dtype.as_numpy_dtype), trainable=False, name="topk_residual")
            self._residual_vars[name] = var
        record.residual = var
        return var

    def _counters(self, name: str, record: TensorRecord[Any]) -> tf.Variable:
        var = self._counter_vars.get(name)
        if var is None:
            with tf.init_scope():
                var = tf.Variable(self._counter_values(record), dtype=tf.int64, trainable=False,
                                  name="topk_counters")
            self._counter_vars[name] = var
        return var

    @staticmethod
    def _counter_values(record: TensorRecord[Any]) -> list:
        """The counter variable's layout: (steps, bytes sent, bytes dense, non-finite steps)."""
        return [record.steps, record.bytes_sent, record.bytes_dense, record.nonfinite_steps]

    def _refresh_counters(self) -> None:
        for name, var in self._counter_vars.items():
            record = self.registry.records.get(name)
            if record is not None:
                record.steps, record.bytes_sent, record.bytes_dense, record.nonfinite_steps = (
                    int(v) for v in var.numpy()
                )

    def _after_load(self) -> None:
        for name in set(self._counter_vars) - set(self.registry.records):  # not in the loaded state: start over
            self._counter_vars[name].assign(tf.zeros_like(self._counter_vars[name]))
            if name in self._residual_vars:
                self._residual_vars[name].assign(tf.zeros_like(self._residual_vars[name]))
        for name, record in self.registry.records.items():
            if name in self._counter_vars:
                self._counter_vars[name].assign(self._counter_values(record))
            if name in self._residual_vars and record.residual is not None:
                self._residual_vars[name].assign(record.residual)
                record.residual = self._residual_vars[name]

    def reset(self) -> None:
        super().reset()
        for var in self._counter_vars.values():
            var.assign(tf.zeros_like(var))
        for var in self._residual_vars.values():
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
