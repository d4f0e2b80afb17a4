"""ratio="auto" in PyTorch: the probes core.linkprobe measures the link with, taken with Horovod's collectives.

What only a framework can do: time synchronous allreduces of known sizes and a burst of small allgathers, time one
selection on this device, and gather every rank's measurement row; the sequence and its arithmetic are core's
(core.linkprobe.measure). They run at a decision step, from the first tensor of that step to reach the compressor
(nothing of the step is in flight yet), the same step on every rank. The optimizer's ``synchronize`` is timed too
(what a step waits for its collectives).
"""
from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch

from ..core import linkprobe
from ..core.autodensity import AutoDensity, Measurement
from .selection import select_seconds_per_entry

__all__ = ["TorchProbes", "measure", "install_wait_timer"]


@dataclass
class TorchProbes:
    """core.linkprobe.LinkProbes over Horovod's torch collectives on ``process_set``."""

    process_set: Any
    device: torch.device
    selector: str

    def allreduce_seconds(self, numel: int, name: str, repeats: int) -> List[float]:
        from horovod.torch.mpi_ops import Sum, allreduce

        buf = torch.zeros(numel, dtype=torch.float32)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            allreduce(buf, name=name, op=Sum, process_set=self.process_set)
            times.append(time.perf_counter() - started)
        return times

    def burst_seconds(self, count: int) -> float:
        from horovod.torch.mpi_ops import allgather_async, synchronize

        one = torch.zeros(1, dtype=torch.float32)
        started = time.perf_counter()
        handles = [allgather_async(one, name=linkprobe.burst_name(i), process_set=self.process_set)
                   for i in range(count)]
        for handle in handles:
            synchronize(handle)
        return time.perf_counter() - started

    def select_seconds_per_entry(self, numel: int) -> float:
        return select_seconds_per_entry(numel, self.device, self.selector)

    def gather_rows(self, row: Sequence[float]) -> List[List[float]]:
        from horovod.torch.mpi_ops import allgather

        mine = torch.tensor([list(row)], dtype=torch.float64)
        return allgather(mine, name=linkprobe.MEASURE_NAME, process_set=self.process_set).tolist()


def measure(auto: AutoDensity, tensors: Sequence[Tuple[str, int]], process_set: Any, device: torch.device,
            selector: str) -> Measurement:
    """Probe the link, time a selection, and gather every rank's row: the Measurement every rank decides from."""
    return linkprobe.measure(auto, tensors, TorchProbes(process_set, device, selector), process_set.size())


def install_wait_timer(optimizer: Any, auto: AutoDensity) -> None:
    """Time the optimizer's ``synchronize`` (the wait for this step's collectives) into ``auto``: installed on the
    instance, so Horovod's ``step`` (which calls ``self.synchronize()``) is timed as well."""
    synchronize = optimizer.synchronize

    def timed_synchronize(_: Any) -> Any:
        started = time.perf_counter()
        try:
            return synchronize()
        finally:
            auto.waited(time.perf_counter() - started)

    optimizer.synchronize = types.MethodType(timed_synchronize, optimizer)
