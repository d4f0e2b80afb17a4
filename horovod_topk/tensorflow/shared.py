"""One traced body per distinct signature, shared by every tensor that has it.

Why: inside a ``tf.function`` each compressed tensor used to add its own copy of the selection, packing and
decoding ops, built op by op in Python -- twice, as TensorFlow traces a step function again after a first trace
that created variables (TopKEF's residuals). That was most of TopKEF's first-step cost (issue 13; README,
"First-step (tracing) cost"). Tensors with the same size and options run the same ops, so :func:`call` traces that
body once as a ``tf.function`` and each tensor adds one call op to the step's graph; ResNet-50's 87 compressed
tensors have 17 distinct sizes. The ops and their results are unchanged; the call is not inlined (``_NOINLINE``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Tuple

import tensorflow as tf

from ..core.payload import PayloadLayout
from .sizes import SizePlan

__all__ = ["call", "traced_count"]

#: (function, fixed arguments, which leaves are inputs, input specs) -> its tf.function, traced once; lives as long
#: as the process.
_TRACED: Dict[Hashable, Any] = {}
#: Not inlined into the step's graph: TensorFlow then optimises (Grappler) and instantiates each shared body once,
#: not each tensor's copy; measured on 20 compressed tensors, the first call after tracing took 0.50 s instead of
#: 1.34 s (dense: 0.19 s), with later steps unchanged (scripts/profile_tf_trace.py).
_NOINLINE = {"experimental_attributes": {"_noinline": True}}
#: Python values that may be fixed in a shared trace: hashable by value, so equal ones share it.
_STATIC = (int, float, bool, str, type(None), tf.DType, PayloadLayout, SizePlan)


def _is_input(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable))


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, as a call of one traced function per distinct set of Python values.

    The tensors and variables among ``args`` (nested in tuples too) are the traced function's inputs: a variable
    is passed as itself (its resource handle), so ``fn`` may read and assign it, and variables of equal shape and
    dtype share the trace. Every other value (``kwargs`` and the other leaves of ``args``) is fixed in the trace
    and must be a plain value (int, float, bool, str, None, DType, PayloadLayout, SizePlan). Anything else, and
    eager execution, calls ``fn`` directly: nothing is shared, nothing changes. ``fn`` must not capture tensors or
    create variables."""
    if tf.executing_eagerly():
        return fn(*args, **kwargs)
    leaves = tf.nest.flatten(args)
    inputs = [leaf if isinstance(leaf, tf.Variable) else tf.convert_to_tensor(leaf)
              for leaf in leaves if _is_input(leaf)]
    fixed = tuple(None if _is_input(leaf) else leaf for leaf in leaves)
    static = tuple(sorted(kwargs.items()))
    if not all(isinstance(v, _STATIC) for v in fixed + tuple(v for _, v in static)):
        return fn(*args, **kwargs)
    where = tuple(_is_input(leaf) for leaf in leaves)
    # the inputs' shapes and dtypes too: each tf.function traces once (no retracing warnings, no relaxed shapes)
    key = (fn, fixed, where, static,
           tuple((isinstance(t, tf.Variable), _shape_key(t.shape), t.dtype) for t in inputs))
    traced = _TRACED.get(key)
    if traced is None:
        traced = _TRACED[key] = tf.function(_rebuilt(fn, args, fixed, where, kwargs), autograph=False, **_NOINLINE)
    return traced(*inputs)


def _shape_key(shape: tf.TensorShape) -> Any:
    return tuple(shape.as_list()) if shape.rank is not None else None


def _rebuilt(fn: Callable[..., Any], structure: Tuple[Any, ...], fixed: Tuple[Any, ...],
             where: Tuple[bool, ...], kwargs: Dict[str, Any]) -> Callable[..., Any]:
    """fn taking only the inputs: the fixed leaves are put back in their places (no tensor is captured)."""
    template = tf.nest.map_structure(lambda _: None, structure)

    def body(*inputs: tf.Tensor) -> Any:
        given = iter(inputs)
        leaves = [next(given) if is_input else value for value, is_input in zip(fixed, where)]
        return fn(*tf.nest.pack_sequence_as(template, leaves), **kwargs)

    return body


def traced_count() -> int:
    """How many shared functions exist (for tests: equal signatures must share one)."""
    return len(_TRACED)
