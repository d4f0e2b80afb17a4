"""Where one ``optimizer.synchronize()`` goes, on one rank: its selection kernels, its adding back, Horovod's waits,
and the rest (Python: Horovod's hook per gradient, horovod-topk's planning, the allocations between kernels).

Why a timer and not a profiler: cProfile adds about a microsecond to each of the ~6,000 Python calls of a ResNet-50
``synchronize()``, more than the Python it is meant to find; a wall clock around the few calls that do the work costs
nothing measurable. Used by ``bench_sync.py --phases``:

    python benchmarks/bench_sync.py --models resnet50-25.6M --methods topk --rounds 30 --phases

Each phase is the sum of the wall time spent inside its calls during one ``synchronize()`` (a call inside another
timed call counts once, in the outer one); "rest" is what is left of the ``synchronize()``.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

#: (class attribute names) -> phase: the backends' selection and adding back, one tensor or a bucket at a time.
KERNEL_PHASES = {"compress": "select", "compress_group": "select", "decompress": "add back",
                 "decompress_group": "add back"}
PHASES = ("select", "add back", "wait")


class PhaseTimer:
    """Per ``synchronize()``: seconds in each of PHASES, and the whole call."""

    def __init__(self) -> None:
        self.rows: List[Dict[str, float]] = []
        self._current: Dict[str, float] = {}
        self._inside = False  # within a timed synchronize()
        self._depth = 0  # within a timed call (nested calls count once)

    def _timed(self, function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._inside or self._depth:
                return function(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                self._current[phase] = self._current.get(phase, 0.0) + time.perf_counter() - started
        return timed

    def install(self) -> None:
        """Wrap the backends' kernels, Horovod's wait and its optimizer's synchronize() (process-wide)."""
        import horovod.torch.mpi_ops as mpi_ops
        import horovod.torch.optimizer as hvd_optimizer
        from horovod_topk.torch import selection

        for cls in (selection.Backend, selection.ReferenceBackend, selection.DeviceBackend, selection.FusedBackend,
                    selection.TritonBackend):
            for attribute, phase in KERNEL_PHASES.items():
                if attribute in cls.__dict__:
                    setattr(cls, attribute, self._timed(cls.__dict__[attribute], phase))
        mpi_ops.synchronize = self._timed(mpi_ops.synchronize, "wait")
        hvd_optimizer.synchronize = self._timed(hvd_optimizer.synchronize, "wait")  # its own import, dense's waits
        optimizer = hvd_optimizer._DistributedOptimizer
        synchronize = optimizer.synchronize
        timer = self

        def timed_synchronize(opt: Any) -> Any:
            timer._inside, timer._current = True, {}
            started = time.perf_counter()
            try:
                return synchronize(opt)
            finally:
                timer._inside = False
                timer._current["synchronize"] = time.perf_counter() - started
                timer.rows.append(timer._current)

        optimizer.synchronize = timed_synchronize

    def take(self) -> List[Dict[str, float]]:
        """The rows recorded since the last take (one per synchronize())."""
        rows, self.rows = self.rows, []
        return rows


def summary(rows: List[Dict[str, float]]) -> Dict[str, float]:
    """Medians in ms over ``rows``: the whole synchronize(), each phase, and the rest."""
    if not rows:
        return {}
    out = {"synchronize": 1000 * statistics.median(r["synchronize"] for r in rows)}
    for phase in PHASES:
        out[phase] = 1000 * statistics.median(r.get(phase, 0.0) for r in rows)
    out["rest"] = 1000 * statistics.median(r["synchronize"] - sum(r.get(p, 0.0) for p in PHASES) for r in rows)
    return out
