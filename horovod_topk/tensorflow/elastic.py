"""Horovod elastic for the TensorFlow ``TopKEF``: its residuals follow ``hvd.elastic.TensorFlowKerasState`` (and
``TensorFlowState``) through commit, restore and reset, with the PyTorch semantics (horovod_topk.core.checkpoint
.ElasticCompressorState).

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0)
    state = compressor.elastic_state(state)        # or horovod_topk.tensorflow.elastic.track(state, compressor)

Why a wrapper and not a keyword of the state: the TensorFlow states are ``ObjectState``s, which pickle and
broadcast every keyword object from rank 0 on sync -- the compressor's variables cannot travel that way, and rank
0's residuals must not replace the others' anyway. So ``track`` wraps this one state object's ``save``,
``restore`` and ``sync`` (instance attributes; Horovod's ``commit`` and ``hvd.elastic.run`` call them) and
registers a reset callback. After a reset the traced steps must be traced again: the world size is a constant in
them (the 1/P of Average, the route, the expected payload size). The callback drops the Keras model's cached
train/test/predict functions, gives Horovod's cached gradient-allreduce functions (``DistributedOptimizer``,
``DistributedGradientTape``) fresh trace caches, and on sync each rank rescales its own residuals to the new
world size, mass-preservingly. A ``tf.function`` of your own must be created inside the function decorated
with ``hvd.elastic.run`` so that it, too, is traced again.
"""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from ..core import checkpoint as core
from .checkpoint import _TensorFlowTransport

__all__ = ["track", "retrace"]


def retrace(model: Any = None, optimizer: Any = None) -> None:
    """Make the next training step trace again (after a world-size change, whose size the traced graph holds).

    Horovod caches one gradient-allreduce ``tf.function`` per configuration for the whole process
    (``horovod.tensorflow._make_cached_allreduce_grads_fn``) and the Keras optimizer wrapper keeps one in
    ``_allreduce_grads``: both are replaced by fresh ``tf.function``s of the same Python function, which trace on
    their next call; the model's cached step functions are dropped, so that Keras builds them again."""
    import horovod.tensorflow as hvd

    cached = getattr(hvd, "_make_cached_allreduce_grads_fn", None)
    for cell in getattr(cached, "__closure__", None) or ():
        if isinstance(cell.cell_contents, dict):
            cell.cell_contents.clear()
    optimizers = {id(o): o for o in (optimizer, getattr(model, "optimizer", None)) if o is not None}
    for opt in optimizers.values():
        function = getattr(opt, "_allreduce_grads", None)
        if function is not None and callable(getattr(function, "python_function", None)):
            opt._allreduce_grads = tf.function(function.python_function)
    for attr in ("train_function", "test_function", "predict_function"):
        if model is not None and getattr(model, attr, None) is not None:
            setattr(model, attr, None)


def track(state: Any, compressor: Any, *, model: Any = None, optimizer: Any = None) -> Any:
    """Make ``state`` (a Horovod elastic State, e.g. ``TensorFlowKerasState``) commit, restore and sync the
    error-feedback state of ``compressor`` (a TopKEF object, or the class for its default object) with the
    model's; returns ``state``. ``model``/``optimizer`` default to the state's own (TensorFlowKerasState has
    them). Call eagerly, on every rank, before ``hvd.elastic.run`` starts."""
    compressor = core.resolve_compressor(compressor)
    model = model if model is not None else getattr(state, "model", None)
    optimizer = optimizer if optimizer is not None else getattr(state, "optimizer", None)
    handler = core.ElasticCompressorState(
        compressor, _TensorFlowTransport, rescale_on_sync=True,
        reductions=lambda: dict(compressor._reductions), after_sync=compressor._after_load,
    )
    save, restore, sync = state.save, state.restore, state.sync

    def save_both() -> None:
        save()
        handler.save()

    def restore_both() -> None:
        restore()
        handler.restore()

    def sync_both() -> None:
        sync()
        handler.sync()

    state.save, state.restore, state.sync = save_both, restore_both, sync_both
    state.register_reset_callbacks([lambda: retrace(model, optimizer)])
    state.topk_elastic = handler  # what tests and users can inspect: handler.value is the compressor
    return state


def handler_of(state: Any) -> Optional[core.ElasticCompressorState]:
    """The compressor handler ``track`` attached to ``state``, if any."""
    return getattr(state, "topk_elastic", None)
