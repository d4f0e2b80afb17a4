"""ratio="auto" through the Keras optimizer wrappers, on 2 real Horovod workers: the cases both Keras suites run.

tests/parallel_tf (Keras 2 behind tf.keras) and tests/parallel_keras3 (Keras 3) import these tests. The link is
scripted (tests/auto_links.py) so that the densities change at known steps; fit, the wrappers, the traced step and
the collectives are the real ones.
"""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.autodensity import HALF
from horovod_topk.tensorflow import TopKEF, auto_density
from tests.auto_links import (CHECK_STEPS, FIRST_DECISION, FOURTH_DECISION, SECOND_DECISION, THIRD_DECISION,
                               fast_link, script, slow_link, sparse_slower_than_dense)
from tests.keras_update_mode_cases import WRAPPERS, _batches, _loss_fn, _model, _same_on_every_rank, _weights, _wrap

keras = tf.keras
#: dense until the first decision, sparse after it, dense again after the second
STEPS = THIRD_DECISION


class _Densities(keras.callbacks.Callback):
    """The density in force after each batch."""

    def __init__(self, compressor) -> None:
        super().__init__()
        self.compressor, self.seen = compressor, []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.compressor.auto.ratio)


def _fit(compressor, optimizer, wrapper, steps=STEPS):
    model = _model()
    model.compile(optimizer=_wrap(optimizer, compressor, wrapper), loss=_loss_fn())
    x = np.concatenate([b[0] for b in _batches(steps, hvd.rank())])
    y = np.concatenate([b[1] for b in _batches(steps, hvd.rank())])
    densities = _Densities(compressor)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[densities])
    return _weights(model), densities.seen


def _changes(seen):
    return [(i, r) for i, r in enumerate(seen) if i and r != seen[i - 1]]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_auto_density_in_fit_follows_each_decision_with_identical_ranks(monkeypatch, wrapper):
    """Gradient mode through model.fit: dense, then sparse, then dense again at the scripted decisions, one traced
    train function for all of them; every rank's weights are the same bytes, and the sparse steps sent less."""
    script(monkeypatch, auto_density, lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=5)
    compressor.auto.half = False  # the script's sequence is dense <-> sparse
    weights, seen = _fit(compressor, keras.optimizers.SGD(0.1), wrapper)
    assert seen[0] is None and [r is None for _, r in _changes(seen)] == [False, True], seen
    assert _same_on_every_rank(weights, f"auto.fit.{wrapper}")
    stats = compressor.stats()
    assert stats["steps"] == STEPS and stats["bytes_sent"] < stats["bytes_dense"]
    assert stats["auto"]["decisions"] >= 2 and stats["exchanges"]


def test_auto_density_in_update_mode_follows_each_decision_with_identical_ranks(monkeypatch):
    """Update mode (each rank's own Adam, its update exchanged) under ratio="auto": the updates follow the density
    in force, and every rank's weights stay the same bytes."""
    script(monkeypatch, auto_density, lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=5, target="update")
    compressor.auto.half = False
    weights, seen = _fit(compressor, keras.optimizers.Adam(1e-2), "horovod.tensorflow.keras")
    assert seen[0] is None and [r is None for _, r in _changes(seen)] == [False, True], seen
    assert _same_on_every_rank(weights, "auto.update.fit")
    stats = compressor.stats()
    assert stats["bytes_sent"] < stats["bytes_dense"] and stats["exchanges"]


def test_auto_density_in_update_mode_through_fp16_keeps_ranks_identical(monkeypatch):
    """Update mode with fp16 among the choices: sparse, then fp16 (every update dense in float16, its rounding fed
    back), then dense, in one traced train function; every rank's weights stay the same bytes."""
    links = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
    script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=CHECK_STEPS, target="update")
    weights, seen = _fit(compressor, keras.optimizers.Adam(1e-2), "horovod.tensorflow.keras",
                         steps=FOURTH_DECISION)
    assert [r if r == HALF else r is None for _, r in _changes(seen)] == [False, HALF, True], seen
    assert _same_on_every_rank(weights, "auto.update.fp16")
    stats = compressor.stats()
    assert stats["exchanges"].get("dense_fp16", 0) > 0 and stats["bytes_sent"] < stats["bytes_dense"]
