"""Routes tensors marked by ``TopKEF.compress`` to Top-K allgathers inside ``horovod.tensorflow``.

``hvd.allreduce`` / ``hvd.grouped_allreduce`` (which DistributedGradientTape, DistributedOptimizer and the Keras
wrapper all go through) call ``_allreduce`` and ``_grouped_allreduce`` from the ``horovod.tensorflow`` module
namespace. We replace those two names there, in memory (no file changes), with functions that pass unmarked tensors
to Horovod's originals unchanged; marked ones start the compressed reduction, and what must go dense goes back to
Horovod's originals (grouped ones stay grouped). The user-facing constructors are wrapped to refuse, at
construction, an op TopKEF cannot do, and to adapt Horovod to Keras 3 (:mod:`horovod_topk.tensorflow.keras3`):
the tape accepts Keras 3 variables, and a Keras 3 optimizer given to either ``DistributedOptimizer`` gets a
wrapper that reduces its gradients (Horovod's own would silently not). A Keras optimizer (2 or 3) given with
``TopKEF(target="update")`` gets update mode's wrapper (:mod:`horovod_topk.tensorflow.update_mode`); the paths that
only see gradients (the tape, TensorFlow 1 optimizers) refuse update mode at construction.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence

import tensorflow as tf

from ..core import PendingReduction, group_member_name, pending_of, refuse_unsupported_op
from ..core.update_mode import TAPE_REFUSAL, TENSORFLOW_REFUSAL, resolve_target
from . import buckets, keras3, update_mode
from .compressor import TopKEF

__all__ = ["install"]

_INSTALLED_FLAG = "_horovod_topk_routing"


def _uses_topk(compression: Any) -> bool:
    return isinstance(compression, TopKEF) or (isinstance(compression, type) and issubclass(compression, TopKEF))


def _compressor(compression: Any) -> Any:
    return compression if isinstance(compression, TopKEF) else compression.default()


def _update_mode(compression: Any) -> bool:
    """Whether ``compression`` is a TopKEF asked for update mode by name (``target="update"``: refused where the
    step is not seen; ``"auto"`` keeps gradient mode there)."""
    return _uses_topk(compression) and _compressor(compression).config.target == "update"


def _keras_target(compression: Any, optimizer: Any, blockers: Sequence[str] = ()) -> str:
    """TopKConfig.target resolved for a Keras ``optimizer`` (core.update_mode.resolve_target; a loss-scale
    optimizer counts as the optimizer it wraps): "update" or "gradient"."""
    if not _uses_topk(compression):
        return "gradient"
    inner = type(getattr(optimizer, "inner_optimizer", optimizer))
    return resolve_target(_compressor(compression).config, f"{inner.__module__}.{inner.__qualname__}", blockers)


def _refuse_update_mode(compression: Any, message: str) -> None:
    """Raise ``message`` when ``compression`` is a TopKEF in update mode."""
    if _update_mode(compression):
        raise ValueError(message)


def _is_tf1_optimizer(optimizer: Any) -> bool:
    """TensorFlow 1's optimizers: ``hvd.DistributedOptimizer`` reduces their gradients and never sees the step."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


class _GroupsAsked(threading.local):
    """While a reduction whose group horovod-topk asked Horovod for is traced: the bucket_bytes to cut it by
    (None otherwise: a group is the user's own)."""

    cap: Optional[int] = None


_GROUPS_ASKED = _GroupsAsked()


@contextlib.contextmanager
def _groups_asked(cap: int) -> Iterator[None]:
    previous, _GROUPS_ASKED.cap = _GROUPS_ASKED.cap, cap
    try:
        yield
    finally:
        _GROUPS_ASKED.cap = previous


def _asked_cap(compressor: Any) -> Optional[int]:
    """How start_group cuts a group of ``compressor``'s tensors: by its bucket_bytes when horovod-topk asked for the
    group, into single tensors with bucket_bytes 0, else not at all (the user's group is one bucket)."""
    cap = compressor.config.bucket_bytes
    if _GROUPS_ASKED.cap is not None or cap == 0:
        return cap
    return None


def _static_nbytes(tensor: Any) -> int:
    """A tensor's bytes where its shape is known while tracing (0 otherwise: it then never starts a new chunk)."""
    shape = getattr(tensor, "shape", None)
    if shape is None or not shape.is_fully_defined():
        return 0
    return int(shape.num_elements()) * tensor.dtype.size


def _grouping(make_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``_make_allreduce_grads_fn`` (what both DistributedOptimizers, the Keras wrapper and the tape
    build their reduction with), asking for one group per reduction where a TopKEF with bucket_bytes > 0 has no
    ``groups=`` from the user: Horovod then hands every dense gradient of the step to one grouped call, which cuts
    it into buckets (horovod_topk.tensorflow.buckets). Sparse gradients (IndexedSlices, unless sparse_as_dense), a
    step without dense gradients (Horovod's grouped path cannot take an empty group) and Horovod elastic
    (buckets.cap_in_force) keep Horovod's own function."""
    @functools.wraps(make_fn)
    def make(name: Any, device_dense: Any, device_sparse: Any, compression: Any, sparse_as_dense: Any, op: Any,
             gradient_predivide_factor: Any, groups: Any, process_set: Any) -> Callable[..., Any]:
        plain = make_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                        gradient_predivide_factor, groups, process_set)
        if groups is not None or not _uses_topk(compression):
            return plain
        cap = buckets.cap_in_force(_compressor(compression).config.bucket_bytes)
        if cap == 0:
            return plain
        grouped = make_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                          gradient_predivide_factor, 1, process_set)

        @tf.autograph.experimental.do_not_convert  # see _grouped_allreduce
        def allreduce_grads(grads: Sequence[Any], vars: Optional[Sequence[Any]] = None,
                            use_generic_names: bool = False) -> Any:
            # IndexedSlices keep Horovod's per-tensor path: its grouped allreduce pairs a group's gathered slices
            # with the wrong dense shapes when other tensors precede them in the group (Horovod 0.28.1)
            sparse = [isinstance(g, tf.IndexedSlices) and not sparse_as_dense for g in grads]
            if all(g is None or s for g, s in zip(grads, sparse)):
                return plain(grads, vars, use_generic_names)
            with _groups_asked(cap):
                reduced = list(grouped([None if s else g for g, s in zip(grads, sparse)], vars, use_generic_names))
            if any(sparse):
                own = plain([g if s else None for g, s in zip(grads, sparse)], vars, use_generic_names)
                reduced = [o if s else r for r, o, s in zip(reduced, own, sparse)]
            return reduced

        return allreduce_grads
    return make


def install() -> None:
    """Install the routing once per process (idempotent). Raises ImportError on an unknown Horovod layout."""
    import horovod._keras as hvd_keras_impl
    import horovod.tensorflow as hvd
    from horovod.tensorflow.mpi_ops import Adasum, Average, Sum, _normalize_name, global_process_set

    if getattr(hvd, _INSTALLED_FLAG, False):
        return
    missing = [n for n in ("_allreduce", "_grouped_allreduce", "DistributedOptimizer", "_make_allreduce_grads_fn")
               if not hasattr(hvd, n)]
    if not hasattr(hvd_keras_impl, "create_distributed_optimizer"):
        missing.append("_keras.create_distributed_optimizer")
    if missing:
        raise ImportError(f"horovod-topk: horovod.tensorflow has no {', '.join(missing)}; horovod-topk supports 0.28.")
    dense_allreduce = hvd._allreduce
    dense_grouped_allreduce = hvd._grouped_allreduce

    def reduction_name(name: Optional[str], pending: PendingReduction) -> Optional[str]:
        """The name Horovod would give this reduction: the given one, else the gradient's graph name."""
        if name is not None:
            return name
        if pending.source_name is not None:
            return _normalize_name(pending.source_name)
        return None  # eager, unnamed: nothing stable to key a residual on, so it stays dense

    def op_name_of(op: Any) -> str:
        return "average" if op == Average else "sum" if op == Sum else repr(op)

    def start(tensor: Any, pending: PendingReduction, name: str, op: Any, pre: float, post: float, ps: Any) -> Any:
        _refuse_update_mode(pending.compressor, TENSORFLOW_REFUSAL)
        return pending.compressor.start_reduction(
            tensor, pending, name, op_name=op_name_of(op), prescale_factor=pre, postscale_factor=post, process_set=ps
        )

    @tf.autograph.experimental.do_not_convert  # see _grouped_allreduce
    def _allreduce(tensor: Any, name: Optional[str] = None, op: Any = Sum, prescale_factor: float = 1.0,
                   postscale_factor: float = 1.0, ignore_name_scope: bool = False,
                   process_set: Any = global_process_set) -> Any:
        pending = pending_of(tensor)
        key = reduction_name(name, pending) if pending is not None else None
        if pending is not None and key is not None:
            out = start(tensor, pending, key, op, prescale_factor, postscale_factor, process_set)
            if out is not None:
                return out
        return dense_allreduce(tensor, name=name, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                               process_set=process_set)

    # Horovod calls these from functions AutoGraph converts, and AutoGraph would convert them and everything they
    # call (measured on the Keras digits CNN, 4 workers: ~1.9 s of a 9 s trace went to converting horovod-topk's
    # own functions). Their control flow is Python over Python lists, and the graph's own is built explicitly
    # (tf.cond, tf.switch_case), so they run unconverted.
    @tf.autograph.experimental.do_not_convert
    def _grouped_allreduce(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Sum,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           ignore_name_scope: bool = False, process_set: Any = global_process_set) -> List[Any]:
        """A group's marked tensors through their compressor's start_group (buckets: the user's group is one, a
        group horovod-topk asked for is cut by bucket_bytes); the rest through Horovod's grouped allreduce, in
        the same buckets' chunks when horovod-topk asked for the group."""
        outputs: List[Any] = [None] * len(tensors)
        members: dict = {}  # compressor -> [(position, tensor, pending, key)]
        for position, tensor in enumerate(tensors):
            pending = pending_of(tensor)
            key = None
            if pending is not None:
                key = reduction_name(None, pending) or (
                    group_member_name(name, position) if name is not None else None)
            if pending is not None and key is not None:
                _refuse_update_mode(pending.compressor, TENSORFLOW_REFUSAL)
                members.setdefault(id(pending.compressor), []).append((position, tensor, pending, key))
        for group in members.values():
            compressor = group[0][2].compressor
            reduced = compressor.start_group(
                [(tensor, pending, key) for _, tensor, pending, key in group], _asked_cap(compressor),
                op_name=op_name_of(op),
                prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)
            for (position, *_), out in zip(group, reduced):
                outputs[position] = out
        dense_positions = [position for position, out in enumerate(outputs) if out is None]
        cap = _GROUPS_ASKED.cap
        chunks = [dense_positions] if cap is None else [
            [int(p) for p in chunk] for chunk in buckets.assign(
                [(str(p), _static_nbytes(tensors[p])) for p in dense_positions], cap)]
        for index, chunk in enumerate(c for c in chunks if c):
            chunk_name = name if name is None or len(chunks) == 1 else f"{name}.{index}"
            reduced = dense_grouped_allreduce(
                [tensors[i] for i in chunk], name=chunk_name, op=op,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                ignore_name_scope=ignore_name_scope, process_set=process_set)
            for position, out in zip(chunk, reduced):
                outputs[position] = out
        return outputs

    def refusing(constructor: Callable[..., Any], compression_index: int, op_index: int, update_refusal: str,
                 adapt: Callable[[Any], Any] = lambda made: made,
                 sees_steps: Callable[[Any], bool] = lambda made_from: False) -> Callable[..., Any]:
        """``constructor`` refusing, at construction, an op TopKEF cannot do, and update mode unless
        ``sees_steps(first argument)`` (a Keras optimizer: its wrapper runs the step)."""
        def argument(args: Sequence[Any], kwargs: Any, key: str, index: int) -> Any:
            return kwargs.get(key, args[index] if len(args) > index else None)

        @functools.wraps(constructor)
        @tf.autograph.experimental.do_not_convert  # see _grouped_allreduce
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            compression = argument(args, kwargs, "compression", compression_index)
            op = argument(args, kwargs, "op", op_index)
            refuse_unsupported_op(_uses_topk(compression), op, Average, Sum, Adasum)
            optimizer = argument(args, kwargs, "optimizer", 0)
            if not sees_steps(optimizer):
                _refuse_update_mode(compression, update_refusal)
            elif op not in (None, Average) and _keras_target(compression, optimizer) == "update":
                # Horovod drops op on its way to the Keras wrapper: refused here, where it is still seen
                raise ValueError(update_mode.SUM_REFUSAL + (" (target='auto' picks update mode for this "
                                 "optimizer: pass target='gradient' to reduce gradients with this op)"
                                 if not _update_mode(compression) else ""))
            return adapt(constructor(*args, **kwargs))
        return wrapper

    keras_optimizer = hvd_keras_impl.create_distributed_optimizer

    @functools.wraps(keras_optimizer)
    def create_distributed_optimizer(**kwargs: Any) -> Any:
        """What both DistributedOptimizers build a Keras optimizer with (Horovod 0.28.1 passes keywords only)."""
        refuse_unsupported_op(_uses_topk(kwargs.get("compression")), kwargs.get("op"), Average, Sum, Adasum)
        bpps = kwargs.get("backward_passes_per_step", 1)
        blockers = [] if _update_mode(kwargs.get("compression")) else (
            (["backward_passes_per_step"] if bpps != 1 else []) + (["op"] if kwargs.get("op", Average) != Average else []))
        if _keras_target(kwargs.get("compression"), kwargs.get("optimizer"), blockers) == "update":
            return update_mode.distributed_optimizer(
                kwargs["optimizer"], compression=kwargs["compression"],
                process_set=kwargs.get("process_set", global_process_set), op=kwargs.get("op", Average),
                backward_passes_per_step=kwargs.get("backward_passes_per_step", 1))
        if not keras3.is_keras3_optimizer(kwargs.get("optimizer")):
            return keras_optimizer(**kwargs)
        return keras3.distributed_optimizer(
            kwargs["optimizer"], name=kwargs.get("name"), compression=kwargs["compression"],
            sparse_as_dense=kwargs.get("sparse_as_dense", False), op=kwargs.get("op", Average),
            gradient_predivide_factor=kwargs.get("gradient_predivide_factor", 1.0), groups=kwargs.get("groups"),
            process_set=kwargs.get("process_set", global_process_set),
            backward_passes_per_step=kwargs.get("backward_passes_per_step", 1),
            device_dense=kwargs.get("device_dense", ""), device_sparse=kwargs.get("device_sparse", ""))

    hvd._allreduce = _allreduce
    hvd._grouped_allreduce = _grouped_allreduce
    hvd._make_allreduce_grads_fn = _grouping(hvd._make_allreduce_grads_fn)
    # positional indices of `compression` and `op` in each constructor's signature (Horovod 0.28.1)
    hvd.DistributedOptimizer = refusing(hvd.DistributedOptimizer, 5, 8, TENSORFLOW_REFUSAL,
                                        sees_steps=lambda optimizer: not _is_tf1_optimizer(optimizer))
    if hasattr(hvd, "DistributedGradientTape"):
        hvd.DistributedGradientTape = refusing(hvd.DistributedGradientTape, 3, 5, TAPE_REFUSAL,
                                               keras3.adapt_gradient_tape)
    hvd_keras_impl.create_distributed_optimizer = create_distributed_optimizer
    setattr(hvd, _INSTALLED_FLAG, True)
