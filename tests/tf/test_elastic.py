"""Elastic pieces of the TensorFlow TopKEF on one process: the mass-preserving rescale, and commit / restore /
sync of ElasticCompressorState over a fake one-rank transport (no collectives)."""
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.checkpoint import ElasticCompressorState, rescale_to_world
from horovod_topk.tensorflow import TopKEF


class OneRank:
    rank, size = 0, 1

    def allgather_object(self, obj):
        return [obj]


def _state(world_size, residual, momentum=None):
    return {"format": "horovod-topk/1", "tensors": {"w": {
        "shape": [len(residual)], "residual": np.array(residual, np.float32),
        "momentum": None if momentum is None else np.array(momentum, np.float32), "steps": 3,
        "world_size": world_size}}}


@pytest.mark.parametrize("op, expected", [("average", [1.0, -2.0]), ("sum", [2.0, -4.0])])
def test_rescale_keeps_the_owed_mass_and_records_the_new_world(op, expected):
    state = _state(4, [2.0, -4.0], momentum=[8.0, 8.0])
    assert rescale_to_world(state, 2, {"w": op})
    entry = state["tensors"]["w"]
    np.testing.assert_array_equal(entry["residual"], expected)
    np.testing.assert_array_equal(entry["momentum"], [8.0, 8.0])  # a velocity, not owed mass
    assert entry["world_size"] == 2
    assert not rescale_to_world(state, 2, {"w": op})  # already there


def test_rescale_leaves_a_state_without_world_alone():
    state = _state(None, [2.0, -4.0])
    assert not rescale_to_world(state, 3, {})
    np.testing.assert_array_equal(state["tensors"]["w"]["residual"], [2.0, -4.0])


def _compressor_with_variables(world_size):
    comp = TopKEF()
    record = comp.registry.record("w", (2,))
    comp._buffer(comp._residual_vars, "residual", "w", record, 2, tf.float32).assign([2.0, -4.0])
    comp._counters("w", record).assign([3, 10, 20, 0, 0])
    record.world_size, comp._reductions["w"] = world_size, "average"
    return comp


def test_commit_modify_restore_returns_the_committed_variables():
    comp = _compressor_with_variables(1)
    handler = ElasticCompressorState(comp, OneRank, rescale_on_sync=True, reductions=lambda: comp._reductions,
                                     after_sync=comp._after_load)
    comp._residual_vars["w"].assign([7.0, 7.0])
    comp._counter_vars["w"].assign([9, 99, 99, 0, 0])
    handler.restore()
    np.testing.assert_array_equal(comp._residual_vars["w"].numpy(), [2.0, -4.0])
    np.testing.assert_array_equal(comp._counter_vars["w"].numpy(), [3, 10, 20, 0, 0])
    assert comp.registry.records["w"].residual is comp._residual_vars["w"]


def test_sync_on_another_world_size_rescales_the_residual_variable():
    comp = _compressor_with_variables(2)  # accumulated under 2 workers, now 1
    handler = ElasticCompressorState(comp, OneRank, rescale_on_sync=True, reductions=lambda: comp._reductions,
                                     after_sync=comp._after_load)
    handler.sync()
    np.testing.assert_array_equal(comp._residual_vars["w"].numpy(), [1.0, -2.0])
    assert comp.registry.records["w"].world_size == 1 and not comp.registry.records["w"].verified
    handler.sync()  # nothing changes a second time
    np.testing.assert_array_equal(comp._residual_vars["w"].numpy(), [1.0, -2.0])
