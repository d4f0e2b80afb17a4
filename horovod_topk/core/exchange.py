"""How a compressed tensor's selected entries travel between ranks, and what each way costs.

Two exchanges carry the k (index, value) pairs each rank selected:

``allgather``
    every rank receives every other rank's k pairs: (P - 1) * k entries per rank and step, growing with P.

``sparse_allreduce``
    a sparse reduce-scatter then an allgather over a partition of the index space into P regions (Ok-Topk, Li &
    Hoefler, PPoPP 2022). Phase 1, one alltoall: each rank sends the selected entries that fall in region j to
    rank j, at most ``capacity`` of them per destination (the rest stay in the sender's residual), so every
    alltoall has the same size on every step. Phase 2, one allgather: each region's owner sums what it received
    and keeps the ``kept_per_owner`` = ceil(k / P) largest sums; every rank receives all owners' kept pairs and
    applies the same <= k entries. Per rank about (P - 1) / P * (capacity + kept) * P entries: ~2.1 k whatever P.

Which one a tensor uses (or a dense ring allreduce) is :func:`choose_exchange`, a pure function of numbers every
rank has, so every rank takes the same decision without talking.

The region of index i is a multiplicative hash of i (Knuth's 2654435761, the top bits of the low 32-bit word),
not a contiguous block: Top-K entries cluster in few output channels / vocabulary rows, so contiguous blocks load
one owner with most of the k entries (its capacity overflows, the others idle). Measured on real gradients
(``python benchmarks/region_balance.py``: the digits CNN trained on its data and a character GRU language model,
ratio 0.01 with error feedback, 20 steps): the largest region's count in units of k / P, mean over steps, and in
brackets the share of the k entries over the phase-1 capacity:

    ======================  ===========  ==================  ==================  ==================
    tensor                  split        P = 4               P = 8               P = 32
    ======================  ===========  ==================  ==================  ==================
    CNN conv weight         contiguous   1.32  (6.1%)        1.70  (10.9%)       3.92  (33.1%)
                            interleave   1.14  (1.0%)        1.29  (3.0%)        2.89  (31.1%)
                            hash         1.17  (1.8%)        1.27  (2.8%)        1.87  (12.7%)
    LM embedding            contiguous   2.66  (44.0%)       3.03  (57.9%)       4.12  (63.7%)
                            interleave   1.23  (3.2%)        1.59  (8.8%)        3.51  (34.1%)
                            hash         1.16  (1.1%)        1.32  (3.1%)        1.96  (17.6%)
    LM GRU weight_hh        contiguous   3.30  (54.9%)       3.78  (58.0%)       5.39  (62.8%)
                            interleave   1.22  (3.4%)        1.40  (7.1%)        2.43  (19.2%)
                            hash         1.08  (0.2%)        1.17  (1.0%)        1.49  (4.6%)
    CNN fc1 weight          contiguous   1.32  (6.2%)        1.84  (13.0%)       3.92  (33.6%)
                            hash         1.06  (0.0%)        1.11  (0.3%)        1.33  (1.9%)
    ======================  ===========  ==================  ==================  ==================

The hash is the most even on 5 of the 7 weight tensors measured at P = 8 and within 0.03 of the best on the other
two (at P = 32: the most even or tied on all); what remains at P = 32 is mostly the binomial noise of small
k / P (these tensors have k of a few tens to a few hundreds), which shrinks as 1 / sqrt(k / P). Overflowed entries
are not lost: they stay in the sender's residual and go out on a later step.

Standard library only, like the rest of core.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Optional, Tuple

from .payload import PayloadLayout

__all__ = [
    "EXCHANGES",
    "AUTO",
    "ALLGATHER",
    "SPARSE_ALLREDUCE",
    "DENSE",
    "DENSE_HALF",
    "DENSE_INT8",
    "FLOAT16_MAX",
    "half_limit",
    "int8_lane_limit",
    "int8_word_bias",
    "int8_offered",
    "INT8_MIN_LIMIT",
    "float16_at_most",
    "HASH_MULTIPLIER",
    "CAPACITY_SLACK",
    "region_of",
    "largest_region",
    "capacity",
    "kept_per_owner",
    "SparseAllreduceLayouts",
    "dense_nbytes",
    "allgather_exchange_nbytes",
    "sparse_allreduce_nbytes",
    "exchange_nbytes",
    "choose_exchange",
    "COLLECTIVES",
    "COLLECTIVE_LATENCY_BYTES",
]

AUTO = "auto"
ALLGATHER = "allgather"
SPARSE_ALLREDUCE = "sparse_allreduce"
DENSE = "dense"
#: Dense, the values in float16 (ratio="auto"'s "fp16" choice: Horovod's fp16 compression with error feedback; the
#: rounding and anything beyond float16's range stay in the residual). A dense route, not an exchange.
DENSE_HALF = "dense_fp16"
#: Dense, each value an integer of one byte on a grid every rank shares (ratio="auto"'s "int8" choice): a quarter
#: of dense's bytes, summed by an allreduce of int32 words that each carry four values (int8_lane_limit); the
#: rounding and what the grid's range cuts stay in the residual. A dense route, not an exchange.
DENSE_INT8 = "dense_int8"
#: The largest finite float16.
FLOAT16_MAX = 65504.0
#: The values TopKConfig.exchange accepts.
EXCHANGES = (AUTO, ALLGATHER, SPARSE_ALLREDUCE)

#: Knuth's multiplicative hash constant (~2**32 / golden ratio): consecutive indices land in regions far apart.
HASH_MULTIPLIER = 2654435761
#: Per-destination capacity over the mean k / P. A rank's k entries spread over P regions like a binomial
#: (k, 1/P) draw under the hash; 10% slack keeps the alltoall at 1.1 k entries per rank (the bar is 2.2 k for both
#: phases together) while overflow, which only delays entries to a later step through the residual, stays rare
#: for k / P in the hundreds and above.
CAPACITY_SLACK = 1.1
#: Collectives Horovod launches for one tensor's step under each exchange (the phase-2 allgather of the sparse
#: allreduce is a second one, started only when phase 1 has finished).
COLLECTIVES = {DENSE: 1, DENSE_HALF: 1, DENSE_INT8: 1, ALLGATHER: 1, SPARSE_ALLREDUCE: 2}
#: What one more collective costs, counted in bytes (its fixed time x the link's rate), when "auto" weighs an
#: exchange that launches more collectives: 128 KiB is ~1 ms at 1 Gbit/s or ~0.1 ms at 10 Gbit/s. A collective's
#: fixed cost is its latency plus, for a chained second phase, the wait for another turn of Horovod's background
#: loop (HOROVOD_CYCLE_TIME, a millisecond or more). Counting it only by bytes made "auto" take the sparse allreduce
#: for the small tensors of the P = 4 test bed, where it measured slowest (digits: 171.6 ms per step against 60.9 ms
#: for the allgather at 100 Mbit/s; README "Time to target at P = 4"). Users who know their link pass
#: TopKConfig(collective_latency_bytes=latency x bandwidth / 8); ``python -m horovod_topk.advise --latency ...``
#: prints the value for theirs.
COLLECTIVE_LATENCY_BYTES = 131072
#: Entries per rank the two phases together may move, in units of k: P * (capacity + kept) <= 2.2 k whenever
#: k >= P (one entry per owner at least; below that the allgather or dense is cheaper anyway).
BYTES_BUDGET = 2.2


def region_of(index: int, world_size: int) -> int:
    """The rank that owns ``index`` (0 <= index < 2**31): ((index * HASH_MULTIPLIER) mod 2**32) * P >> 32.

    The frameworks compute the same formula on tensors in int64 (index < 2**31 and P <= 2**31 keep every product
    below 2**63)."""
    return (((index * HASH_MULTIPLIER) & 0xFFFFFFFF) * world_size) >> 32


@functools.lru_cache(maxsize=256)
def largest_region(numel: int, world_size: int) -> int:
    """The number of indices of [0, numel) in the largest region. O(numel) once per (numel, P): only needed when
    every entry is selected (k == numel), see capacity()."""
    counts = [0] * world_size
    for index in range(numel):
        counts[region_of(index, world_size)] += 1
    return max(counts)


def _check(what: str, k: int, world_size: int) -> None:
    if k < 1 or world_size < 1:
        raise ValueError(f"{what} needs k >= 1 and world_size >= 1, got k={k}, world_size={world_size}")


def capacity(k: int, world_size: int, numel: Optional[int] = None) -> int:
    """Entries a rank sends to each owner in phase 1: ceil(CAPACITY_SLACK * k / P), but never so many that
    P * (capacity + kept_per_owner) exceeds 2.2 k (the byte budget of the exchange: it binds when k / P is small and
    the ceilings dominate); at least 1, at most k.

    When every entry is selected (k == ``numel``) it is the largest region's size instead, so that nothing
    overflows and ratio 1.0 is exactly a dense allreduce (what the parity tests check)."""
    _check("capacity", k, world_size)
    if numel is not None and k >= numel:
        return largest_region(numel, world_size)
    budget = math.floor(BYTES_BUDGET * k / world_size + 1e-9) - kept_per_owner(k, world_size)
    return max(1, min(k, budget, math.ceil(CAPACITY_SLACK * k / world_size - 1e-9)))


def kept_per_owner(k: int, world_size: int, numel: Optional[int] = None) -> int:
    """Sums each owner keeps and re-sends in phase 2: ceil(k / P), so every rank applies at most ~k entries
    (the largest region's size when k == ``numel``, as for capacity())."""
    _check("kept_per_owner", k, world_size)
    if numel is not None and k >= numel:
        return largest_region(numel, world_size)
    return math.ceil(k / world_size)


@dataclass(frozen=True)
class SparseAllreduceLayouts:
    """The fixed-size buffers of one tensor's sparse allreduce.

    ``send``: one PayloadLayout of ``capacity`` entries per destination; the alltoall buffer is P of them back to
    back (splits all equal to ``send.nbytes``), unused slots hold index -1 and value 0.
    ``kept``: the PayloadLayout of one owner's ``kept_per_owner`` sums in the phase-2 allgather (unused: -1, 0).
    """

    k: int
    world_size: int
    value_itemsize: int
    numel: Optional[int] = None

    @property
    def send(self) -> PayloadLayout:
        return PayloadLayout(capacity(self.k, self.world_size, self.numel), self.value_itemsize)

    @property
    def kept(self) -> PayloadLayout:
        return PayloadLayout(kept_per_owner(self.k, self.world_size, self.numel), self.value_itemsize)

    @property
    def alltoall_nbytes(self) -> int:
        """Bytes of the whole phase-1 buffer (P blocks, one per destination)."""
        return self.world_size * self.send.nbytes

    @property
    def sent_nbytes(self) -> int:
        """Bytes one rank hands to the two collectives per step (the whole alltoall buffer, its own block included,
        and its kept payload): what each framework adds to the tensor's ``bytes_sent``, so stats() agree."""
        return self.alltoall_nbytes + self.kept.nbytes


# ---- cost model --------------------------------------------------------------------------------------------------
# Bytes one rank sends over its links per tensor and step (with the ring/pairwise algorithms Horovod's backends use,
# it receives as many). A rank's own block never crosses a link. Collective headers and Horovod's negotiation are
# left out: they do not grow with N or k.


def dense_nbytes(world_size: int, numel: int, grad_itemsize: int) -> float:
    """Ring allreduce: 2 (P - 1) / P * N * itemsize."""
    return 2.0 * (world_size - 1) / world_size * numel * grad_itemsize


def allgather_exchange_nbytes(world_size: int, k: int, value_itemsize: int) -> int:
    """Allgather of k-entry payloads: (P - 1) * payload bytes."""
    return (world_size - 1) * PayloadLayout(k, value_itemsize).nbytes


def sparse_allreduce_nbytes(world_size: int, k: int, value_itemsize: int, numel: Optional[int] = None) -> int:
    """Alltoall of P capacity-sized blocks (P - 1 leave the rank) + allgather of ceil(k/P)-entry payloads."""
    layouts = SparseAllreduceLayouts(k, world_size, value_itemsize, numel)
    return (world_size - 1) * (layouts.send.nbytes + layouts.kept.nbytes)


def exchange_nbytes(
    exchange: str, world_size: int, numel: int, k: int, value_itemsize: int, grad_itemsize: int
) -> float:
    """Bytes per rank of one tensor's step under ``exchange`` ("dense", "allgather" or "sparse_allreduce")."""
    if exchange == DENSE:
        return dense_nbytes(world_size, numel, grad_itemsize)
    if exchange == ALLGATHER:
        return allgather_exchange_nbytes(world_size, k, value_itemsize)
    if exchange == SPARSE_ALLREDUCE:
        # The slack formula even at k == N, where the layouts use the largest region instead (within a few % of
        # it): that region's O(N) count is only worth making for a tensor that takes the sparse allreduce.
        return sparse_allreduce_nbytes(world_size, k, value_itemsize)
    raise ValueError(f"unknown exchange {exchange!r}; expected one of {DENSE!r}, {ALLGATHER!r}, {SPARSE_ALLREDUCE!r}")


def choose_exchange(
    requested: str,
    world_size: int,
    numel: int,
    k: int,
    value_itemsize: int,
    grad_itemsize: int,
    *,
    dense_fallback: bool = True,
    sparse_available: bool = True,
    payload_nbytes: Optional[int] = None,
    collective_latency_bytes: float = COLLECTIVE_LATENCY_BYTES,
) -> Tuple[str, float]:
    """(exchange, its bytes per rank) for one compressed tensor: the cheapest of the allowed ones, where an
    exchange costs its bytes per rank plus ``collective_latency_bytes`` for each collective it launches
    (COLLECTIVES): the step-time model of core.costmodel in units of bytes, so the sparse allreduce is taken only
    where the bytes it saves outweigh its second collective.

    ``requested`` "auto" allows allgather and (when the framework has it, ``sparse_available``) the sparse
    allreduce; a named exchange allows only itself, and is then weighed against dense by bytes alone (the user
    chose it; latency does not overrule that). With ``dense_fallback`` a dense ring allreduce wins whenever it
    costs less. Ties go to the earlier of dense, allgather, sparse_allreduce: fewer collectives, less latency.
    On one rank nothing travels: the allgather (a local copy) is taken. ``payload_nbytes``: the allgather payload's
    size when it is not the plain layout's (the compact encoding, core.payload).
    """
    if requested not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {requested!r}")
    if requested == SPARSE_ALLREDUCE and not sparse_available:
        raise ValueError("exchange='sparse_allreduce' is not available in this framework")
    if world_size <= 1 and requested == AUTO:
        return ALLGATHER, 0.0
    allowed = [ALLGATHER, SPARSE_ALLREDUCE] if requested == AUTO else [requested]
    if requested == AUTO and not sparse_available:
        allowed = [ALLGATHER]
    if not (math.isfinite(collective_latency_bytes) and collective_latency_bytes >= 0):
        raise ValueError(f"collective_latency_bytes must be a non-negative number, got {collective_latency_bytes!r}")
    candidates = ([DENSE] if dense_fallback and world_size > 1 else []) + allowed
    # A named exchange is the user's choice: dense_fallback then compares bytes only, as documented
    latency = collective_latency_bytes if requested == AUTO else 0.0
    costs = []
    for i, e in enumerate(candidates):
        nbytes = ((world_size - 1) * payload_nbytes if e == ALLGATHER and payload_nbytes is not None else
                  exchange_nbytes(e, world_size, numel, k, value_itemsize, grad_itemsize))
        costs.append((nbytes + COLLECTIVES[e] * latency, i, e, nbytes))
    _, _, best, nbytes = min(costs)
    return best, nbytes


@functools.lru_cache(maxsize=64)  # called for every tensor of every fp16 step; pure in its one integer
def half_limit(world_size: int) -> float:
    """The largest value one rank may send on the fp16 route (DENSE_HALF), so that P ranks' float16 sum cannot
    overflow into an Inf that no rank had; what the clamp cuts stays in the residual.

    Not 65504 / P: that is no float16 unless P is a power of 2, and the cast could round it up (P = 3: 21834.67 ->
    21840, and 3 x 21840 rounds to Inf). The limit is a float16 (the cast of a clamped value is exact) at most
    65504 / (P (1 + 2^-11)^(P-1)): a reduction adds P values in P - 1 steps, each rounding its partial sum up by at
    most 2^-11 of it, so even then the sum stays within 65504."""
    world_size = max(int(world_size), 1)
    return float16_at_most(FLOAT16_MAX / (world_size * (1.0 + 2.0 ** -11) ** (world_size - 1)))


def int8_lane_limit(world_size: int) -> int:
    """The largest integer one rank may send on the int8 route (DENSE_INT8): L = 127 // P, so that the sum of P
    ranks' integers, at most 127 in magnitude, is a signed byte. Four values travel in one int32 word as
    q0 + 2^8 q1 + 2^16 q2 + 2^24 q3 (each |q| <= L); the word sum over the ranks is at most 127 x 16843009 <
    2^31 in magnitude, so the int32 allreduce never overflows and each byte's sum is read back exactly
    (int8_word_bias). 0 where P ranks cannot share a byte (P > 127): the route is not offered there. Horovod sums
    neither int8 nor int16 tensors (its PyTorch front end refuses them); int32 every backend sums."""
    return 127 // max(int(world_size), 1)


#: The fewest grid steps per sign a rank must have for ratio="auto" to offer int8: 31, i.e. up to 4 workers, where
#: the simulator's screen and the test bed's runs found dense's loss (docs/auto-density.md). More workers make the
#: grid coarser (8: L = 15; 16: L = 7; 64: L = 1, a sign): at 8 the simulator's GRU ended 2.4% above dense's loss
#: (the transformer 0.1%), so auto does not offer int8 there.
INT8_MIN_LIMIT = 31


def int8_offered(world_size: int) -> bool:
    """Whether ratio="auto" may send int8 among ``world_size`` workers (INT8_MIN_LIMIT)."""
    return int8_lane_limit(world_size) >= INT8_MIN_LIMIT


def int8_word_bias(limit: int) -> int:
    """What a word of four bytes each holding q + L (0 ... 2L) exceeds the word of the four q's by:
    L (1 + 2^8 + 2^16 + 2^24). A rank packs its biased bytes, views them as int32 and subtracts this; after the sum
    the receiver adds P times it back in int64, where the four bytes hold each value's sum plus P L."""
    return int(limit) * 0x01010101


def float16_at_most(value: float) -> float:
    """The largest float16 that is at most ``value`` (0 <= value <= 65504)."""
    if not 0.0 <= value <= FLOAT16_MAX:
        raise ValueError(f"horovod-topk: {value} is outside [0, {FLOAT16_MAX}]")
    bits = struct.unpack("<H", struct.pack("<e", value))[0]  # the nearest float16
    nearest = struct.unpack("<e", struct.pack("<H", bits))[0]
    return nearest if nearest <= value else struct.unpack("<e", struct.pack("<H", bits - 1))[0]
