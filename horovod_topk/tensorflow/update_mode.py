"""Update mode for Keras optimizers (Keras 2 and 3): each rank steps on its own gradient, the updates travel.

``hvd.DistributedOptimizer(keras_optimizer, compression=TopKEF(target="update"))`` and
``horovod.tensorflow.keras.DistributedOptimizer(...)`` build, in update mode, a subclass of the user's optimizer
class (same name and config, as Horovod's wrapper does, so a saved model loads without Horovod) whose one entry
point -- ``apply`` in Keras 3, ``apply_gradients`` in Keras 2 -- runs on every rank:

1. on the first trace, the ranks' agreement check under the name gradient mode gives each gradient's reduction, so
   ranks in different modes raise ``RankMismatch`` instead of waiting on different collectives;
2. one allreduce of this rank's count of NaN/Inf gradient entries; when any rank has one, every rank skips the step
   (parameters, optimizer state, residuals unchanged everywhere), as AMP's loss scaling skips one; a loss-scale
   optimizer with a dynamic scale (``LossScaleOptimizer``) is then handed NaN gradients on every rank, so that each
   lowers its scale as it would have had its own gradient overflowed (skipping without telling it would skip every
   later step too);
3. with the calibrated second moment (Keras's Adam/AdamW, the default there), one allreduce of every gradient's
   sketch and squared norm gives each tensor's noise share (core.update_mode), and the optimizer's ``update_step``
   first moves the variable's velocity so that its own update takes in ``share * g**2``;
   the user's optimizer steps on this rank's own gradient (its clipping, schedule and state are this rank's), the
   update is the variables before minus after;
4. each update goes through the compressor (error feedback, selection, allgather / sparse allreduce / compact
   encoding, Horovod's dense allreduce where core's plan says dense), keyed ``update.<variable>``, the
   allgather's in buckets of ``bucket_bytes``;
5. every rank sets each variable to (before - the averaged update): the same bytes on every rank.

Under ratio="auto", a step while auto holds dense or fp16 runs as gradient mode instead of 2-5 (the gradient
route, horovod_topk.tensorflow.gradient_route): the step branches on what one host call per step returns.

The math and the decisions are core's (core.update_mode, core.plan via ``TopKEF.start_group``); this module
only orders the TensorFlow ops (tensorflow.noise_share has the sketch's). The shared second moment is PyTorch's (it
computes torch's Adam): refused here.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from ..core import RankMismatch, check_name, fingerprint, mismatch_message
from ..core.update_mode import (
    NOISE_SHARE_NAME,
    NONFINITE_NAME,
    RouteStep,
    resolve_keras_second_moment,
    sketch_layout,
    update_tensor_names,
    with_nonfinite_count,
)
from . import gradient_route, keras3, noise_share

__all__ = ["distributed_optimizer", "update_keys", "second_moment_of", "SUM_REFUSAL"]

#: Why update mode takes op=hvd.Average only with Keras (whose optimizers' updates are not linear in the gradient).
SUM_REFUSAL = ("horovod-topk: TopKEF(target='update') averages the ranks' optimizer updates; use op=hvd.Average "
               "(a sum of P normalised updates is P times the step)")


def _refuse(op: Any, backward_passes_per_step: int, average: Any) -> None:
    """What update mode cannot do with a Keras optimizer, refused by name before training."""
    if op != average:
        raise ValueError(SUM_REFUSAL)
    if backward_passes_per_step != 1:
        raise ValueError("horovod-topk: TopKEF(target='update') with backward_passes_per_step > 1 is not supported "
                         "with Keras optimizers; use the optimizer's own gradient accumulation "
                         "(Keras 3: gradient_accumulation_steps) or target='gradient'")


def second_moment_of(compressor: Any, optimizer: Any) -> str:
    """TopKConfig.second_moment resolved for a Keras ``optimizer`` (core.update_mode.resolve_keras_second_moment):
    "calibrated" or "local"; what it cannot do is refused by name."""
    cls = type(optimizer)
    return resolve_keras_second_moment(compressor.config.second_moment, f"{cls.__module__}.{cls.__qualname__}",
                                       getattr(optimizer, "beta_2", None),
                                       getattr(optimizer, "gradient_accumulation_steps", None))


def _ops_of(applied: Any) -> List[Any]:
    """What an optimizer's apply returned (an op, a variable, None, a nest of them), as control dependencies."""
    return [a for a in tf.nest.flatten(applied) if a is not None]


def update_keys(variables: Sequence[Any]) -> List[str]:
    """The registry keys of the variables' update residuals (core.update_mode.update_tensor_names) from their
    names: Keras 3's path, Keras 2's name without the ``:0`` output suffix. Both carry Keras's layer numbering, so
    a checkpoint's residuals meet their variables in a new process that builds the same model."""
    from horovod.tensorflow.mpi_ops import _normalize_name

    names = []
    for variable in variables:
        name = getattr(variable, "path", None) or variable.name
        names.append(_normalize_name(name[:-2] if name.endswith(":0") else name))
    return update_tensor_names(names)


class UpdateStep:
    """One Keras optimizer's update-mode step: ``__call__(local_apply, grads, variables)``.

    Args:
        compressor: the TopKEF (``target="update"``) that holds the update residuals.
        process_set: Horovod's process set of the wrapped optimizer.
        scales_loss: the optimizer lowers a dynamic loss scale when handed non-finite gradients (it then sees a
            skipped step's gradients as NaN; a fixed-scale one would apply them).
        sketch_width: the calibrated second moment's sketch buckets per tensor; None for each rank's own
            (``"local"``).
    """

    def __init__(self, compressor: Any, process_set: Any, scales_loss: bool = False,
                 sketch_width: Optional[int] = None) -> None:
        self.compressor = compressor
        self.process_set = process_set
        #: Whether the optimizer is a loss-scale optimizer, which must see a skipped step's non-finite gradients.
        self.scales_loss = scales_loss
        self.sketch_width = sketch_width
        #: While the user's optimizer steps under the calibrated second moment: each tf.Variable's noise share (by
        #: id), read by the optimizer's update_step (share_of); empty otherwise.
        self._shares: Dict[int, tf.Tensor] = {}

    def share_of(self, variable: Any) -> Optional[tf.Tensor]:
        """The noise share of ``variable`` (a Keras or tf.Variable) in the step being built; None outside one."""
        if not self._shares:
            return None
        return self._shares.get(id(keras3.tf_variables([variable])[0]))

    def __call__(self, local_apply: Callable[[List[Any], List[Any]], Any], grads: Sequence[Any],
                 variables: Sequence[Any], step: Any = None,
                 optimizer_variables: Callable[[], Sequence[Any]] = lambda: ()) -> tf.Tensor:
        """Run the step; True where it was taken, False where some rank's gradient was non-finite (skipped).
        A rank outside the process set steps on its own, as Horovod's gradient reduction leaves it. ``step``: the
        optimizer step about to be taken (its iterations + 1), the calibrated sketch's signs' step.
        ``optimizer_variables``: the optimizer's variables, built (ratio="auto"'s gradient route averages the
        ranks' own state among them)."""
        if not self.process_set.included():
            applied = local_apply(list(grads), list(variables))
            with tf.control_dependencies(_ops_of(applied)):
                return tf.constant(True)
        # keys over every variable, before those without a gradient drop out: a key never moves to another one
        all_keys = update_keys(variables)
        triples = [(g, v, key) for g, v, key in zip(grads, variables, all_keys) if g is not None]
        if not triples:
            return tf.constant(False)
        grads, variables, keys = [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]
        targets = keras3.tf_variables(list(variables))  # the tf.Variables (Keras 3 wraps one in each)
        self._check_modes(grads, targets)
        if self.compressor.auto is None:
            return self._update_step(local_apply, grads, variables, targets, keys, step, lambda g: g)
        # ratio="auto": dense and fp16 steps run as gradient mode (horovod_topk.tensorflow.gradient_route)
        route = gradient_route.GradientRoute(self.compressor, self.process_set, scope=all_keys[0])
        code = route.code()
        residuals = route.residuals(targets, keys)

        def on_route() -> tf.Tensor:
            entered = route.enter(code, gradient_route.own_state(optimizer_variables()), targets, residuals)
            with tf.control_dependencies([entered]):  # the residuals' mean out before the exchange adds them
                dense = [tf.ensure_shape(tf.convert_to_tensor(g), t.shape) for g, t in zip(grads, targets)]
            averaged = self._exchange(dense, keys, held=True)
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(a)) for a in averaged])

            def take() -> tf.Tensor:
                with tf.control_dependencies(_ops_of(local_apply(averaged, variables))):
                    return tf.constant(True)

            return self._branch(finite, take, lambda: self._skip(local_apply, grads, variables))

        def in_update_mode() -> tf.Tensor:
            return self._update_step(local_apply, grads, variables, targets, keys, step,
                                     lambda g: route.absorb(code, g, residuals))

        on = tf.logical_and(tf.not_equal(code, RouteStep.LOCAL), tf.not_equal(code, RouteStep.LEAVE))
        return self._branch(on, on_route, in_update_mode)

    @staticmethod
    def _branch(pred: tf.Tensor, true_fn: Callable[[], tf.Tensor], false_fn: Callable[[], tf.Tensor]) -> tf.Tensor:
        """tf.cond, or in eager mode the branch itself (the ranks agree on ``pred``, so they branch alike)."""
        if tf.executing_eagerly():
            return true_fn() if bool(pred) else false_fn()
        return tf.cond(pred, true_fn, false_fn)

    def _update_step(self, local_apply: Callable[[List[Any], List[Any]], Any], grads: List[Any],
                     variables: List[Any], targets: List[Any], keys: List[str], step: Any,
                     absorb: Callable[[List[Any]], List[Any]]) -> tf.Tensor:
        """The step in update mode: steps 2-5 of the module's docstring. ``absorb``: the gradients the step takes,
        from this rank's own (the gradient route's leftovers joined on leaving it: before the non-finite check, as
        PyTorch joins them into ``.grad``, so that a leftover never stays behind as an update residual when the step
        leaving the route is skipped -- it goes with that step's gradient)."""
        grads = absorb(grads)
        finite, sketches = self._agree_finite(grads, step)

        def take() -> tf.Tensor:
            before = [tf.identity(t.read_value()) for t in targets]
            calibrating = self._calibrate(sketches, targets, keys) if sketches is not None else []
            with tf.control_dependencies(before + calibrating):
                try:
                    applied = local_apply(grads, variables)
                finally:
                    self._shares = {}
            with tf.control_dependencies(_ops_of(applied)):
                updates = [b - t.read_value() for b, t in zip(before, targets)]
            averaged = self._exchange(updates, keys)
            assigns = [t.assign(b - a) for t, b, a in zip(targets, before, averaged)]
            if self.sketch_width:  # the sketch's bytes in each update's traffic (stats())
                nbytes = 4 * (self.sketch_width + 1)
                assigns += [self.compressor.count_sent(key, tuple(t.shape), nbytes) for t, key in zip(targets, keys)]
            with tf.control_dependencies(assigns):
                return tf.constant(True)

        return self._branch(finite, take, lambda: self._skip(local_apply, grads, variables))

    def _skip(self, local_apply: Callable[[List[Any], List[Any]], Any], grads: Sequence[Any],
              variables: Sequence[Any]) -> tf.Tensor:
        """A step some rank's gradient made non-finite: nothing changes, except that a loss-scale optimizer is
        handed NaN gradients on every rank, so that each lowers its scale."""
        if not self.scales_loss:
            return tf.constant(False)
        dense = [tf.convert_to_tensor(g) for g in grads]  # an embedding's IndexedSlices too
        nan = [tf.fill(tf.shape(g), tf.constant(float("nan"), g.dtype)) for g in dense]
        applied = local_apply(nan, variables)  # it lowers its loss scale and leaves the variables as they are
        with tf.control_dependencies(_ops_of(applied)):
            return tf.constant(False)

    def _calibrate(self, summed: tf.Tensor, targets: Sequence[Any], keys: Sequence[str]) -> List[Any]:
        """The calibrated second moment's share of every tensor (core.update_mode) from the ranks' summed sketches;
        kept for the optimizer's update_step (share_of) and assigned to the telemetry variables, whose assigns are
        returned. The gradients are finite here (the step's branch)."""
        assert self.sketch_width is not None
        layout = sketch_layout(len(targets), self.sketch_width)
        shares = noise_share.noise_shares(tf.reshape(summed, [layout.tensors, layout.width + 1]),
                                          self.process_set.size())
        self._shares = {id(t): shares[i] for i, t in enumerate(targets)}
        return [self.compressor.noise_share_variable(key).assign(shares[i]) for i, key in enumerate(keys)]

    def _agree_finite(self, grads: Sequence[Any], step: Any) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
        """Whether every rank's gradients are finite, and under the calibrated second moment the ranks' summed
        sketches (each tensor's count sketch and squared norm, core.update_mode): one allreduce (Sum) carries the
        ranks' non-finite counts and the sketches, so a step waits for one collective before its local step, not
        two. A non-finite gradient makes its sketch non-finite too; the step's branch is not taken then."""
        from horovod.tensorflow import _allreduce
        from horovod.tensorflow.mpi_ops import Sum

        counts = []
        for g in grads:
            values = g.values if isinstance(g, tf.IndexedSlices) else g
            if values.dtype.is_floating:
                counts.append(tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(values)), tf.float32)))
        count = tf.reshape(tf.add_n(counts) if counts else tf.constant(0.0), [1])
        if not self.sketch_width:
            total = _allreduce(count, name=NONFINITE_NAME, op=Sum, ignore_name_scope=True,
                               process_set=self.process_set)
            return tf.equal(tf.reshape(total, []), 0.0), None
        if step is None:
            raise ValueError("horovod-topk: the calibrated second moment needs the optimizer's step")
        width = sketch_layout(len(grads), self.sketch_width).width
        rows = [noise_share.sketch(g, width, noise_share.sketch_salt(step, position))
                for position, g in enumerate(grads)]
        summed = _allreduce(tf.concat([count, tf.reshape(tf.stack(rows), [-1])], axis=0),
                            name=with_nonfinite_count(NOISE_SHARE_NAME), op=Sum, ignore_name_scope=True,
                            process_set=self.process_set)
        return tf.equal(summed[0], 0.0), summed[1:]

    def _exchange(self, updates: Sequence[tf.Tensor], keys: Sequence[str], held: bool = False) -> List[tf.Tensor]:
        """The ranks' average of every update through the compressor, in buckets of bucket_bytes (one allgather per
        bucket, horovod_topk.tensorflow.buckets: the updates are all ready at once), or Horovod's dense allreduce
        where core plans a dense tensor. ``held``: gradients on the gradient route (dense or fp16 only)."""
        from horovod.tensorflow import _allreduce
        from horovod.tensorflow.mpi_ops import Average

        marked = [self.compressor.compress(u) for u in updates]
        reduced = self.compressor.start_group(
            [(alias, pending, key) for (alias, pending), key in zip(marked, keys)], self.compressor.config.bucket_bytes,
            op_name="average", prescale_factor=1.0, postscale_factor=1.0, process_set=self.process_set, held=held)
        out = []
        for update, key, result in zip(updates, keys, reduced):
            if result is None:  # dense: Horovod's own allreduce
                result = _allreduce(update, name=f"{key}.dense", op=Average, ignore_name_scope=True,
                                    process_set=self.process_set)
            out.append(tf.reshape(result, tf.shape(update)))
        return out

    def _check_modes(self, grads: Sequence[Any], targets: Sequence[Any]) -> None:
        """At trace time, one eager fingerprint allgather per gradient, as gradient mode runs one per gradient when
        it traces its reductions: the ranks' first traces issue these checks in the same order, so a rank in
        gradient mode and one in update mode meet in them, see each other's configuration and raise RankMismatch
        instead of waiting on different collectives. Named after the gradient's graph name (a stable, valid name
        on every rank). Eager gradients have no graph name (gradient mode sends them dense, unchecked): nothing to
        meet there."""
        from horovod.tensorflow.mpi_ops import _normalize_name, allgather

        for grad, target in zip(grads, targets):
            source = None if tf.executing_eagerly() else getattr(grad, "name", None)
            if source is None:
                continue
            name = _normalize_name(source)
            if name in self.compressor.checked_gradients:  # once per name, until a load or an elastic reset
                continue
            self.compressor.checked_gradients.add(name)
            with tf.init_scope():
                row = tf.constant([fingerprint(self.compressor.config, tuple(target.shape), grad.dtype, 0, None)],
                                  tf.int64)
                rows = allgather(row, name=check_name(name), ignore_name_scope=True,
                                 process_set=self.process_set).numpy()
            message = mismatch_message(name, rows.tolist())
            if message is not None:
                raise RankMismatch(message)


def _velocity(optimizer: Any, variable: Any) -> Any:
    """Adam's second-moment slot of ``variable``: Keras 3 indexes its slots by variable, Keras 2 (tf_keras) by key."""
    if hasattr(optimizer, "_get_variable_index"):
        return optimizer._velocities[optimizer._get_variable_index(variable)]
    return optimizer._velocities[optimizer._index_dict[optimizer._var_key(variable)]]


class _CallableList(list):
    """The optimizer's variables, readable as Keras 3's property and as the method Horovod's elastic
    ``TensorFlowKerasState`` calls (``optimizer.variables()``), as Horovod's own Keras wrapper provides."""

    def __call__(self) -> "_CallableList":
        return self


def distributed_optimizer(optimizer: Any, *, compression: Any, process_set: Any, op: Any,
                          backward_passes_per_step: int = 1) -> Any:
    """A copy of the Keras ``optimizer`` (Keras 2 or 3) that trains in update mode with ``compression``.

    Horovod's reduction options (``groups``, ``sparse_as_dense``, ``gradient_predivide_factor``, devices) concern a
    gradient allreduce, which update mode does not run: the updates are exchanged one per variable."""
    from horovod.tensorflow.mpi_ops import Average

    from .compressor import TopKEF

    compressor = compression if isinstance(compression, TopKEF) else compression.default()
    _refuse(op, backward_passes_per_step, Average)
    calibrated = second_moment_of(compressor, optimizer) == "calibrated"
    # Keras 3's LossScaleOptimizer and Keras 2's wrap the user's optimizer as ``inner_optimizer``; Keras 2's may
    # have a fixed scale (dynamic=False), which applies whatever it is handed
    scales_loss = hasattr(optimizer, "inner_optimizer") and bool(getattr(optimizer, "dynamic", True))
    run = UpdateStep(compressor, process_set, scales_loss=scales_loss,
                     sketch_width=compressor.config.second_moment_sketch if calibrated else None)
    base = type(optimizer)

    if keras3.is_keras3_optimizer(optimizer):
        def apply(self: Any, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
            variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
            if not self.built:  # before the cond: variables are created outside its branches
                self.build(variables)
                self.built = True
            taken = run(lambda g, v: super(cls, self).apply(g, v), list(grads), variables, step=self.iterations + 1,
                        optimizer_variables=lambda: self.variables)
            with tf.control_dependencies([taken]):  # what a graph-mode caller runs must run the step
                return tf.identity(self.iterations)

        members = {"apply": apply}
    else:
        def apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            pairs: List[Tuple[Any, Any]] = list(grads_and_vars)
            if compressor.auto is not None:  # the gradient route reads the state before the step would create it
                with tf.init_scope():
                    self.build([v for _, v in pairs])
            taken = run(lambda g, v: super(cls, self).apply_gradients(list(zip(g, v)), *args, **kwargs),
                        [g for g, _ in pairs], [v for _, v in pairs], step=self.iterations + 1,
                        optimizer_variables=lambda: self.variables)
            with tf.control_dependencies([taken]):  # what a graph-mode caller runs must run the step
                return tf.identity(self.iterations)

        members = {"apply_gradients": apply_gradients}

    def variables(self: Any) -> _CallableList:
        found = super(cls, self).variables
        return _CallableList(found() if callable(found) else found)

    def register_local_var(self: Any, var: Any) -> None:
        """Horovod's wrapper keeps such variables' gradients local; update mode exchanges every variable's update."""
        raise ValueError("horovod-topk: register_local_var is not supported with TopKEF(target='update'): every "
                         "variable's update is exchanged; use target='gradient' for rank-local variables")

    def update_step(self: Any, gradient: Any, variable: Any, *args: Any) -> Any:
        """The optimizer's own step of one variable, its velocity first moved so that the step feeds it the
        squared gradient times the noise share (core.update_mode.KERAS_CALIBRATED: its v update is linear). An
        embedding's IndexedSlices is summed to its dense gradient first (the share is of that)."""
        share = run.share_of(variable)
        if share is not None:
            gradient = tf.convert_to_tensor(gradient)
            velocity = _velocity(self, variable)
            beta_2 = float(self.beta_2)
            squared = tf.square(tf.cast(gradient, velocity.dtype))
            velocity.assign_add(squared * (tf.cast(share, velocity.dtype) - 1.0) * ((1.0 - beta_2) / beta_2))
        return super(cls, self).update_step(gradient, variable, *args)

    members.update({"variables": property(variables), "register_local_var": register_local_var,
                    "__module__": base.__module__})
    if calibrated:
        members["update_step"] = update_step
    cls = type(base.__name__, (base,), members)
    return cls.from_config(optimizer.get_config())
