"""Telemetry (core.telemetry): when a report is due, what the line says, what a summary writer receives."""
import logging

import pytest

from horovod_topk.core import TopKConfig
from horovod_topk.core.telemetry import Telemetry, interval_scalars, summary_line


class RecordingWriter:
    """Anything with add_scalar(tag, value, step): here, one that keeps the calls."""

    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append((tag, value, step))


def _stats(sent, dense, seconds, norm):
    return {"bytes_sent": sent, "bytes_dense": dense, "compress_seconds": seconds, "residual_norm": norm}


def test_reports_are_due_every_n_completed_steps_once():
    t = Telemetry(100)
    assert [s for s in range(0, 301) if t.due(s)] == [100, 200, 300]
    t.report(100, _stats(1, 1, 0.0, 0.0))
    assert not t.due(100) and t.due(200)
    assert not Telemetry(0).due(100)


def test_interval_scalars_difference_the_counters():
    first = _stats(1_000, 50_000, 0.5, 2.0)
    second = _stats(3_000, 150_000, 1.5, 3.0)
    assert interval_scalars(first, {}, 10) == {
        "bytes_sent": 1000.0, "compression_ratio": 50.0, "residual_norm": 2.0, "compress_ms_per_step": 50.0}
    scalars = interval_scalars(second, first, 20)
    assert scalars["bytes_sent"] == 2000.0 and scalars["compression_ratio"] == 50.0
    assert scalars["compress_ms_per_step"] == 50.0 and scalars["residual_norm"] == 3.0


def test_one_line_through_logging_and_scalars_to_the_writer(caplog):
    writer = RecordingWriter()
    t = Telemetry(10, writer)
    with caplog.at_level(logging.INFO, logger="horovod_topk"):
        t.report(10, _stats(2_040_000, 102_000_000, 0.123, 1.5), rank=0)
        t.report(20, _stats(4_080_000, 204_000_000, 0.246, 1.25), rank=0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1] == ("horovod-topk rank 0 step 20: sent 2.04 MB in 10 steps (50.0x less than dense), "
                        "residual norm 1.25, compress 12.30 ms/step")
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert [c[0] for c in writer.calls[4:]] == ["horovod_topk/bytes_sent", "horovod_topk/compression_ratio",
                                               "horovod_topk/residual_norm", "horovod_topk/compress_ms_per_step"]
    assert writer.calls[5] == ("horovod_topk/compression_ratio", 50.0, 20)
    assert summary_line(5, 5, interval_scalars(_stats(0, 0, 0.0, 0.0), {}, 5)).startswith("horovod-topk step 5:")


def test_bad_options_are_refused_by_name():
    with pytest.raises(ValueError, match="add_scalar"):
        Telemetry(10, writer=object())
    with pytest.raises(ValueError, match="log_every > 0"):
        Telemetry(0, writer=RecordingWriter())
    for bad in (-1, 1.5, True, "100"):
        with pytest.raises(ValueError, match="log_every must be a non-negative integer"):
            TopKConfig(log_every=bad)
