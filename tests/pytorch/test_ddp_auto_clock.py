"""torch.ddp_auto.StepClock and torch.wait_stamps without a process group: which step a wait is counted in, the wait
timed on a GPU's timeline, and the refusal of devices without a clock. (Its collectives and decisions on real
workers: tests/ddp/test_ddp_auto_density.py.)"""
import pickle
import time

import pytest
import torch

from horovod_topk.core import TopKConfig
from horovod_topk.core.autodensity import FIRST_DECISION, SETTLE_STEPS, WINDOW_STEPS, AutoDensity
from horovod_topk.torch.ddp_auto import StepClock
from horovod_topk.torch.wait_stamps import CudaStamps, HostStamps


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


def run_step(clock: StepClock, state: State, wait_s: float, compute_s: float = 0.002) -> None:
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
    clock, state = StepClock(), State()
    waits = [0.0] * SETTLE_STEPS + [0.03, 0.0, 0.06]
    assert len(waits) < FIRST_DECISION  # every step in the first window: no decision (it needs a process group)
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


def test_buckets_on_a_device_without_a_clock_are_refused_before_any_collective():
    with pytest.raises(ValueError, match="'meta' have neither"):
        StepClock().bucket(State(), Bucket(0, False, device="meta"), group=None)


def test_only_the_steps_whose_wait_counts_are_stamped():
    clock, state = StepClock(), State()
    state.auto.next_decision = 40  # no decision (it would probe the link) in these 35 steps
    counted = []
    for _ in range(35):
        run_step(clock, state, 0.0, compute_s=0.0)
        counted.append(clock._stamps is not None)
        assert counted[-1] == state.auto.wait_counts()
    assert counted.index(True) == 40 - WINDOW_STEPS - 1 and all(counted[29:])


def test_host_stamps_count_the_latest_collective_after_ready():
    stamps = HostStamps()
    stamps.done()  # a collective done before the step's compute ended: no wait by itself
    stamps.ready()
    assert stamps.seconds() is None
    time.sleep(0.02)
    stamps.done()
    assert 0.02 <= stamps.seconds() < 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_stamps_time_the_device_not_the_host():
    """A collective stand-in that keeps a side stream busy ~100 ms after the host has moved on: the host sees
    (almost) no wait, the events see it."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1)  # the first launch's own setup (~10 ms seen on an H100) stays out of the timing
    torch.cuda.synchronize()
    stamps = CudaStamps()
    stamps.ready()
    side.wait_stream(torch.cuda.current_stream())
    host_started = time.perf_counter()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e8))  # ~110 ms of a busy kernel at the H100's clocks
    torch.cuda.current_stream().wait_stream(side)
    stamps.done()  # recorded on a stream that waited for the "collective", as in a future's callback
    host_s = time.perf_counter() - host_started
    device_s = stamps.seconds()
    print(f"host {host_s * 1e3:.2f} ms, device {device_s * 1e3:.2f} ms")
    assert host_s < 0.04 < device_s < 1.0


def test_a_pickled_clock_starts_empty():
    clock, state = StepClock(), State()
    for _ in range(3):
        run_step(clock, state, 0.0, compute_s=0.0)
    assert clock._stamps is not None
    copy = pickle.loads(pickle.dumps(clock))
    assert copy._stamps is None
