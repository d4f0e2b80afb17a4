"""One traced body per distinct signature, shared by every tensor that has it.

Why: inside a ``tf.function`` each compressed tensor used to add its own copy of the selection, packing and
decoding ops, built op by op in Python -- twice, as TensorFlow traces a step function again after a first trace
that created variables (TopKEF's residuals). That was most of TopKEF's first-step cost (docs/tensorflow.md). Tensors with the same size and options run the same ops, so :func:`call` traces that
body once as a ``tf.function`` and each tensor adds one call op to the step's graph; ResNet-50's 87 compressed
tensors have 17 distinct sizes. :func:`call_any_shape` goes further for bodies that read their sizes from their
inputs (horovod_topk.tensorflow.steps): one trace for every size. The ops and their results are unchanged; the
calls are not inlined (``_NOINLINE``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import tensorflow as tf

from ..core.payload import PayloadLayout
from .sizes import SizeOptions

__all__ = ["call", "call_any_shape", "traced_count"]

#: (function, fixed arguments, which leaves are inputs, input specs) -> its tf.function, traced once; lives as long
#: as the process.
_TRACED: Dict[Hashable, Any] = {}
#: Not inlined into the step's graph: TensorFlow then optimises (Grappler) and instantiates each shared body once,
#: not each tensor's copy; measured on 20 compressed tensors, the first call after tracing took 0.50 s instead of
#: 1.34 s (dense: 0.19 s), with later steps unchanged (benchmarks/profile_tf_trace.py).
_NOINLINE = {"experimental_attributes": {"_noinline": True}}
#: Python values that may be fixed in a shared trace: hashable by value, so equal ones share it.
_STATIC = (int, float, bool, str, type(None), tf.DType, PayloadLayout, SizeOptions)


def _is_static(value: Any) -> bool:
    return isinstance(value, _STATIC)


def _is_input(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable))


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, as a call of one traced function per distinct set of Python values.

    The tensors and variables among ``args`` (nested in tuples too) are the traced function's inputs: a variable
    is passed as itself (its resource handle), so ``fn`` may read and assign it, and variables of equal shape and
    dtype share the trace. Every other value (``kwargs`` and the other leaves of ``args``) is fixed in the trace
    and must be a plain value (int, float, bool, str, None, DType, PayloadLayout, SizeOptions).
    Anything else, and eager execution, calls ``fn`` directly: nothing is shared, nothing changes. ``fn`` must not
    capture tensors or create variables."""
    if tf.executing_eagerly():
        return fn(*args, **kwargs)
    leaves = tf.nest.flatten(args)
    inputs = [leaf if isinstance(leaf, tf.Variable) else tf.convert_to_tensor(leaf)
              for leaf in leaves if _is_input(leaf)]
    fixed = tuple(None if _is_input(leaf) else leaf for leaf in leaves)
    static = tuple(sorted(kwargs.items()))
    if not all(_is_static(v) for v in fixed + tuple(v for _, v in static)):
        return fn(*args, **kwargs)
    where = tuple(_is_input(leaf) for leaf in leaves)
    # the inputs' shapes and dtypes too: each tf.function traces once (no retracing warnings, no relaxed shapes)
    key = (fn, fixed, where, static,
           tuple((isinstance(t, tf.Variable), tuple(t.shape.as_list()), t.dtype) for t in inputs))
    traced = _TRACED.get(key)
    if traced is None:
        traced = _TRACED[key] = tf.function(_rebuilt(fn, args, fixed, where, kwargs), autograph=False, **_NOINLINE)
    return traced(*inputs)


def call_any_shape(fn: Callable[..., Any], *inputs: Optional[tf.Tensor], **kwargs: Any) -> Any:
    """``fn(*inputs, **kwargs)``, as a call of one function traced once per distinct ``kwargs``, input dtypes and
    absent (None) inputs, whatever the inputs' shapes: every input is traced as a tensor of unknown shape.

    Why: ``call`` traces a body per distinct size, and a model has many (ResNet-50's 87 compressed tensors: 17);
    each trace is Python work and one more function for TensorFlow to optimise and instantiate on the first call.
    ``fn`` must take its sizes from its inputs, not from static shapes (horovod_topk.tensorflow.steps), and reach
    variables through their handles (``var.handle``, a resource tensor) with ``tf.raw_ops``. ``kwargs`` must be
    plain values (see ``call``). Eager execution calls ``fn`` directly."""
    if tf.executing_eagerly():
        return fn(*inputs, **kwargs)
    static = tuple(sorted(kwargs.items()))
    if not all(_is_static(v) for _, v in static):
        raise TypeError(f"horovod-topk: shared.call_any_shape needs plain keyword values, got {kwargs!r}")
    given = [_not_constant(tf.convert_to_tensor(t)) if t is not None else None for t in inputs]
    where = tuple(t is not None for t in given)
    key = ("any_shape", fn, where, static, tuple(t.dtype for t in given if t is not None))
    traced = _TRACED.get(key)
    if traced is None:
        signature = [tf.TensorSpec(None, t.dtype) for t in given if t is not None]
        traced = _TRACED[key] = tf.function(_with_absent(fn, where, kwargs), input_signature=signature,
                                            autograph=False, **_NOINLINE)
    return traced(*[t for t in given if t is not None])


def _not_constant(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor``, through a PlaceholderWithDefault when it is a constant.

    Why: TensorFlow's graph optimiser specialises a function for each call that has a constant input (it pushes
    the constant into a copy of the body), so a shared body would be copied, optimised and instantiated once per
    tensor again. A PlaceholderWithDefault passes its input through unchanged, but is not a constant to the
    optimiser (a placeholder may be fed), so every call keeps the one shared body. Measured on 120 compressed
    tensors of two sizes (``benchmarks/profile_tf_trace.py``'s 60 layers of 256x256 plus 60 vectors of 1,024), the
    first call after tracing took 4.14 s with constant inputs and 2.56 s through placeholders (dense: 0.65 s; 2.22 s
    with TensorFlow's function optimizer switched off altogether)."""
    if tensor.op.type != "Const":
        return tensor
    return tf.raw_ops.PlaceholderWithDefault(input=tensor, shape=tensor.shape)


def _with_absent(fn: Callable[..., Any], where: Tuple[bool, ...], kwargs: Dict[str, Any]) -> Callable[..., Any]:
    """fn taking only the present inputs: the absent ones (None) are put back in their places."""

    def body(*present: tf.Tensor) -> Any:
        given = iter(present)
        return fn(*[next(given) if is_present else None for is_present in where], **kwargs)

    return body


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
