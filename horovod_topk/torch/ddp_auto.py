"""ratio="auto" in the DDP communication hook: the link probed with torch.distributed, a step timed from its buckets.

The decision itself is core's (core.autodensity, from the measurement sequence of core.linkprobe), the same as
under Horovod; what only the hook can do is say where a step begins and what it waited for:

- **A step begins at bucket 0.** DDP's reducer launches bucket i only after buckets 0 .. i-1 (it reduces them in
  index order), so every rank's hook sees bucket 0 first in every synchronised iteration (``no_sync()``
  iterations call no hook). There the clock closes the last step's measurement and, when a decision is due, the
  probes run: nothing of this step is in flight yet, and every rank is at the same step.
- **The wait** is from the end of the hook's work on the last bucket (backward has produced every gradient and
  the last collective is launched) to the completion of the step's last collective: what DDP waits for before
  the optimizer may step, the twin of Horovod's ``synchronize()``. The selection's time inside the hook is
  counted as compression (torch.state), so it is not counted twice.

**Update mode** (torch.ddp_update) begins its steps at bucket 0 as well, where the decision fixes the step's route:
on the gradient route (auto holding dense or fp16) the buckets are reduced and timed as above; otherwise the
updates are exchanged after the local step, and the wait is the optimizer's wait for their collectives
(:meth:`StepClock.ready`, :meth:`StepClock.done`), as under Horovod's update mode.

**On GPUs** a collective's future completes when its work is queued on a stream, not when it is done, so the wait
is timed with CUDA events (torch.wait_stamps) and the probes synchronise the device around each timed collective.
Reading the events waits for them: a host synchronisation at the start of a step, taken only in the steps whose
wait counts toward the next decision (AutoDensity.wait_counts: the WINDOW_STEPS + 1 steps before it); every other
step is as free of host waits as at a fixed ratio. The probes and the decision's allgather synchronise too, once
per decision.
"""
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..core import linkprobe
from ..core.autodensity import AutoDensity, Measurement
from .selection import select_seconds_per_entry
from .dist_collectives import all_gather_single
from .wait_stamps import CudaStamps, HostStamps, stamps_for

__all__ = ["DistProbes", "measure", "StepClock"]


def _settle(device: torch.device) -> None:
    """Wait for ``device``'s queued work: on a GPU a collective call returns when its work is queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DistProbes:
    """core.linkprobe.LinkProbes over torch.distributed collectives on ``group``, with tensors on ``device`` (on a
    GPU each timed collective is waited for on the device). torch.distributed has no collective names: every rank
    issues the probes in core's order."""

    group: Any
    device: torch.device
    selector: str

    def allreduce_seconds(self, numel: int, name: str, repeats: int) -> List[float]:
        buf = torch.zeros(numel, dtype=torch.float32, device=self.device)
        times = []
        _settle(self.device)
        for _ in range(repeats):
            started = time.perf_counter()
            dist.all_reduce(buf, group=self.group)
            _settle(self.device)
            times.append(time.perf_counter() - started)
        return times

    def burst_seconds(self, count: int) -> float:
        world_size = dist.get_world_size(self.group)
        one = torch.zeros(1, dtype=torch.float32, device=self.device)
        outs = [torch.empty(world_size, dtype=torch.float32, device=self.device) for _ in range(count)]
        _settle(self.device)
        started = time.perf_counter()
        works = [all_gather_single(out, one, group=self.group, async_op=True) for out in outs]
        for work in works:
            work.wait()
        _settle(self.device)
        return time.perf_counter() - started

    def select_seconds_per_entry(self, numel: int) -> float:
        return select_seconds_per_entry(numel, self.device, self.selector)

    def gather_rows(self, row: Sequence[float]) -> List[List[float]]:
        mine = torch.tensor(list(row), dtype=torch.float64, device=self.device)
        rows = torch.empty(dist.get_world_size(self.group) * mine.numel(), dtype=torch.float64, device=self.device)
        all_gather_single(rows, mine, group=self.group)
        return rows.view(-1, mine.numel()).tolist()


def measure(auto: AutoDensity, tensors: Sequence[Tuple[str, int]], group: Any, device: torch.device,
            selector: str) -> Measurement:
    """Probe the link, time a selection, and gather every rank's row: the Measurement every rank decides from."""
    return linkprobe.measure(auto, tensors, DistProbes(group, device, selector), dist.get_world_size(group))


class StepClock:
    """Where a step of ratio="auto" begins and what it waited for (module docstring): the hook's buckets
    (:meth:`bucket`, :meth:`launched`) or update mode's optimizer step (:meth:`begin`, :meth:`ready`,
    :meth:`done`)."""

    def __init__(self) -> None:
        #: The stamps of the step in progress; None where its wait does not count (nothing is recorded).
        self._stamps: Optional[Union[HostStamps, CudaStamps]] = None

    def __getstate__(self) -> dict:
        """Pickled empty: host times and CUDA events mean nothing in another process."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def begin(self, state: Any, group: Any, device: torch.device) -> None:
        """A step begins, every rank at the same step and before any of its collectives: the last step's wait
        is counted into it and closed, a decision due is taken, and this step's stamps are set up."""
        auto = state.auto
        if auto.int8 and device.type != "cpu":
            auto.withdraw_int8()  # int8's grid reference is read on the host (torch.int8_route)
        stamps = stamps_for(device)  # raises for a device without a clock, on every rank before any collective
        if self._stamps is not None:
            wait = self._stamps.seconds()
            if wait is not None:
                auto.waited(wait)
        self._stamps = None
        if auto.begin(auto.step + 1, time.perf_counter()):
            state._auto_decide(measure(auto, state._auto_tensors(), group, device, state.config.selector),
                               dist.get_rank(group))
        if auto.wait_counts():
            self._stamps = stamps

    def ready(self) -> None:
        """The step's last collective is launched and its compute is done (on a GPU: as far as queued)."""
        if self._stamps is not None:
            self._stamps.ready()

    def done(self) -> None:
        """A collective of the step completed (on a GPU: called on a stream that waited for it)."""
        if self._stamps is not None:
            self._stamps.done()

    def bucket(self, state: Any, bucket: Any, group: Any) -> None:
        """A bucket reached the hook, before it is planned: at bucket 0 a step begins."""
        if bucket.index() == 0:
            self.begin(state, group, bucket.buffer().device)

    def launched(self, bucket: Any, future: torch.futures.Future) -> torch.futures.Future:
        """``future`` (the bucket's result), its completion stamped; the last bucket's launch is stamped too."""
        if bucket.is_last():
            self.ready()
        stamps = self._stamps

        def stamp(fut: torch.futures.Future) -> torch.Tensor:
            if stamps is not None:
                stamps.done()
            return fut.value()

        return future.then(stamp)
