"""torch.ddp_auto.BucketClock without a process group: which step a wait is counted in, and the refusal of
non-CPU buckets. (Its collectives and decisions on real workers: tests/ddp/test_ddp_auto_density.py.)"""
import pickle
import time

import pytest
import torch

from horovod_topk.core import TopKConfig
from horovod_topk.core.autodensity import SETTLE_STEPS, AutoDensity
from horovod_topk.torch.ddp_auto import BucketClock


class Bucket:
    def __init__(self, index: int, last: bool, device: str = "cpu") -> None:
        self._index, self._last, self._buffer = index, last, torch.empty(4, device=device)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer


class State:
    def __init__(self) -> None:
        self.auto = AutoDensity(TopKConfig(ratio="auto"))


def run_step(clock: BucketClock, state: State, wait_s: float, compute_s: float = 0.002) -> None:
    """Two buckets: bucket 0's collective completes at once, the last one's ``wait_s`` after backward ended."""
    buckets = [Bucket(0, False), Bucket(1, True)]
    time.sleep(compute_s)  # backward until bucket 0 is ready
    clock.bucket(state, buckets[0], group=None)
    first = torch.futures.Future()
    chained_first = clock.launched(buckets[0], first)
    first.set_result(torch.zeros(1))
    clock.bucket(state, buckets[1], group=None)
    last = torch.futures.Future()
    chained_last = clock.launched(buckets[1], last)
    time.sleep(wait_s)  # the last collective in flight after the hook returned: what DDP waits for
    last.set_result(torch.zeros(1))
    assert chained_first.wait() is not None and chained_last.wait() is not None


def test_a_steps_wait_is_counted_in_that_step_and_no_other():
    clock, state = BucketClock(), State()
    waits = [0.0, 0.0, 0.0, 0.03, 0.0, 0.06, 0.0]
    for wait in waits:
        run_step(clock, state, wait)
    clock.bucket(state, Bucket(0, False), group=None)  # the next step begins: the last one is closed
    samples = state.auto._samples  # (period, wait, compress) of the steps from SETTLE_STEPS on
    measured = [s[1] for s in samples]
    expected = waits[SETTLE_STEPS:]
    assert len(measured) == len(expected)
    for got, want in zip(measured, expected):
        assert want <= got < want + 0.02, (measured, expected)  # the sleep, plus a little, in its own step
    assert all(s[0] >= s[1] for s in samples)  # a wait is part of its step's period


def test_buckets_off_the_cpu_are_refused_before_any_collective():
    with pytest.raises(ValueError, match="CPU buckets"):
        BucketClock().bucket(State(), Bucket(0, False, device="meta"), group=None)


def test_a_pickled_clock_starts_empty():
    clock = BucketClock()
    clock.ready, clock.done = 5.0, 7.0
    copy = pickle.loads(pickle.dumps(clock))
    assert (copy.ready, copy.done) == (0.0, 0.0)
