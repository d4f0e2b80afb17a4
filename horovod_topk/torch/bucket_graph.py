"""A steady DDP bucket's whole step -- its selection, its collectives and its adding back -- recorded once as one CUDA
graph and replayed on a side stream (opt-in: ``HOROVOD_TOPK_CUDA_GRAPHS=bucket``, NCCL).

Why: with the selection and the adding back each replayed as a graph (torch.group_graphs), what a bucket still cost
the host was the two collectives' launches through c10d and the Python between them, and on a GPU the training step
waits for the host (docs/performance.md, "A bucket in a training step"). NCCL collectives can be captured: one
replay launches the bucket's ~25 kernels, two collectives and their stream joins (on an H200, 0.003 ms of host time
against 0.125 ms for an allgather, an allreduce and three small operations launched one by one).

Why a side stream: the graph ends with the adding back, which waits for the collectives; replayed on the hook's
stream it would hold backward's next kernels until the bucket's collectives finish. On its own stream (which first
waits for the hook's: the bucket was filled there) the collectives overlap backward as NCCL's own stream lets them,
and the Future handed to DDP carries the side stream's event, so DDP's wait joins them.

What is recorded is device work only (SteadySelection.select_on_device / add_back_on_device, SteadyBucket's dense
gather and scatter); the host's part of the step -- each member's counters and bytes, the selection's time -- runs
on every step outside the graph (SteadyBucket.count). The graph belongs to its SteadyBucket, which is used only while
the plan, the bucket buffer, the records and the residual views are the ones it was made with, so a replay never
reads memory that was given away. A step that is not steady (the first steps, a warm-up moving k, a load, rebuilt
buckets, a dense member still sending leftovers) takes the usual path.

What it gives up, and why it is opt-in: a collective inside a graph is not watched by ProcessGroupNCCL's watchdog,
so a rank that never arrives is not turned into a timeout error; every rank must replay the same collectives in the
same order, which they do since every rank makes the same steady buckets at the same steps (rank agreement checked
their plans), but the path has run with one process only. Recorded and eagerly launched collectives share one NCCL
communicator (NCCL's default; with ``NCCL_GRAPH_MIXING_SUPPORT=0`` every bucket takes the usual path, with a
warning).
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.bucket_plan import BucketPlan
from ..core.pending import reduction_scale
from . import group_graphs
from .dist_collectives import all_gather_single
from .steady_bucket import SteadyBucket, kept

__all__ = ["BucketGraph", "asked", "possible", "run"]

#: Per device: the side stream where the buckets' graphs replay (in bucket order, as NCCL's own stream runs
#: collectives), the event it waits on, the device's index.
_STREAMS: Dict[torch.device, Tuple[Any, Any, int]] = {}
#: Whether possible() has warned about NCCL_GRAPH_MIXING_SUPPORT=0 (once per process).
_WARNED: list = []


def asked(device: torch.device) -> bool:
    """Whether whole buckets as graphs are asked for, on a CUDA device (group_graphs.whole_buckets): read per
    bucket, so it comes first and is cheap."""
    return group_graphs.whole_buckets(device)


def possible(group: Any) -> bool:
    """Whether ``group``'s collectives can be recorded in a CUDA graph: NCCL's can, Gloo's cannot; and NCCL must
    allow recorded and eagerly launched collectives on one communicator (the buckets that are not steady, the
    agreement check and ratio="auto"'s probes are launched eagerly), which ``NCCL_GRAPH_MIXING_SUPPORT=0`` forbids.
    Read once per steady bucket."""
    if dist.get_backend(group) != "nccl":
        return False
    if os.environ.get("NCCL_GRAPH_MIXING_SUPPORT", "").strip() == "0":
        if not _WARNED:
            _WARNED.append(True)
            warnings.warn(f"horovod-topk: {group_graphs.ENV}=bucket needs NCCL to mix recorded and launched "
                          f"collectives, which NCCL_GRAPH_MIXING_SUPPORT=0 forbids: buckets take the usual path",
                          RuntimeWarning, stacklevel=2)
        return False
    return True


class BucketGraph:
    """One steady bucket's whole step as a graph: kept by its SteadyBucket, recorded on the second step it runs
    (the first runs the same work eagerly), replayed from then on."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group = group
        #: Whether the group's collectives can be recorded (NCCL); if not, the bucket takes the usual path.
        self.possible = possible(group)
        self.world_size = world_size
        self.scale = reduction_scale("average", 1.0, 1.0, world_size)
        self.graphs = group_graphs.GroupGraphs()
        self._ran = False  # whether this step ran the work (eagerly, or while recording it) rather than a replay

    def step(self, state: Any, steady: SteadyBucket, buffer: torch.Tensor) -> None:
        """The bucket's step: host bookkeeping, then the device work (replayed, or run while it is recorded).

        The selection's host time (what ratio="auto" subtracts from a step as compression, TensorRecord's
        compress_seconds) is a replay's launch, the whole bucket's; the two steps that run the work instead (eagerly,
        then while recording it, which synchronises the device) count none: their time is not the selection's."""
        steady.count(state, buffer)
        self._ran = False
        started = time.perf_counter()
        self.graphs.run(buffer.data_ptr(), lambda: self._work(steady, buffer), buffer.device)
        if not self._ran:
            steady.selection.count_time(state, time.perf_counter() - started)

    def _work(self, steady: SteadyBucket, buffer: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Device work only: select, gather every rank's payload and sum the dense members, add back. The same
        operations, in the same order, as the usual path's steady step (torch.bucket_step), so the results are
        the same bit for bit."""
        self._ran = True
        payload = steady.selection.select_on_device(buffer)
        dense = steady.gather_dense(buffer) if steady.dense_ranges else None
        gathered = torch.empty(self.world_size * payload.numel(), dtype=torch.uint8, device=buffer.device)
        works = [all_gather_single(gathered, payload, group=self.group, async_op=True)]
        if dense is not None:
            works.append(dist.all_reduce(dense, group=self.group, async_op=True))
        for work in works:  # on CUDA: this stream waits for the collectives' (no host wait)
            work.wait()
        steady.selection.add_back_on_device(gathered.view(self.world_size, -1), self.scale, buffer)
        if dense is not None:
            steady.scatter_dense(buffer, dense)
        return (payload, gathered) if dense is None else (payload, gathered, dense)


def run(state: Any, plan: BucketPlan, buffer: torch.Tensor, world_size: int, slot: Optional[Dict[str, Any]],
        group: Any) -> Optional[torch.futures.Future]:
    """The bucket's whole step as a graph, if it is steady and graphs of whole buckets are possible: the Future of
    its averaged gradients (written over ``buffer``), complete once the side stream's work is; else None, and the
    caller takes the usual path."""
    if slot is None or not asked(buffer.device):
        return None
    steady = kept(slot, state, plan, buffer, world_size)
    if steady is None or steady.leftovers_due:
        return None
    graph = steady.whole
    if graph is None or graph.group is not group:
        graph = steady.whole = BucketGraph(group, world_size)
    if not graph.possible:
        return None
    device = buffer.device
    if device.type != "cuda":  # (a test's stand-in for the recording, on the CPU)
        graph.step(state, steady, buffer)
        future = torch.futures.Future()
        future.set_result(buffer)
        return future
    side, joined, index = _side(device)
    current = torch.cuda.current_stream(index)
    joined.record(current)  # the side stream waits for the bucket to be filled, the host does not
    side.wait_event(joined)
    future = torch.futures.Future(devices=[device])
    torch.cuda.set_stream(side)
    try:
        graph.step(state, steady, buffer)
        future.set_result(buffer)  # records the side stream's event, which DDP's wait joins
    finally:
        torch.cuda.set_stream(current)
    return future


def _side(device: torch.device) -> Tuple[Any, Any, int]:
    """The buckets' side stream of ``device``, the event it waits on (reused: a wait takes the event's state at
    the time it is queued) and the device's index; made once. Plain stream switches rather than
    ``torch.cuda.stream()``: this runs for every bucket, and the context manager's device bookkeeping cost more
    host time than the replay itself."""
    found = _STREAMS.get(device)
    if found is None:
        found = _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Event(), device.index)
    return found
