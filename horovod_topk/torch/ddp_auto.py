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

**Update mode** (torch.ddp_update) exchanges after the local step, not from the hook: there a step begins where
the optimizer's ``step()`` starts planning its updates (:func:`begin_update_step`, every rank at the same step), and
the wait is its wait for the updates' collectives, as under Horovod's update mode.

**CPU buckets only.** The wait is timed on the host from the collectives' futures. On CUDA (NCCL) a collective's
future completes when its work is queued on a stream, not when it is done, so a host timer would read every wait as
zero, every dense window as fully hidden behind backward, and auto would stay dense for the wrong reason. Until the
wait is timed with CUDA events (and that is tested on a GPU), the hook refuses ratio="auto" on a bucket that is not
on the CPU, at the first bucket on every rank alike, before any collective.
"""
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core import linkprobe
from ..core.autodensity import AutoDensity, Measurement
from .selection import select_seconds_per_entry
from .dist_collectives import all_gather_single

__all__ = ["DistProbes", "measure", "BucketClock", "begin_update_step", "require_cpu"]


@dataclass
class DistProbes:
    """core.linkprobe.LinkProbes over torch.distributed collectives on ``group``, with tensors on ``device`` (the
    CPU: BucketClock refuses other buckets before any probe runs). torch.distributed has no collective names:
    every rank issues the probes in core's order."""

    group: Any
    device: torch.device
    selector: str

    def allreduce_seconds(self, numel: int, name: str, repeats: int) -> List[float]:
        buf = torch.zeros(numel, dtype=torch.float32, device=self.device)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            dist.all_reduce(buf, group=self.group)
            times.append(time.perf_counter() - started)
        return times

    def burst_seconds(self, count: int) -> float:
        world_size = dist.get_world_size(self.group)
        one = torch.zeros(1, dtype=torch.float32, device=self.device)
        outs = [torch.empty(world_size, dtype=torch.float32, device=self.device) for _ in range(count)]
        started = time.perf_counter()
        works = [all_gather_single(out, one, group=self.group, async_op=True) for out in outs]
        for work in works:
            work.wait()
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


def require_cpu(device: torch.device) -> None:
    """Refuse ratio="auto" on tensors off the CPU (module docstring: their waits cannot be timed on the host);
    raised on every rank alike, before any collective of the step."""
    if device.type != "cpu":
        raise ValueError("horovod-topk: ratio='auto' in the DDP hook needs CPU buckets (Gloo): on CUDA a "
                         "collective's future completes when it is queued, so the step's wait cannot be timed "
                         "on the host. Pass a fixed ratio to TopKEFState on GPUs, or use ratio='auto' through "
                         "Horovod's hvd.DistributedOptimizer.")


def _begin(state: Any, group: Any, device: torch.device, now: float) -> None:
    """A new step of ``state``'s compressor begins at ``now``: decide first where a decision is due."""
    auto = state.auto
    if auto.begin(auto.step + 1, now):
        state._auto_decide(measure(auto, state._auto_tensors(), group, device, state.config.selector),
                           dist.get_rank(group))


def begin_update_step(state: Any, group: Any, device: torch.device) -> None:
    """Update mode's optimizer step begins (before its updates are planned): the last step's measurement closes,
    and where a decision is due the probes run and the density in force for this step's plans is decided."""
    require_cpu(device)
    _begin(state, group, device, time.perf_counter())


class BucketClock:
    """Where a step begins and what it waited for, from the buckets DDP hands the hook (module docstring)."""

    def __init__(self) -> None:
        #: When the hook finished launching the last bucket of the step in progress; 0.0: not yet.
        self.ready = 0.0
        #: When the last collective of the step in progress completed (written by collective callbacks, which
        #: run on the process group's threads: under the lock).
        self.done = 0.0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled empty: host times and a lock mean nothing in another process."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def bucket(self, state: Any, bucket: Any, group: Any) -> None:
        """A bucket reached the hook, before it is planned: at bucket 0, close the last step and decide if due."""
        if bucket.index() != 0:
            return
        device = bucket.buffer().device
        require_cpu(device)
        now = time.perf_counter()
        if self.done > self.ready > 0.0:
            state.auto.waited(self.done - self.ready)
        self.ready = self.done = 0.0
        _begin(state, group, device, now)

    def launched(self, bucket: Any, future: torch.futures.Future) -> torch.futures.Future:
        """``future`` (the bucket's result), its completion stamped; the last bucket's launch is stamped too."""
        if bucket.is_last():
            self.ready = time.perf_counter()

        def stamp(fut: torch.futures.Future) -> torch.Tensor:
            now = time.perf_counter()
            with self._lock:
                self.done = max(self.done, now)
            return fut.value()

        return future.then(stamp)
