"""ratio="auto" in PyTorch: the measurements core.autodensity decides from, taken with Horovod's collectives.

Three things only a framework can do: time the link (synchronous allreduces of known sizes, and a burst of small
allgathers for what one more collective costs in a step's stream of them), time one
selection on this device, and gather every rank's measurement row. They run at a decision step, from the first
tensor of that step to reach the compressor (nothing of the step is in flight yet), the same step on every rank.
The optimizer's ``synchronize`` is timed too (what a step waits for its collectives).
"""
from __future__ import annotations

import math
import statistics
import time
import types
from typing import Any, List, Sequence, Tuple

import torch

from ..core.autodensity import AutoDensity, Measurement
from ..core.payload import PayloadLayout
from ..core.policy import sample_size
from .selection import backend_for

__all__ = ["probe_sizes", "measure", "install_wait_timer"]

#: The large probe carries the model's dense gradient bytes, within these bounds: large enough that its transfer
#: time stands well above one collective's latency on a fast link, small enough that 8 MiB is ~0.7 s of a
#: 100 Mbit/s link by arithmetic (8 MiB x 8 / 1e8).
PROBE_MIN_BYTES = 256 * 1024
PROBE_MAX_BYTES = 8 * 1024 * 1024
SMALL_REPEATS = 5
#: Small collectives submitted together to measure what one more costs in a step's stream of them.
BURST = 16
LARGE_REPEATS = 2
#: The selection timed for the first decision: up to this many entries of the largest tensor, ratio 0.01.
SELECT_PROBE_NUMEL = 1 << 22


def probe_sizes(dense_nbytes: int) -> int:
    """Bytes of the large probe for a model whose gradients are ``dense_nbytes`` bytes (the same on every rank)."""
    return int(min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, dense_nbytes))) // 4 * 4


def _timed_allreduce(numel: int, name: str, process_set: Any, repeats: int, pick: Any) -> float:
    from horovod.torch.mpi_ops import Sum, allreduce

    buf = torch.zeros(numel, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        allreduce(buf, name=name, op=Sum, process_set=process_set)
        times.append(time.perf_counter() - started)
    return float(pick(times))


def _marginal_collective_seconds(process_set: Any, single_s: float) -> float:
    """What one more small collective adds when many are in flight, as a step's per-tensor allgathers are:
    BURST allgathers of one float submitted together, waited together, minus one alone, per extra collective.
    (A collective alone also pays Horovod's negotiation cycle, which a step's collectives share.)"""
    from horovod.torch.mpi_ops import allgather_async, synchronize

    one = torch.zeros(1, dtype=torch.float32)
    started = time.perf_counter()
    handles = [allgather_async(one, name=f"topk.auto.probe.burst.{i}", process_set=process_set) for i in range(BURST)]
    for handle in handles:
        synchronize(handle)
    burst = time.perf_counter() - started
    return max(0.0, (burst - single_s) / (BURST - 1))


def _selection_seconds_per_entry(numel: int, device: torch.device, selector: str) -> float:
    """Host time of one compress of ``numel`` entries at ratio 0.01 on ``device`` (synchronised on a GPU: this
    runs once per decision, not per step)."""
    n = max(1024, min(numel, SELECT_PROBE_NUMEL))
    flat = torch.randn(n, device=device)
    residual = torch.zeros(n, device=device)
    k = max(1, math.ceil(0.01 * n))
    layout = PayloadLayout(k, 4)
    backend = backend_for(flat, selector)
    best = math.inf
    for step in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        backend.compress(flat, residual, None, 0.0, layout, torch.float32, sample_size(k, n), step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
        residual.zero_()
    return best / n


def measure(auto: AutoDensity, tensors: Sequence[Tuple[str, int]], process_set: Any, device: torch.device,
            selector: str) -> Measurement:
    """Probe the link, time a selection, and gather every rank's row: the Measurement every rank decides from."""
    from horovod.torch.mpi_ops import allgather

    world_size = process_set.size()
    dense_nbytes = 4 * sum(n for _, n in tensors)
    large_bytes = probe_sizes(dense_nbytes)
    single = _timed_allreduce(1, "topk.auto.probe.small", process_set, SMALL_REPEATS, statistics.median)
    large = _timed_allreduce(large_bytes // 4, f"topk.auto.probe.{large_bytes}", process_set, LARGE_REPEATS, min)
    marginal = _marginal_collective_seconds(process_set, single)
    # The rate is what the large probe got beyond one collective alone; the latency the cost model counts per
    # collective is the marginal one (Measurement.link subtracts it from the large probe: add it back).
    large = large - single + marginal
    largest = max((n for _, n in tensors), default=1024)
    select = _selection_seconds_per_entry(largest, device, selector)
    row = torch.tensor([auto.local_row(marginal, large, select, single)], dtype=torch.float64)
    rows: List[List[float]] = allgather(row, name="topk.auto.measure", process_set=process_set).tolist()
    moved = 2.0 * (world_size - 1) / world_size * large_bytes  # what one rank sends in a ring allreduce
    return Measurement.from_rows(rows, moved, world_size)


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
