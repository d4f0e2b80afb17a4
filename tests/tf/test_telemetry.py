"""TensorFlow telemetry on one process: the graph gate reports every N steps with the right numbers, and a
tf.summary.SummaryWriter receives the scalars (no collectives: the counters are driven directly)."""
import glob
import logging

import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.telemetry import summary_line
from horovod_topk.tensorflow import TopKEF
from horovod_topk.tensorflow.telemetry import SummaryWriterScalars


class RecordingWriter:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append((tag, value, step))


def _drive(comp, steps, sizes, use_function=True):
    """What start_reduction does with the counters of each tensor per step: gate first, then count (sent, dense)
    bytes; the residual of the first tensor is set so that the norm is known."""
    counters = {name: comp._counters(name, comp.registry.record(name, (4,))) for name in sizes}
    comp._residual_vars["a"] = tf.Variable([3.0, 4.0, 0.0, 0.0])

    def step():
        for name, (sent, dense) in sizes.items():
            gate = comp._telemetry.gate(name, counters[name], lambda: 0)
            with tf.control_dependencies([gate]):
                counters[name].assign_add(tf.constant([1, sent, dense, 0, 0], tf.int64))

    run = tf.function(step) if use_function else step
    for _ in range(steps):
        run()


@pytest.mark.parametrize("use_function", [True, False])
def test_the_gate_reports_every_n_steps_with_the_interval_numbers(caplog, use_function):
    writer = RecordingWriter()
    comp = TopKEF(log_every=2, summary_writer=writer)
    with caplog.at_level(logging.INFO, logger="horovod_topk"):
        _drive(comp, 5, {"a": (100, 1000), "b": (300, 1000)}, use_function)
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_topk"]
    expected = {"bytes_sent": 800.0, "compression_ratio": 5.0, "residual_norm": 5.0, "compress_ms_per_step": 0.0}
    assert lines == [summary_line(2, 2, expected, 0), summary_line(4, 2, expected, 0)]
    assert [(t, v, s) for t, v, s in writer.calls if t == "horovod_topk/bytes_sent"] == [
        ("horovod_topk/bytes_sent", 800.0, 2), ("horovod_topk/bytes_sent", 800.0, 4)]
    assert {t for t, _, _ in writer.calls} == {f"horovod_topk/{n}" for n in expected}


def test_a_tensor_already_counting_the_next_step_is_reported_from_its_snapshot():
    comp = TopKEF(log_every=2)
    counters = comp._counters("a", comp.registry.record("a", (4,)))
    gate = lambda: comp._telemetry.gate("a", counters, lambda: 0)  # noqa: E731
    for _ in range(2):
        with tf.control_dependencies([gate()]):
            counters.assign_add(tf.constant([1, 10, 40, 0, 0], tf.int64))
    comp.telemetry._last_step = 2  # the report of step 2 was made: the next gate only snapshots
    gate()
    counters.assign_add(tf.constant([1, 10, 40, 0, 0], tf.int64))  # step 3 counted
    assert comp._telemetry.totals_at(2)["bytes_sent"] == 20 and comp._telemetry.totals_at(3)["bytes_sent"] == 30


def test_off_by_default_builds_nothing():
    assert TopKEF()._telemetry is None


def test_a_tf_summary_writer_receives_the_four_scalars(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    comp = TopKEF(log_every=1, summary_writer=writer)
    assert isinstance(comp.telemetry.writer, SummaryWriterScalars)
    _drive(comp, 3, {"a": (100, 1000)})
    writer.flush()
    seen = {}
    for path in glob.glob(str(tmp_path / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                seen.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    assert sorted(seen) == sorted(f"horovod_topk/{n}" for n in
                                  ("bytes_sent", "compression_ratio", "residual_norm", "compress_ms_per_step"))
    assert seen["horovod_topk/bytes_sent"] == [(1, 100.0), (2, 100.0)]
    assert seen["horovod_topk/compression_ratio"] == [(1, 10.0), (2, 10.0)]
    np.testing.assert_allclose([v for _, v in seen["horovod_topk/residual_norm"]], [5.0, 5.0])


def test_a_writer_without_add_scalar_is_refused():
    with pytest.raises(ValueError, match="add_scalar"):
        TopKEF(log_every=1, summary_writer=object())
