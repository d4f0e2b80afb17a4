"""Per-tensor decisions: dense or Top-K, and how many entries.

Pure functions of (configuration, tensor size, dtype kind): every rank computes the same answer without talking
to the others, which is what keeps the collectives matched.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .config import MAX_COMPRESSED_NUMEL, TopKConfig
from .exchange import ALLGATHER, DENSE, choose_exchange
from .payload import payload_layout

__all__ = [
    "TensorPlan",
    "selected_count",
    "plan_tensor",
    "warmup_ratio",
    "tensor_payload_layout",
    "RouteSchedule",
    "route_schedule",
    "warmup_schedule",
    "allgather_nbytes",
    "ring_allreduce_nbytes",
    "sample_size",
    "CANDIDATE_MARGIN",
    "residual_world_factor",
    "spike_guard_scale",
    "SPIKE_GUARD_WARMUP_STEPS",
    "SPIKE_GUARD_DECAY",
]

#: The sampled selectors aim their threshold at CANDIDATE_MARGIN * k + 8 candidates (the C++ kernel uses the same
#: number): enough that fewer than k are found only rarely, few enough that choosing k among them stays cheap.
CANDIDATE_MARGIN = 1.3


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor on one step.

    ``k`` is None when the tensor goes dense; ``reason`` says why, for logs and ``stats()``. ``exchange`` is how
    a compressed tensor's entries travel (core.exchange: "allgather" or "sparse_allreduce"; "dense" when k is None,
    or "dense_fp16" under ratio="auto"'s fp16).
    """

    numel: int
    k: Optional[int]
    reason: str
    exchange: str = ALLGATHER

    @property
    def compressed(self) -> bool:
        return self.k is not None


def selected_count(numel: int, config: TopKConfig) -> int:
    """k for a tensor of ``numel`` elements: ceil(ratio * numel), or the fixed k, never more than numel nor < 1."""
    if numel < 1:
        raise ValueError(f"cannot select entries of an empty tensor (numel={numel})")
    if config.k is not None:
        return min(config.k, numel)
    # The small epsilon keeps ratio * numel that is an integer up to float rounding (0.01 * 300 = 3.0000000000000004)
    # from being rounded up to one entry more.
    return max(1, min(numel, math.ceil(config.ratio * numel - 1e-9)))


def warmup_ratio(config: TopKConfig, numel: int, step: int) -> float:
    """The ratio in force at ``step`` (0-based) of a tensor: exponential decay from 1 to the target over
    ``config.warmup_steps`` steps (DGC's sparsity warm-up), then the target. Monotone non-increasing."""
    target = min(1.0, config.k / numel) if config.k is not None else config.ratio
    if config.warmup_steps <= 0 or step >= config.warmup_steps:
        return target
    return float(target ** (step / config.warmup_steps))


def tensor_payload_layout(config: TopKConfig, k: int, numel: int, value_itemsize: int):
    """The payload layout (core.payload) of k entries of an N-element tensor under ``config``'s wire options;
    ``value_itemsize`` is the bytes of a value on the wire (1 for float8)."""
    return payload_layout(k, numel, value_itemsize, config.index_bits, config.value_dtype == "float8")


@dataclass(frozen=True)
class RouteSchedule:
    """A tensor's routes for a traced graph, where every route is a branch built in advance and the graph looks up
    which one a step takes: by step during the sparsity warm-up (warmup_schedule), by the density in force with
    ratio="auto" (core.autodensity.auto_schedule).

    Position i takes ``routes[phase[i]]`` ("dense", "dense_fp16", "allgather" or "sparse_allreduce"; the routes in the
    order the positions first take them) with ``count[i]`` entries (0 when dense, in either precision). A graph holds
    one branch per route, not one per k: a branch looks up its position's k and sizes (horovod_topk.tensorflow.sizes),
    so it sends exactly the entries and bytes PyTorch sends there.
    """

    routes: Tuple[str, ...]
    phase: Tuple[int, ...]
    count: Tuple[int, ...]


def route_schedule(plans: Sequence[TensorPlan]) -> Optional[RouteSchedule]:
    """The RouteSchedule of one plan per position, or None when every position goes dense as it is."""
    if all(plan.exchange == DENSE for plan in plans):
        return None
    routes: list = []
    for plan in plans:
        if plan.exchange not in routes:
            routes.append(plan.exchange)
    return RouteSchedule(tuple(routes), tuple(routes.index(plan.exchange) for plan in plans),
                         tuple(plan.k or 0 for plan in plans))


def bucket_routes(schedules: Sequence[RouteSchedule]) -> Tuple[Tuple[Tuple[str, ...], ...], Tuple[int, ...]]:
    """The routes a bucket's members take together, for a traced graph that holds one branch per combination.

    ``schedules``: one RouteSchedule per member, all over the same positions (one sparsity warm-up, or
    ratio="auto"'s densities). Returns (the distinct combinations, each a route per member, in the order the
    positions first take them; the combination each position takes). Members that change route at the same
    positions give as few combinations as one of them (a warm-up that goes dense, then allgather: two, whatever the
    number of members); members that change at different positions give more, each a branch that holds every
    member's path, so a caller keeps such members in separate buckets. A branch executes a combination as one
    bucket (the members that go dense alone, the others sharing their exchange's collectives), and the sizes
    within it are each member's own at the bucket's position, as on its own at that position."""
    lengths = {len(schedule.phase) for schedule in schedules}
    if len(lengths) != 1:
        raise ValueError(f"horovod-topk: a bucket's route schedules must cover the same positions, got lengths "
                         f"{sorted(lengths)}")
    combinations: list = []
    which = []
    for position in range(lengths.pop()):
        combination = tuple(s.routes[s.phase[position]] for s in schedules)
        if combination not in combinations:
            combinations.append(combination)
        which.append(combinations.index(combination))
    return tuple(combinations), tuple(which)


def warmup_schedule(
    name: str, numel: int, is_floating: bool, config: TopKConfig, *, world_size: int, value_itemsize: int,
    grad_itemsize: int, sparse_available: bool = False,
) -> Optional[RouteSchedule]:
    """The RouteSchedule of a tensor's steps t = 0 .. warmup_steps (later steps use the last position), or None
    when it goes dense after the warm-up. ``sparse_available`` as for plan_tensor: each step's route weighs the
    sparse allreduce too."""
    plans = [plan_tensor(name, numel, is_floating, config, world_size=world_size, step=t,
                         value_itemsize=value_itemsize, grad_itemsize=grad_itemsize,
                         sparse_available=sparse_available)
             for t in range(config.warmup_steps + 1)]
    if plans[-1].k is None:
        return None
    return route_schedule(plans)


def allgather_nbytes(world_size: int, k: int, entry_nbytes: int) -> int:
    """Bytes each rank receives in an allgather of P payloads of k entries (its own included, as Horovod does)."""
    return world_size * k * entry_nbytes


def ring_allreduce_nbytes(world_size: int, numel: int, itemsize: int) -> float:
    """Bytes each rank sends (and receives) in a ring allreduce of N elements: 2 (P - 1) / P * N * itemsize."""
    return 2.0 * (world_size - 1) / world_size * numel * itemsize


def plan_tensor(
    name: str,
    numel: int,
    is_floating: bool,
    config: TopKConfig,
    *,
    world_size: int = 2,
    step: int = 0,
    value_itemsize: int = 4,
    grad_itemsize: int = 4,
    sparse_available: bool = False,
) -> TensorPlan:
    """Decide how the tensor called ``name`` travels at its ``step``.

    Non-floating tensors (integer counters, masks), tensors under ``config.min_numel``, and — with
    ``config.dense_fallback`` — tensors whose exchange would move more bytes than a ring allreduce go dense.
    Otherwise the exchange is core.exchange.choose_exchange's three-way choice (dense, allgather, sparse
    allreduce: fewest bytes per rank, each collective counted as config.collective_latency_bytes bytes);
    ``sparse_available`` says whether the calling framework has the sparse allreduce. Every input is the same on every rank, so every rank decides alike. A tensor too large for int32 indices is
    refused with an error that names it.
    """
    if is_floating and numel > MAX_COMPRESSED_NUMEL and numel >= config.min_numel:
        raise ValueError(
            f"tensor {name!r} has {numel} elements; Top-K payloads index with int32, so a compressed tensor must "
            f"have at most {MAX_COMPRESSED_NUMEL}: split it into several smaller parameters."
        )
    return _plan(numel, is_floating, config, world_size, warmup_phase(config, step), value_itemsize, grad_itemsize,
                 sparse_available)


def warmup_phase(config: TopKConfig, step: int) -> int:
    """The step as far as a plan can tell: warmup_ratio is the target from ``config.warmup_steps`` on, so every
    later step plans alike (what lets plans be remembered across steps)."""
    return min(step, config.warmup_steps)


@functools.lru_cache(maxsize=4096)
def _plan(numel: int, is_floating: bool, config: TopKConfig, world_size: int, step: int, value_itemsize: int,
          grad_itemsize: int, sparse_available: bool) -> TensorPlan:
    """plan_tensor's decision, remembered: the same inputs give the same (immutable) plan, and a framework asks
    for every tensor on every step (~35 us each, the exchange's cost model; ~2 ms per step for ResNet-50's 54
    tensors under Horovod)."""
    if not is_floating:
        return TensorPlan(numel, None, "not floating point", DENSE)
    if numel == 0:
        return TensorPlan(numel, None, "empty", DENSE)
    if numel < config.min_numel:
        return TensorPlan(numel, None, f"smaller than min_numel={config.min_numel}", DENSE)
    ratio = warmup_ratio(config, numel, step)
    k = max(1, min(numel, math.ceil(ratio * numel - 1e-9))) if config.warmup_steps else selected_count(numel, config)
    exchange, nbytes = choose_exchange(
        config.exchange, world_size, numel, k, value_itemsize, grad_itemsize,
        dense_fallback=config.dense_fallback, sparse_available=sparse_available and not config.compact,
        payload_nbytes=tensor_payload_layout(config, k, numel, value_itemsize).nbytes if config.compact else None,
        collective_latency_bytes=config.collective_latency_bytes,
    )
    if exchange == DENSE:
        return TensorPlan(numel, None, f"dense is cheaper at k={k} ({nbytes:.0f} bytes per rank)", DENSE)
    return TensorPlan(numel, k, "top-k", exchange)


def sample_size(k: int, numel: int) -> int:
    """How many magnitudes the sampled selector looks at to estimate its threshold.

    About 60 / (k / N): ~60 sampled values above the threshold keep its estimate within ~13% (one standard
    deviation), so the 1.3x candidate margin the selectors aim at (CANDIDATE_MARGIN) is over two standard
    deviations and a rescan (one more read pass) stays rare on large tensors. Capped at N / 32 so that the sample
    never costs more than a small part of the pass it serves. (Sampling small tensors whole, which makes their
    threshold exact, was measured slower overall on ResNet-50: their rescans are cheaper than the whole sample.)
    """
    wanted = max(1024, 60 * numel // max(k, 1))
    return int(min(numel, wanted, max(1024, numel // 32)))



def residual_world_factor(op_name: str, saved_world_size: Optional[int], world_size: int) -> float:
    """What a rank multiplies its residual by when the number of workers changed from ``saved_world_size`` to
    ``world_size`` (Horovod elastic, or a process set of another size), so that the mass it owes the model stays
    the same: with Average the update receives residual / P, so P'/P; with Sum it receives the residual itself, 1.
    The residuals of workers that are gone are lost with them; new workers start from zero."""
    if saved_world_size is None or saved_world_size == world_size or op_name != "average":
        return 1.0
    return world_size / saved_world_size


#: Gradients are large and fast-changing early in training: no capping before the level has settled.
SPIKE_GUARD_WARMUP_STEPS = 50
#: Weight of the past in the running level of a tensor's gradient norm (a time constant of ~10 steps).
SPIKE_GUARD_DECAY = 0.9


def spike_guard_scale(norm: float, level: float, guard: float, step: int) -> Tuple[float, float]:
    """(factor to multiply this step's gradient by, new running level) under TopKConfig.spike_guard = ``guard``,
    for a gradient of L2 norm ``norm`` at the tensor's ``step``, whose running level was ``level``.

    The level follows the capped norms, so a spike does not raise the cap meant to contain it. Before
    SPIKE_GUARD_WARMUP_STEPS, or while the level is 0, nothing is capped. A non-finite norm changes nothing (the
    non-finite path handles that gradient).
    """
    if not math.isfinite(norm):
        return 1.0, level
    if level <= 0.0:
        return 1.0, norm
    factor = 1.0
    if step >= SPIKE_GUARD_WARMUP_STEPS and norm > guard * level:
        factor = guard * level / norm
        norm = guard * level
    return factor, SPIKE_GUARD_DECAY * level + (1 - SPIKE_GUARD_DECAY) * norm
