"""The multi-rank checkpoint policy with a one-process transport over plain lists (no framework)."""
import pytest

from horovod_topk.core import ErrorFeedbackRegistry, TensorRecord
from horovod_topk.core.checkpoint import RANKS_FORMAT, gather_state, redistribution_factor, restore_state


class ListTransport:
    """A world of one rank; residuals are lists of floats."""

    rank, size = 0, 1

    def allgather_object(self, obj):
        return [obj]

    def broadcast_object(self, obj, root):
        return obj

    def describe(self, value):
        return {"numel": len(value), "dtype": "float"}

    def gather(self, value, root, key):
        return [list(value)]

    def scatter(self, values, root, key, like):
        return list(values[0])

    def broadcast(self, value, root, key, like):
        return list(value)

    def mean(self, values, factor):
        return [factor * sum(column) / len(values) for column in zip(*values)]


class ListCompressor:
    def __init__(self):
        self.registry = ErrorFeedbackRegistry()

    def state_dict(self):
        return {**self.registry.state_dict(list), "config": {"ratio": 0.01}}

    def load_state_dict(self, state):
        self.registry.load_state_dict(state, lambda name, value: list(value))


def _rank_state(residual, steps=3, sent=10):
    c = ListCompressor()
    c.registry.records["w"] = TensorRecord(shape=(len(residual),), residual=list(residual), steps=steps,
                                           bytes_sent=sent)
    c.registry.records["b"] = TensorRecord(shape=(2,), steps=steps)  # dense: no residual
    return c.state_dict()


def test_gather_then_restore_on_the_same_world_is_identity():
    c = ListCompressor()
    c.load_state_dict(_rank_state([1.0, -2.0, 3.0]))
    ckpt = gather_state(c, ListTransport())
    assert ckpt["format"] == RANKS_FORMAT and ckpt["world_size"] == 1
    restored = ListCompressor()
    restore_state(restored, ckpt, ListTransport())
    assert restored.registry.records["w"].residual == [1.0, -2.0, 3.0]
    assert restored.registry.records["w"].steps == 3 and restored.registry.records["b"].residual is None


@pytest.mark.parametrize("reduction, expected", [("average", [2.0, 0.0, 1.0]), ("sum", [6.0, 0.0, 3.0])])
def test_three_saved_ranks_on_one_keep_the_mass_owed_to_the_update(reduction, expected):
    ranks = [_rank_state(r, sent=s) for r, s in (([1.0, 1.0, 0.0], 3), ([2.0, -1.0, 1.0], 6), ([3.0, 0.0, 2.0], 9))]
    ckpt = {"format": RANKS_FORMAT, "world_size": 3, "ranks": ranks}
    c = ListCompressor()
    restore_state(c, ckpt, ListTransport(), reduction=reduction)
    assert c.registry.records["w"].residual == expected
    assert c.registry.records["w"].bytes_sent == 6 and c.registry.records["w"].steps == 3
    # average: (1/P') * P' * r' == (1/P) * sum;  sum: P' * r' == sum
    total = [sum(r["tensors"]["w"]["residual"][i] for r in ranks) for i in range(3)]
    owed = [t / 3 for t in total] if reduction == "average" else total
    assert c.registry.records["w"].residual == owed


def test_ranks_at_different_steps_or_a_wrong_file_are_refused():
    ranks = [_rank_state([1.0], steps=3), _rank_state([2.0], steps=4)]
    with pytest.raises(ValueError, match="different steps"):
        restore_state(ListCompressor(), {"format": RANKS_FORMAT, "world_size": 2, "ranks": ranks}, ListTransport())
    with pytest.raises(ValueError, match="not a checkpoint of gather_state"):
        restore_state(ListCompressor(), _rank_state([1.0]), ListTransport())
    with pytest.raises(ValueError, match="reduction"):
        redistribution_factor("max", 2, 1)
