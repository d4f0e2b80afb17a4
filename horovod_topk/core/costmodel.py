"""Predicted step time of data-parallel training: dense allreduce, Horovod's fp16 compression and TopKEF.

Answers "will Top-K pay on my link?" from numbers a user knows (tensor sizes, workers, link bandwidth, compute
time per step) with the same per-tensor decisions the compressor takes: each tensor's route and k come from
core.policy.plan_tensor (min_numel, dense_fallback, value_dtype, index_bits, exchange) and its bytes from
core.exchange (dense_nbytes, allgather_exchange_nbytes, sparse_allreduce_nbytes, the compact payload layout). Only
the time arithmetic below is this module's own.

The time model, per worker and step::

    bytes     = sum over tensors of the bytes its route sends (core.exchange's cost model)
    T_comm    = bytes / (BANDWIDTH_EFFICIENCY * bandwidth) + collectives * latency
    T_step    = T_compute + T_compress + T_comm - min(T_comm, overlap * T_compute)
    E         = T_compute / T_step

``collectives`` counts what Horovod launches per step: the dense tensors of a step are fused into one allreduce
per HOROVOD_FUSION_THRESHOLD (128 MiB, Horovod >= 0.21) of gradient bytes; a compressed tensor costs one allgather
(its payload), or two for the sparse allreduce (an alltoall, then an allgather). ``latency`` is the time of one
whole collective at this worker count (for ring algorithms it grows with P); the default 0 is what the test bed
has (it cannot emulate latency, README "Across machines, on one machine"). On one worker nothing travels.

``overlap`` is the fraction of T_compute during which communication can run (Horovod starts a tensor's collective
as soon as backward produced its gradient, so up to the backward share of the step). The default 0 makes the
prediction an upper bound and is what the test bed's measurements show: T_step - T_compute = bytes / (f * bandwidth)
+ c through the 100 Mbit/s and 1 Gbit/s rows below leaves c = -16 ms (dense) and -3.5 ms (fp16), i.e. at most a
few ms of 44 to 1024 ms of communication hidden. How much really hides depends on which tensors finish last and on
Horovod's cycle time, which a list of tensor sizes does not tell.

``T_compress`` (compress + decompress of TopKEF per step) is the caller's number: it depends on the machine and
the selector (README "Speed of the compression itself": ~17 ms per step for ResNet-50 at ratio 0.01 on one CPU
thread). Horovod's fp16 cast is one elementwise pass and is left out.

BANDWIDTH_EFFICIENCY: a shaped link delivers less than its nominal rate (TCP/IP headers and acknowledgements, the
shaper's queue and TCP's reaction to it). Measured with benchmarks/bench_e2e.py on the test bed (2 workers, the
2.1M-parameter MLP, README "End-to-end step time"), rate delivered = model bytes * 8 / (T_step - T_compute):

    ==========  ======  ==============  ===========  ============  =========
    link        method  T_compute (ms)  T_step (ms)  model bytes   fraction
    ==========  ======  ==============  ===========  ============  =========
    100 Mbit/s  dense   17.3            1041.1       8.419 MB      0.66
    100 Mbit/s  fp16    21.1            487.8        4.210 MB      0.72
    300 Mbit/s  dense   18.5            301.8        8.419 MB      0.79
    300 Mbit/s  fp16    23.1            159.3        4.210 MB      0.82
    1 Gbit/s    dense   20.6            108.6        8.419 MB      0.77
    1 Gbit/s    fp16    20.7            64.2         4.210 MB      0.77
    ==========  ======  ==============  ===========  ============  =========

(8.44 MB at a nominal 100 Mbit/s would take 675 ms; it took 1024 ms.) 0.75 is the constant: every one of these
rows is then predicted within -12% .. +9%. The TopKEF rows of that table cannot calibrate it: their 0.02-0.17 MB per
step fits in the shaper's 256 KiB token-bucket burst (scripts/testbed.sh), so at 100 Mbit/s they leave faster than
the rate and the model over-predicts them (x1.55 for ratio 0.01; a real link has no such bucket); the other TopKEF
rows come out x0.62 .. x1.04, their 1-7 ms of communication (24 ms in one noisy run) being of the size of the
run-to-run noise (+-10 ms, README) and of what the model leaves to --compress-time and --latency (compression is not
in T_compute; 7 collectives per step). ``python -m horovod_topk.advise --check`` prints this comparison for any bench_e2e run.

Standard library only, like the rest of core.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, List, Optional, Sequence, Tuple

from .config import TopKConfig
from .exchange import (
    ALLGATHER,
    COLLECTIVES,
    DENSE,
    allgather_exchange_nbytes,
    dense_nbytes,
    exchange_nbytes,
)
from .policy import plan_tensor, tensor_payload_layout

__all__ = [
    "BANDWIDTH_EFFICIENCY",
    "FUSION_THRESHOLD_BYTES",
    "METHODS",
    "VALUE_ITEMSIZES",
    "Link",
    "TensorRoute",
    "Prediction",
    "route_tensors",
    "comm_time",
    "collectives_per_step",
    "step_time",
    "predict",
    "with_exchange",
]

#: Fraction of the nominal link rate a step's collectives get (measured; see the module docstring).
BANDWIDTH_EFFICIENCY = 0.75
#: Horovod's default HOROVOD_FUSION_THRESHOLD since 0.21: dense tensors ready together share one allreduce per this
#: many bytes.
FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024
#: "dense": Horovod's allreduce of the gradients; "fp16": hvd.Compression.fp16 (2-byte elements on the wire);
#: "int8": ratio="auto"'s int8 route (1 byte an element, core.exchange.DENSE_INT8); "topk": TopKEF with the
#: TopKConfig given (its ``exchange`` says allgather, sparse_allreduce or auto).
METHODS = ("dense", "fp16", "int8", "topk")
#: Bytes of one element on the wire of each dense method.
DENSE_ITEMSIZES = {"fp16": 2, "int8": 1}
#: Bytes of one value on the wire for each TopKConfig.value_dtype (None: the gradient's own).
VALUE_ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}


@dataclass(frozen=True)
class Link:
    """The network a worker sends through: nominal rate in bits per second, the fraction of it collectives get,
    and the time of one collective beyond its bytes."""

    bandwidth_bps: float
    efficiency: float = BANDWIDTH_EFFICIENCY
    latency_s: float = 0.0
    fusion_threshold_bytes: int = FUSION_THRESHOLD_BYTES

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise ValueError(f"bandwidth must be a positive number of bits per second, got {self.bandwidth_bps!r}")
        if not (0 < self.efficiency <= 1):
            raise ValueError(f"bandwidth efficiency must be in (0, 1], got {self.efficiency!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency must be a non-negative number of seconds, got {self.latency_s!r}")
        if self.fusion_threshold_bytes < 0:
            raise ValueError(f"fusion threshold must be >= 0 bytes, got {self.fusion_threshold_bytes!r}")


def latency_bytes(link: Link) -> int:
    """One collective's fixed time in bytes of this link (latency x effective rate): the
    TopKConfig.collective_latency_bytes under which exchange="auto" picks, per tensor, the exchange this module
    predicts fastest (choose_exchange then minimises bytes + collectives x latency_bytes, T_comm times a constant).
    """
    return int(round(link.latency_s * link.efficiency * link.bandwidth_bps / 8.0))


@dataclass(frozen=True)
class TensorRoute:
    """How one tensor travels under a method: ``route`` "dense", "allgather" or "sparse_allreduce", ``k`` its
    selected entries (None when dense), ``nbytes`` what one worker sends for it per step, ``reason`` plan_tensor's."""

    name: str
    numel: int
    route: str
    k: Optional[int]
    nbytes: float
    reason: str = ""


@dataclass(frozen=True)
class Prediction:
    """One method's predicted step: bytes per worker, collectives launched, and the times of the model above."""

    method: str
    routes: Tuple[TensorRoute, ...]
    nbytes: float
    collectives: int
    t_compute_s: float
    t_compress_s: float
    t_comm_s: float
    t_step_s: float

    @property
    def efficiency(self) -> float:
        """E = T_compute / T_step (1.0 means communication costs nothing)."""
        return self.t_compute_s / self.t_step_s if self.t_step_s > 0 else 1.0

    def route_counts(self) -> dict:
        """{route: (tensors, bytes)}: what exchange="auto" picked, summed per route."""
        counts: dict = {}
        for r in self.routes:
            n, b = counts.get(r.route, (0, 0.0))
            counts[r.route] = (n + 1, b + r.nbytes)
        return counts


def _value_itemsize(config: TopKConfig, grad_itemsize: int) -> int:
    return grad_itemsize if config.value_dtype is None else VALUE_ITEMSIZES[config.value_dtype]


def route_tensors(
    method: str,
    tensors: Sequence[Tuple[str, int]],
    world_size: int,
    *,
    config: Optional[TopKConfig] = None,
    grad_itemsize: int = 4,
    sparse_available: bool = True,
) -> List[TensorRoute]:
    """Each (name, numel) tensor's route and bytes per worker and step under ``method`` (see METHODS).

    TopKEF's routes are plan_tensor's (the compressor's own decision); the bytes are core.exchange's for that
    route, the compact payload's own size when it travels by allgather (as choose_exchange counts it).
    ``sparse_available``: False where the sparse allreduce cannot be used (both frameworks have it today)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if world_size < 1:
        raise ValueError(f"workers must be >= 1, got {world_size}")
    if method in ("dense", "fp16", "int8"):
        itemsize = DENSE_ITEMSIZES.get(method, grad_itemsize)
        return [TensorRoute(name, numel, DENSE, None, dense_nbytes(world_size, numel, itemsize), method)
                for name, numel in tensors]
    config = config or TopKConfig()
    value_itemsize = _value_itemsize(config, grad_itemsize)
    routes = []
    for name, numel in tensors:
        plan = plan_tensor(name, numel, True, config, world_size=world_size, value_itemsize=value_itemsize,
                           grad_itemsize=grad_itemsize, sparse_available=sparse_available)
        if plan.k is None:
            nbytes = dense_nbytes(world_size, numel, grad_itemsize)
        elif plan.exchange == ALLGATHER and config.compact:
            nbytes = (world_size - 1) * tensor_payload_layout(config, plan.k, numel, value_itemsize).nbytes
        elif plan.exchange == ALLGATHER:
            nbytes = allgather_exchange_nbytes(world_size, plan.k, value_itemsize)
        else:
            nbytes = exchange_nbytes(plan.exchange, world_size, numel, plan.k, value_itemsize, grad_itemsize)
        routes.append(TensorRoute(name, numel, plan.exchange, plan.k, float(nbytes), plan.reason))
    return routes


def collectives_per_step(routes: Iterable[TensorRoute], method: str, world_size: int, grad_itemsize: int,
                 link: Link) -> int:
    """Collectives one step launches (see the module docstring); 0 on one worker."""
    if world_size <= 1:
        return 0
    routes = list(routes)
    itemsize = DENSE_ITEMSIZES.get(method, grad_itemsize)
    dense_bytes = sum(r.numel * itemsize for r in routes if r.route == DENSE)
    has_dense = any(r.route == DENSE for r in routes)
    fused = 0
    if has_dense:
        fused = len([r for r in routes if r.route == DENSE]) if link.fusion_threshold_bytes == 0 else max(
            1, math.ceil(dense_bytes / link.fusion_threshold_bytes))
    # dense tensors are counted fused above; a compressed one launches its exchange's own collectives
    return fused + sum(COLLECTIVES[r.route] for r in routes if r.route != DENSE)


def comm_time(nbytes: float, collectives: int, link: Link) -> float:
    """T_comm = bytes / (efficiency * bandwidth) + collectives * latency, in seconds."""
    return nbytes * 8.0 / (link.efficiency * link.bandwidth_bps) + collectives * link.latency_s


def step_time(t_compute_s: float, t_comm_s: float, overlap: float = 0.0, t_compress_s: float = 0.0) -> float:
    """T_step = T_compute + T_compress + T_comm - min(T_comm, overlap * T_compute): communication can hide only
    behind compute that runs at the same time, and never more of it than there is."""
    if not (0.0 <= overlap <= 1.0):
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    return t_compute_s + t_compress_s + t_comm_s - min(t_comm_s, overlap * t_compute_s)


def predict(
    method: str,
    tensors: Sequence[Tuple[str, int]],
    world_size: int,
    link: Link,
    t_compute_s: float,
    *,
    config: Optional[TopKConfig] = None,
    grad_itemsize: int = 4,
    overlap: float = 0.0,
    t_compress_s: float = 0.0,
    sparse_available: bool = True,
) -> Prediction:
    """The predicted step of ``method`` (METHODS; "topk" with ``config``, whose exchange may be forced) for the
    (name, numel) ``tensors`` on ``world_size`` workers over ``link``. ``t_compress_s`` counts for "topk" only."""
    if not (math.isfinite(t_compute_s) and t_compute_s >= 0):
        raise ValueError(f"compute time must be a non-negative number of seconds, got {t_compute_s!r}")
    routes = route_tensors(method, tensors, world_size, config=config, grad_itemsize=grad_itemsize,
                           sparse_available=sparse_available)
    nbytes = sum(r.nbytes for r in routes)
    collectives = collectives_per_step(routes, method, world_size, grad_itemsize, link)
    t_comm = comm_time(nbytes, collectives, link)
    t_compress = t_compress_s if method == "topk" else 0.0
    t_step = step_time(t_compute_s, t_comm, overlap, t_compress)
    cfg = config or TopKConfig()
    label = method if method != "topk" else f"topk{cfg.ratio:g}-{cfg.exchange}"
    return Prediction(label, tuple(routes), nbytes, collectives, t_compute_s, t_compress, t_comm, t_step)


def with_exchange(config: TopKConfig, exchange: str) -> TopKConfig:
    """``config`` with another exchange (raises ValueError where the config refuses it, e.g. compact encoding with
    the sparse allreduce)."""
    return replace(config, exchange=exchange)
