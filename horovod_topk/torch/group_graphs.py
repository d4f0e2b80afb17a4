"""A bucket's grouped selection, and its adding back, each replayed as one CUDA graph (the default on CUDA;
``HOROVOD_TOPK_CUDA_GRAPHS=0`` turns it off; ``=bucket`` also records a steady DDP bucket's whole step, its
collectives included, with the same recorder: torch.bucket_graph).

Why: on a GPU the grouped selection's time is the host's, not the device's. One bucket is ~12 Triton launches and
~10 small torch operations, each tens of microseconds of Python and driver work, while the kernels themselves take
~0.2 ms per 25 MB (docs/performance.md, "GPUs"). Recorded once as a CUDA graph, the same work is one launch.

What makes it safe to replay: the recorded work reads the bucket's gradients and the group's residual buffer, and
writes the residuals, a payload and the group's non-finite counts, all at fixed addresses. A graph is recorded per
(group, addresses of the gradients and residuals): a bucket rebuilt or a residual moved gets a new one, so a replay
never reads stale memory. Its outputs are the graph's own buffers, overwritten by the next replay: the payload is
read by the bucket's allgather, which completes before the next step's backward (DDP waits for every bucket).
The adding back (torch.bucket_select) is recorded per (gathered rows, gradients, scale): the rows are the group's own
allgather destination, the same buffer every step, and its P launches (one per rank) become one. A steady DDP
bucket's dense members ride along: gathered with the selection, copied back with the adding back.

Recording happens on the second step a group is seen (the first runs eagerly: it compiles the Triton kernels and
adopts the residuals); recording synchronises the device once, so it is a first-steps cost, never a steady-state
one. Any failure to record (a driver without graph support, memory) turns graphs off for that group, with one
warning, and the eager path runs as before.

Why on by default: without them a GPU step pays ~3x the host time (docs/performance.md, "GPUs": +6.9 against +2.4 ms
on ResNet-50's shapes, +21.4 against +6.1 ms on GPT-2 small's), and what they cost is bounded and safe to fall back
from: one device synchronisation per bucket while recording, a private pool of ~2% of the bucket, results equal to
the eager path's (tests/pytorch/test_bucket_select.py). The whole bucket's graph stays opt-in: a collective inside a
graph is not watched by ProcessGroupNCCL's watchdog, so a rank that never arrives would hang the job instead of
turning into a timeout error.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch

__all__ = ["ENV", "GroupGraphs", "enabled", "whole_buckets"]

#: The switch: "1" or unset records each bucket's grouped selection and its adding back as CUDA graphs; "bucket"
#: also records a steady bucket's whole step, its collectives included, as one graph (torch.bucket_graph); "0": none.
ENV = "HOROVOD_TOPK_CUDA_GRAPHS"
_MODES = ("", "0", "1", "bucket")

Outputs = Tuple[torch.Tensor, ...]


def _mode() -> str:
    value = os.environ.get(ENV, "").strip()
    if value not in _MODES:
        raise ValueError(f"horovod-topk: {ENV}={value!r} is not a mode; use 1 (the selection and adding back as CUDA "
                         f"graphs, the default), bucket (a steady bucket's whole step, collectives included) or 0 "
                         f"(none)")
    return value


def enabled(device: torch.device) -> bool:
    """Whether graphs of the selection and adding back are to be recorded on ``device``: on CUDA unless turned off."""
    return device.type == "cuda" and _mode() != "0"


def whole_buckets(device: torch.device) -> bool:
    """Whether a steady bucket's whole step is to be one graph (torch.bucket_graph), and possible on ``device``."""
    return device.type == "cuda" and _mode() == "bucket"


class GroupGraphs:
    """One group's recorded graphs, one per set of addresses (gradients, residuals); the group owns it, so a graph
    never outlives the layout tables it reads."""

    _KEPT = 4  # a bucket's gradients move only when DDP rebuilds its buckets

    def __init__(self) -> None:
        self._graphs: Dict[Hashable, Tuple[Any, Outputs]] = {}
        self._seen: Dict[Hashable, int] = {}
        self._failed: set = set()
        #: Replays so far (a benchmark reads it to show which path ran).
        self.replays = 0

    def run(self, key: Hashable, work: Callable[[], Outputs], device: torch.device) -> Outputs:
        """``work()``'s outputs: eager the first time ``key`` is seen, recorded as a graph the second time, replayed
        from then on."""
        found = self._graphs.get(key)
        if found is not None:
            graph, outputs = found
            graph.replay()
            self.replays += 1
            return outputs
        seen = self._seen.get(key, 0)
        if len(self._seen) > 4 * self._KEPT:  # addresses that never came back (gradients in new buffers each step)
            self._seen.clear()
            self._failed.clear()
        self._seen[key] = seen + 1
        if seen == 0 or key in self._failed:
            return work()
        recorded = self._record(key, work, device)
        if recorded is None:
            return work()
        graph, outputs = recorded
        graph.replay()  # recording does not run the work: this step's results come from the first replay
        self.replays += 1
        return outputs

    def _record(self, key: Hashable, work: Callable[[], Outputs], device: torch.device) -> Optional[Tuple[Any, Outputs]]:
        try:
            graph = torch.cuda.CUDAGraph()
            # thread-local: DDP runs the hook in autograd's device thread while the main thread waits
            with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = work()
        except Exception as err:  # noqa: BLE001 -- any failure leaves the eager path, which is always correct
            self._failed.add(key)
            warnings.warn(f"horovod-topk: recording a bucket's work as a CUDA graph failed ({err!r}); this "
                          f"work runs without a graph", RuntimeWarning, stacklevel=3)
            return None
        if len(self._graphs) >= self._KEPT:
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = (graph, outputs)
        return graph, outputs
