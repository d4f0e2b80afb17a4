"""Multi-worker tests of TopKEF with Keras 3 (``tf.keras`` of TensorFlow >= 2.16 without TF_USE_LEGACY_KERAS), run
on every rank under ``horovodrun -np 2`` (scripts/test.sh does it). A process holds one Keras behind ``tf.keras``,
so this suite runs in processes of its own, with the variable forced off before TensorFlow loads."""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "0"

import pytest  # noqa: E402

hvd = pytest.importorskip("horovod.tensorflow")
keras = pytest.importorskip("keras")


def pytest_configure(config):
    import tensorflow as tf

    if not tf.keras.__version__.startswith("3."):
        raise pytest.UsageError(f"tf.keras is Keras {tf.keras.__version__}, not Keras 3")
    hvd.init()


def pytest_collection_modifyitems(config, items):
    if hvd.size() < 2:
        skip = pytest.mark.skip(reason="needs >= 2 Horovod workers: run under horovodrun -np 2")
        for item in items:
            item.add_marker(skip)
