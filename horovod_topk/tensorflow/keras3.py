"""Keras 3 behind Horovod 0.28.1's TensorFlow API: ``DistributedGradientTape`` and the Keras ``DistributedOptimizer``.

Horovod 0.28.1 predates Keras 3 (what ``tf.keras`` is since TensorFlow 2.16) and fails on it in two ways:

- ``hvd.DistributedGradientTape(...).gradient(loss, keras3_variables)`` raises ``AttributeError: 'Variable' object
  has no attribute 'ref'`` (Horovod issue #4290): it keys gradients by ``tf.Variable.ref()``, which Keras 3
  variables do not have. Each Keras 3 variable wraps one ``tf.Variable`` (its ``value`` on the TensorFlow backend)
  and the tape's gradient with respect to either is the same, so the tape is handed those.
- ``horovod.tensorflow.keras.DistributedOptimizer`` (and ``hvd.DistributedOptimizer``, which delegates to it)
  reduces gradients in hooks Keras 3 never calls (``get_gradients``, ``_aggregate_gradients``): ``model.fit``
  then trains every worker on its own gradients, silently. :func:`distributed_optimizer` instead reduces them in
  ``apply``, the one method every Keras 3 update goes through (``apply_gradients`` and ``model.fit`` included),
  with Horovod's own reduction function, so compressors (TopKEF too) and the options mean what they mean there.

:mod:`horovod_topk.tensorflow.routing` installs both adaptations; they apply to Keras 3 objects only.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

__all__ = ["is_keras3_optimizer", "is_keras3_variable", "tf_variables", "distributed_optimizer"]


def _keras3() -> Optional[Any]:
    """The ``keras`` module if Keras 3 is loaded (nothing is imported here: a Keras 3 object implies it is)."""
    keras = sys.modules.get("keras")
    version = getattr(keras, "__version__", "0")
    return keras if keras is not None and int(version.split(".")[0]) >= 3 else None


def is_keras3_optimizer(optimizer: Any) -> bool:
    keras = _keras3()
    return keras is not None and isinstance(optimizer, keras.optimizers.Optimizer)


def is_keras3_variable(value: Any) -> bool:
    keras = _keras3()
    return keras is not None and isinstance(value, keras.Variable)


def tf_variables(values: Any) -> Any:
    """``values`` (any nest) with each Keras 3 variable replaced by the ``tf.Variable`` it wraps."""

    def unwrap(value: Any) -> Any:
        if not is_keras3_variable(value):
            return value
        inner = value.value
        if not isinstance(inner, tf.Variable):
            raise TypeError(f"horovod-topk: Keras 3 variable {value.path!r} is not backed by a tf.Variable "
                            f"(got {type(inner).__name__}): is the Keras backend TensorFlow?")
        return inner

    return tf.nest.map_structure(unwrap, values)


def adapt_gradient_tape(tape: Any) -> Any:
    """Make a tape returned by ``hvd.DistributedGradientTape`` accept Keras 3 variables as sources.

    Horovod builds the tape's class with ``super(self.__class__, self)`` calls, which a subclass would send into a
    loop; the two methods are therefore replaced on the instance."""
    gradient, register_local_source = tape.gradient, tape.register_local_source

    def gradient_of(target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False) -> Any:
        return gradient(target, tf_variables(sources), output_gradients, use_generic_names)

    tape.gradient = gradient_of
    tape.register_local_source = lambda source: register_local_source(tf_variables(source))
    return tape


def distributed_optimizer(
    optimizer: Any,
    *,
    name: Optional[str],
    compression: Any,
    sparse_as_dense: bool,
    op: Any,
    gradient_predivide_factor: float,
    groups: Any,
    process_set: Any,
    backward_passes_per_step: int = 1,
    device_dense: str = "",
    device_sparse: str = "",
) -> Any:
    """A copy of the Keras 3 ``optimizer`` whose ``apply`` first reduces the gradients over ``process_set``.

    Like Horovod's Keras wrapper, the result is an instance of a class with the optimizer's own class name, made
    from its config, so a saved model loads without Horovod. Gradient accumulation over several backward passes
    is not done here (Keras 3 has ``gradient_accumulation_steps`` for that); it is refused rather than ignored."""
    import horovod.tensorflow as hvd

    if backward_passes_per_step != 1:
        raise ValueError("horovod-topk: backward_passes_per_step > 1 is not supported with Keras 3 optimizers; use "
                         "the optimizer's own gradient_accumulation_steps")
    if isinstance(groups, list):
        groups = [tf_variables(list(group)) for group in groups]
    reduce: Callable[..., List[Any]] = hvd._make_allreduce_grads_fn(
        name or f"Distributed{type(optimizer).__name__}", device_dense, device_sparse, compression, sparse_as_dense,
        op, gradient_predivide_factor, groups, process_set)
    base = type(optimizer)

    def apply(self: Any, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        grads = list(grads)
        reduced = reduce(grads, tf_variables(list(variables))) if grads else grads
        return super(cls, self).apply(reduced, trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__,
                                        "_horovod_topk_distributed": True})
    return cls.from_config(optimizer.get_config())
