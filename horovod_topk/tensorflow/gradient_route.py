"""Update mode's gradient route in TensorFlow (core.update_mode, "The gradient route"): while ratio="auto" holds
dense or fp16, a step of update mode runs as gradient mode, and what changes hands at the route's edges.

A traced step holds both routes, as it holds every density's exchange: once per step, after ratio="auto"'s tick has
put its choice in force, one host call (:meth:`GradientRoute.code`) reads it and returns the step's
core.update_mode.RouteStep, which the step branches on (the same on every rank: the choice and the scopes are).

- On the route the gradients go through the compressor under their update records' names (one residual per
  variable whichever the route: fp16's error feedback keeps its own there), straight from backward, and the user's
  optimizer steps on the averaged gradient, which with the same state on every rank gives every rank the same update.
- Entering (:meth:`GradientRoute.enter`): every rank's own optimizer state (:func:`own_state`) becomes the ranks'
  mean, and so does each update residual, which is applied to the variables and zeroed, before the gradients'
  exchange reads the residuals.
- Leaving (:meth:`GradientRoute.absorb`): what fp16 left in the residuals is gradient; it joins this rank's own
  gradient before the local step, and the residuals start over as update residuals.

Which optimizers' last step ran the route is ratio="auto"'s state (AutoDensity.shared_scopes), saved with it by
``state_dict()`` / ``gather_state``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..core.update_mode import RouteStep, route_step, share_name
from . import keras3

__all__ = ["GradientRoute", "own_state"]


def own_state(optimizer_variables: Sequence[Any]) -> List[Any]:
    """The optimizer's state that is each rank's own in update mode: its floating variables of one or more
    dimensions (moments, accumulators: one per trained variable or per entry). Its scalars -- the step count, the
    learning rate -- are the same on every rank and stay as they are."""
    return [v for v in keras3.tf_variables(list(optimizer_variables))
            if isinstance(v, tf.Variable) and v.dtype.is_floating and v.shape.rank]


class GradientRoute:
    """The route of one update-mode optimizer's steps.

    Args:
        compressor: the TopKEF (ratio="auto") whose ``auto`` holds the choice and whose residuals hold the updates'.
        process_set: Horovod's process set of the optimizer.
        scope: the optimizer's name in ``auto.shared_scopes``.
    """

    def __init__(self, compressor: Any, process_set: Any, scope: str) -> None:
        self.compressor = compressor
        self.process_set = process_set
        self.scope = scope

    def code(self) -> tf.Tensor:
        """This step's core.update_mode.RouteStep (an int32 scalar), after ratio="auto"'s tick of the step."""
        position = self.compressor.auto_position(f"{self.scope}.route", self.process_set)
        if tf.executing_eagerly():
            return tf.constant(self._host_code(), tf.int32)
        code = tf.py_function(lambda _: np.int32(self._host_code()), [position], tf.int32, name="topk_update_route")
        code.set_shape([])
        return code

    def _host_code(self) -> int:
        return route_step(self.compressor.auto, self.scope)

    def residuals(self, targets: Sequence[Any], keys: Sequence[str]) -> List[Optional[tf.Variable]]:
        """Each variable's update residual, None where its update goes dense whatever auto's choice."""
        size = self.process_set.size()
        return [self.compressor.auto_residual(key, tuple(t.shape), t.dtype, size) for t, key in zip(targets, keys)]

    def enter(self, code: tf.Tensor, state: Sequence[tf.Variable], targets: Sequence[Any],
              residuals: Sequence[Optional[tf.Variable]]) -> tf.Operation:
        """On ENTER: the ranks' mean of every own-state variable and of every residual, the residual's mean
        subtracted from its variable and the residual zeroed; on RESYNC the own state only; nothing otherwise."""
        def share(with_residuals: bool) -> tf.Tensor:
            """The means, one allreduce per dtype over every tensor flattened into one (entering runs rarely but
            is traced into every graph: one collective op instead of one per tensor)."""
            from horovod.tensorflow.mpi_ops import Average, _allreduce

            sources = [(v, None) for v in state]
            if with_residuals:
                sources += [(r, t) for t, r in zip(targets, residuals) if r is not None]
            done: List[Any] = []
            for dtype in sorted({v.dtype for v, _ in sources}, key=lambda d: d.name):
                group = [(v, t) for v, t in sources if v.dtype == dtype]
                values = [tf.reshape(v.read_value(), [-1]) for v, _ in group]
                means = tf.split(_allreduce(tf.concat(values, 0), name=share_name(f"{self.scope}.{dtype.name}", 0),
                                            op=Average, ignore_name_scope=True, process_set=self.process_set),
                                 [v.shape.num_elements() for v, _ in group])
                for (variable, target), mean in zip(group, means):
                    if target is None:  # the optimizer's own state: the ranks' mean
                        done.append(variable.assign(tf.reshape(mean, tf.shape(variable))))
                    else:  # a residual: its mean applied to the variable, the residual emptied
                        done.append(target.assign_sub(tf.reshape(tf.cast(mean, target.dtype), tf.shape(target))))
                        done.append(variable.assign(tf.zeros_like(variable)))
            with tf.control_dependencies(done):
                return tf.constant(True)

        if tf.executing_eagerly():
            value = int(code)
            return tf.group(share(True)) if value == RouteStep.ENTER else \
                tf.group(share(False)) if value == RouteStep.RESYNC else tf.no_op()
        return tf.group(tf.cond(tf.equal(code, RouteStep.ENTER), lambda: share(True),
                                lambda: tf.cond(tf.equal(code, RouteStep.RESYNC), lambda: share(False),
                                                lambda: tf.constant(False))))

    def absorb(self, code: tf.Tensor, grads: Sequence[Any], residuals: Sequence[Optional[tf.Variable]]) -> List[Any]:
        """On LEAVE: each gradient plus what its residual holds (gradient, fp16's leftovers), the residual zeroed;
        the gradients as they are otherwise. An embedding's IndexedSlices gets the residual as rows of its own."""
        def joined() -> List[Any]:
            out, zeroed = [], []
            for g, residual in zip(grads, residuals):
                if residual is None:
                    out.append(g)
                    continue
                value = residual.read_value()
                if isinstance(g, tf.IndexedSlices):
                    rows = tf.reshape(tf.cast(value, g.values.dtype), tf.concat([[-1], tf.shape(g.values)[1:]], 0))
                    index = tf.range(tf.shape(rows)[0], dtype=g.indices.dtype)
                    out.append(tf.IndexedSlices(tf.concat([g.values, rows], 0), tf.concat([g.indices, index], 0),
                                                g.dense_shape))
                else:
                    out.append(g + tf.reshape(tf.cast(value, g.dtype), tf.shape(g)))
                with tf.control_dependencies([value]):
                    zeroed.append(residual.assign(tf.zeros_like(residual)))
            with tf.control_dependencies(zeroed):
                return [tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape)
                        if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g in out]

        if all(r is None for r in residuals):
            return list(grads)
        if tf.executing_eagerly():
            return joined() if int(code) == RouteStep.LEAVE else list(grads)
        out = tf.cond(tf.equal(code, RouteStep.LEAVE), joined, lambda: list(grads))
        # what a cond returns has the shapes both branches agree on: the gradients' own, given back
        return [tf.IndexedSlices(tf.ensure_shape(o.values, [None] + g.values.shape[1:]), o.indices, g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else tf.ensure_shape(o, g.shape) for g, o in zip(grads, out)]
