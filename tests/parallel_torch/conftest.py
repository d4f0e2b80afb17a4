"""Multi-worker tests: the same files run on every rank under ``horovodrun -np 2`` (scripts/test.sh does it).

Every test issues the same collectives in the same order on every rank and asserts only after its collectives,
so that a failure on one rank cannot leave the other one waiting.
"""
import os

import pytest

hvd = pytest.importorskip("horovod.torch")

# Two one-rank process sets next to the global one, for the process_set option of DistributedOptimizer.
SINGLE_RANK_SETS = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]


def pytest_configure(config):
    # Lets a test record a timeline of just its own steps with hvd.start_timeline / stop_timeline.
    os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
    hvd.init(process_sets=SINGLE_RANK_SETS)


def pytest_collection_modifyitems(config, items):
    if hvd.size() < 2:
        skip = pytest.mark.skip(reason="needs >= 2 Horovod workers: run under horovodrun -np 2")
        for item in items:
            item.add_marker(skip)
