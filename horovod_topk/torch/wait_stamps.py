"""How long a step waited for its collectives, stamped where the wait begins and where each collective is done: on
the host for CPU tensors, with CUDA events for GPU ones.

Why two kinds: a Gloo collective's future completes when its data has arrived, so host timestamps measure the
wait. An NCCL collective's future completes when its work is queued on a stream, so host timestamps would read
every wait as zero; the wait on a GPU is between the device's own timeline points: an event recorded on the
current stream after the last launch (its compute is done there) and one recorded in each collective's
completion callback (torch runs a CUDA future's callbacks on streams that wait for the collective's kernels). The
events are read later, when the wait is needed (:meth:`CudaStamps.seconds` waits for them: the one host
synchronisation, taken only in the steps whose wait counts, core.autodensity.AutoDensity.wait_counts).
"""
import threading
import time
from typing import List, Optional, Union

import torch

__all__ = ["HostStamps", "CudaStamps", "stamps_for"]


class HostStamps:
    """A wait timed on the host: ``ready`` once, ``done`` from any thread (the latest counts)."""

    def __init__(self) -> None:
        self._ready = 0.0
        self._done = 0.0
        self._lock = threading.Lock()

    def ready(self) -> None:
        self._ready = time.perf_counter()

    def done(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._done = max(self._done, now)

    def seconds(self) -> Optional[float]:
        """The wait, None when no collective completed after ``ready`` (nothing was waited for)."""
        with self._lock:
            done = self._done
        return done - self._ready if done > self._ready > 0.0 else None


class CudaStamps:
    """A wait timed on a GPU's timeline: ``ready`` records an event on the current stream, ``done`` one on the
    current stream of a collective's completion callback; the wait is from ready to the latest done."""

    def __init__(self) -> None:
        self._ready: Optional[torch.cuda.Event] = None
        self._done: List[torch.cuda.Event] = []
        self._lock = threading.Lock()

    @staticmethod
    def _record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self) -> None:
        self._ready = self._record()

    def done(self) -> None:
        event = self._record()
        with self._lock:
            self._done.append(event)

    def seconds(self) -> Optional[float]:
        """The wait (synchronising with the recorded events), None when nothing was recorded after ``ready``.
        A collective done before ``ready`` was recorded counts as no wait."""
        with self._lock:
            done = list(self._done)
        if self._ready is None or not done:
            return None
        self._ready.synchronize()
        for event in done:
            event.synchronize()
        return max(0.0, max(self._ready.elapsed_time(event) for event in done) / 1000.0)


def stamps_for(device: torch.device) -> Union[HostStamps, CudaStamps]:
    """The stamps that time a wait for collectives on ``device``'s tensors."""
    if device.type == "cuda":
        return CudaStamps()
    if device.type != "cpu":
        raise ValueError(f"horovod-topk: ratio='auto' times its collectives on the CPU (host clock) or on CUDA "
                         f"(events); tensors on '{device.type}' have neither. Pass a fixed ratio.")
    return HostStamps()
