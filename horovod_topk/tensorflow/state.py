"""The compressor's state variables (residuals, momentum buffers, counters, telemetry), created the way that
costs the user's ``tf.function`` no second trace.

Why: TopKEF creates a tensor's variables the first time the tensor is reduced, i.e. while the user's step
function is being traced. ``tf.function`` records every variable created during a first trace and, if there
are any, traces the whole step again to lift their initialisers out of the graph: on ResNet-50 that second
trace was about half of TopKEF's first-step cost (README, "First-step (tracing) cost"). These variables need
no lifting: they are created eagerly (``tf.init_scope``) from concrete values, once per process, and the graph
only reads and assigns them. ``experimental_enable_variable_lifting=False`` tells ``tf.function`` exactly that,
so its first trace is kept (if the user's own step created no variables of its own). In that case it also lets
a later trace of the same function create the state of a tensor it had not seen (a retrace for another
signature); where the step's first call did create variables of its own (a Keras 2 optimizer's slots), TensorFlow
refuses any variable in a later trace, lifted or not ("tf.function only supports singleton tf.Variables created
on the first call"), as it did before.
"""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

__all__ = ["state_variable"]


def state_variable(initial: Any, name: str, dtype: Optional[tf.DType] = None) -> tf.Variable:
    """A non-trainable variable holding ``initial``, created outside any traced function and not lifted."""
    with tf.init_scope():
        return tf.Variable(initial, dtype=dtype, trainable=False, name=name,
                           experimental_enable_variable_lifting=False)
