"""The measurement behind a ratio="auto" decision: which probes run, in which order, and how their times become the
Measurement every rank decides from (core.autodensity).

Why here: PyTorch and TensorFlow probe the link the same way and only their collectives differ, so the sequence
and its arithmetic live in core and each framework supplies a small :class:`LinkProbes` (its timed collectives,
one timed selection, one allgather of rows). The probes run at a decision step, before any compressed collective
of that step is launched, the same step on every rank.
"""
from __future__ import annotations

import statistics
from typing import List, Protocol, Sequence, Tuple

from .autodensity import AutoDensity, Measurement

__all__ = [
    "PROBE_MIN_BYTES",
    "PROBE_MAX_BYTES",
    "SMALL_REPEATS",
    "LARGE_REPEATS",
    "BURST",
    "SELECT_PROBE_NUMEL",
    "SMALL_PROBE_NAME",
    "MEASURE_NAME",
    "LinkProbes",
    "probe_nbytes",
    "large_probe_name",
    "burst_name",
    "measure",
]

#: The large probe carries the model's dense gradient bytes, within these bounds: large enough that its transfer
#: time stands well above one collective's latency on a fast link, small enough that 8 MiB is ~0.7 s of a
#: 100 Mbit/s link by arithmetic (8 MiB x 8 / 1e8).
PROBE_MIN_BYTES = 256 * 1024
PROBE_MAX_BYTES = 8 * 1024 * 1024
#: The lone collective's median is of three: each is a full round of Horovod's negotiation (~36 ms on 4 workers of
#: the test bed), and its reading varies by a few ms, not by the factor a fourth or fifth would catch.
SMALL_REPEATS = 3
#: The large probe twice, the faster counting: a single one read 50.8 Mbit/s through a 100 Mbit/s link of the test
#: bed (digits, 4 workers), where pairs read within ~15% of each other (103/132, 112/127, 116/114, 124/112 ms), and
#: the choice taken on it (0.03) was changed three times in the next 36 steps.
LARGE_REPEATS = 2
#: Small collectives submitted together to measure what one more costs in a step's stream of them.
BURST = 16
#: The selection timed for a decision: up to this many entries of the largest tensor, ratio 0.01.
SELECT_PROBE_NUMEL = 1 << 22
#: Collective names of the probes (deterministic, the same on every rank).
SMALL_PROBE_NAME = "topk.auto.probe.small"
MEASURE_NAME = "topk.auto.measure"


def probe_nbytes(dense_nbytes: int) -> int:
    """Bytes of the large probe for a model whose gradients are ``dense_nbytes`` bytes (the same on every rank)."""
    return int(min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, dense_nbytes))) // 4 * 4


def large_probe_name(nbytes: int) -> str:
    return f"topk.auto.probe.{nbytes}"


def burst_name(position: int) -> str:
    return f"topk.auto.probe.burst.{position}"


class LinkProbes(Protocol):
    """What a framework supplies for a measurement: synchronous, timed on the host."""

    def allreduce_seconds(self, numel: int, name: str, repeats: int) -> List[float]:
        """Seconds of each of ``repeats`` synchronous sum-allreduces of ``numel`` float32 zeros called ``name``."""

    def burst_seconds(self, count: int) -> float:
        """Seconds for ``count`` one-float allgathers (names burst_name(i)) submitted together and waited
        together."""

    def select_seconds_per_entry(self, numel: int) -> float:
        """Host seconds per entry of one compress of ``numel`` entries at ratio 0.01 on this rank's device."""

    def gather_rows(self, row: Sequence[float]) -> List[List[float]]:
        """Every rank's ``row`` (float64), in rank order, under MEASURE_NAME."""


def measure(auto: AutoDensity, tensors: Sequence[Tuple[str, int]], probes: LinkProbes, world_size: int,
            grad_itemsize: int = 4) -> Measurement:
    """Probe the link, time a selection, and gather every rank's row: the Measurement every rank decides from.

    A regular decision first gathers the rows with the last probes (AutoDensity.confirmable_probes) and keeps
    them when they settle it (AutoDensity.link_settles); otherwise it probes and gathers again.
    The rate is what the large probe got beyond one collective alone; the latency the cost model counts per
    collective is the marginal one, what one more collective adds among many in flight (a collective alone also
    waits for its own turn of Horovod's negotiation cycle, which a step's collectives share).
    """
    dense_nbytes = grad_itemsize * sum(n for _, n in tensors)
    large_bytes = probe_nbytes(dense_nbytes)
    moved = 2.0 * (world_size - 1) / world_size * large_bytes  # what one rank sends in a ring allreduce
    reused = auto.reusable_probes()
    kept = auto.confirmable_probes() if reused is None else None
    if kept is not None:  # a regular decision: the last probes may settle it (one gather, no probes)
        m = Measurement.from_rows(probes.gather_rows(auto.local_row(*kept)), moved, world_size)
        if auto.link_settles(tensors, m, grad_itemsize):
            auto.remember_probes(m, reused=True)
            return m
    if reused is not None:  # the check of a change: the link as probed a window ago (every rank alike)
        marginal, large, select, single = reused
    else:
        single = float(statistics.median(probes.allreduce_seconds(1, SMALL_PROBE_NAME, SMALL_REPEATS)))
        large = float(min(probes.allreduce_seconds(large_bytes // 4, large_probe_name(large_bytes), LARGE_REPEATS)))
        marginal = max(0.0, (probes.burst_seconds(BURST) - single) / (BURST - 1))
        # Measurement.link subtracts the marginal latency from the large probe: count it instead of the lone one
        large = large - single + marginal
        largest = max((n for _, n in tensors), default=1024)
        select = probes.select_seconds_per_entry(max(1024, min(largest, SELECT_PROBE_NUMEL)))
    rows = probes.gather_rows(auto.local_row(marginal, large, select, single))
    m = Measurement.from_rows(rows, moved, world_size)
    if reused is None:  # fresh probes: within LINK_NOISE of the link the predictions take, that link stays
        m = auto.steady_link(m)
    auto.remember_probes(m, reused=reused is not None)
    return m
