"""TensorFlow telemetry (log_every, summary_writer) on real Horovod workers, through DistributedGradientTape."""
import glob
import logging

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_topk.core.telemetry import summary_line
from horovod_topk.tensorflow import TopKEF

from .tf_harness import train_tape

TAGS = {f"horovod_topk/{n}" for n in ("bytes_sent", "compression_ratio", "residual_norm", "compress_ms_per_step")}


class RecordingWriter:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append((tag, value, step))


def test_the_line_and_the_scalars_come_every_n_steps_with_this_ranks_numbers(caplog):
    writer = RecordingWriter()
    compressor = TopKEF(ratio=0.01, log_every=2, summary_writer=writer)
    with caplog.at_level(logging.INFO, logger="horovod_topk"):
        train_tape(compressor, steps=5)  # reports for steps 2 and 4, made as steps 3 and 5 start
    stats = compressor.stats()
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_topk"]
    # w1 and w2 (2048 entries, k = 21 pairs of 8 bytes) compressed, b1 and head dense; the embedding's
    # IndexedSlices never reach the compressor
    per_step_sent, per_step_dense = 2 * 21 * 8 + 64 * 4 + 32 * 4 * 4, (2 * 2048 + 64 + 128) * 4
    assert stats["steps"] == 5 and stats["bytes_sent"] == 5 * per_step_sent and stats["bytes_dense"] == 5 * per_step_dense
    by_tag = {}
    for tag, value, step in writer.calls:
        by_tag.setdefault(tag, []).append((step, value))
    assert set(by_tag) == TAGS
    assert by_tag["horovod_topk/bytes_sent"] == [(2, 2.0 * per_step_sent), (4, 2.0 * per_step_sent)]
    assert [v for _, v in by_tag["horovod_topk/compression_ratio"]] == [per_step_dense / per_step_sent] * 2
    norms = [v for _, v in by_tag["horovod_topk/residual_norm"]]
    assert all(v > 0 for v in norms) and all(v > 0 for _, v in by_tag["horovod_topk/compress_ms_per_step"])
    assert len(lines) == 2
    for line, step in zip(lines, (2, 4)):
        scalars = {tag.split("/")[1]: value for tag, values in by_tag.items() for s, value in values if s == step}
        assert line == summary_line(step, 2, scalars, hvd.rank())
    assert stats["compress_seconds"] > 0


def test_a_tf_summary_writer_gets_the_four_tags(tmp_path):
    logdir = tmp_path / f"rank{hvd.rank()}"
    writer = tf.summary.create_file_writer(str(logdir))
    train_tape(TopKEF(ratio=0.01, log_every=1, summary_writer=writer), steps=3)
    writer.flush()
    seen = {}
    for path in glob.glob(str(logdir / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                seen.setdefault(value.tag, []).append(event.step)
    assert set(seen) == TAGS and all(steps == [1, 2] for steps in seen.values())
