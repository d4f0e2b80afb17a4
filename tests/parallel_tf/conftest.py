"""Multi-worker TensorFlow tests, run on every rank under ``horovodrun -np 2`` (scripts/test.sh does it).

Every test issues the same collectives in the same order on every rank and asserts only after its collectives.
"""
import os

# Keras 2 behind tf.keras: Horovod 0.28.1's TensorFlow wrappers need it (see README); set before TF loads.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")

import pytest  # noqa: E402

hvd = pytest.importorskip("horovod.tensorflow")


def pytest_configure(config):
    hvd.init()


def pytest_collection_modifyitems(config, items):
    if hvd.size() < 2:
        skip = pytest.mark.skip(reason="needs >= 2 Horovod workers: run under horovodrun -np 2")
        for item in items:
            item.add_marker(skip)
