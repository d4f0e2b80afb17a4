import math
import struct

import pytest

from horovod_topk.core import TopKConfig, fingerprint, mismatch_message, plan_tensor
from horovod_topk.core.exchange import (
    FLOAT16_MAX,
    SparseAllreduceLayouts,
    allgather_exchange_nbytes,
    capacity,
    choose_exchange,
    dense_nbytes,
    float16_at_most,
    half_limit,
    kept_per_owner,
    region_of,
    sparse_allreduce_nbytes,
)
from horovod_topk.core.naming import allgather_name, alltoall_name, owners_allgather_name


def test_exchange_option_is_validated_and_described():
    with pytest.raises(ValueError, match="exchange must be one of auto, allgather, sparse_allreduce"):
        TopKConfig(exchange="ring")
    assert TopKConfig().exchange == "auto"
    assert "exchange='sparse_allreduce'" in TopKConfig(exchange="sparse_allreduce").describe()
    assert "exchange" not in TopKConfig().describe()


def test_region_of_covers_every_rank_and_spreads_consecutive_indices():
    for world in (1, 2, 3, 4, 8, 1024):
        regions = [region_of(i, world) for i in range(20_000)]
        assert min(regions) == 0 and max(regions) == world - 1 or world > 20_000
        counts = [regions.count(r) for r in range(world)]
        mean = 20_000 / world
        # a contiguous run of indices (one conv filter, one embedding row) is spread nearly evenly
        assert max(counts) <= mean + 5 * math.sqrt(mean) + 2
    assert region_of(2**31 - 1, 1024) < 1024


def test_capacity_and_kept_count():
    assert capacity(1000, 8) == 138  # ceil(1.1 * 125)
    assert kept_per_owner(1000, 8) == 125
    assert capacity(1, 8) == 1 and kept_per_owner(1, 8) == 1
    assert capacity(5, 1) == 5  # never more than k
    with pytest.raises(ValueError, match="k >= 1"):
        capacity(0, 4)


@pytest.mark.parametrize("world", [2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 1024])
@pytest.mark.parametrize("k", [10_486, 21_000, 100_000, 1_000_000, "P", "1.5P", "2P+1"])
def test_sparse_allreduce_meets_the_bar_at_every_world_size(world, k):
    """<= 2.2 * k * 8 bytes per rank per tensor and step, whatever P >= 2 (float32 values), for k >= P."""
    k = {"P": world, "1.5P": world * 3 // 2, "2P+1": 2 * world + 1}.get(k, k)
    assert sparse_allreduce_nbytes(world, k, 4) <= 2.2 * k * 8
    layouts = SparseAllreduceLayouts(k, world, 4)
    assert layouts.alltoall_nbytes == world * layouts.send.nbytes


def test_cost_model_formulas():
    assert dense_nbytes(4, 1000, 4) == 2 * 3 / 4 * 1000 * 4
    assert allgather_exchange_nbytes(8, 100, 4) == 7 * 800
    assert sparse_allreduce_nbytes(8, 1000, 4) == 7 * (138 * 8 + 125 * 8)
    # what a rank hands to the collectives (its own alltoall block included): 8 blocks of 138, one payload of 125
    assert SparseAllreduceLayouts(1000, 8, 4).sent_nbytes == 8 * 138 * 8 + 125 * 8
    assert allgather_exchange_nbytes(4, 3, 2) == 3 * 24  # 12 index bytes + 6 value bytes, padded to 24


def test_three_way_choice():
    n = 1_000_000
    assert choose_exchange("auto", 2, n, 10_000, 4, 4)[0] == "allgather"   # k vs 1.05 k
    assert choose_exchange("auto", 4, n, 10_000, 4, 4, collective_latency_bytes=0)[0] == "sparse_allreduce"
    assert choose_exchange("auto", 4, n, 10_000, 4, 4, sparse_available=False)[0] == "allgather"
    assert choose_exchange("auto", 128, n, 10_000, 4, 4, sparse_available=False)[0] == "dense"
    assert choose_exchange("auto", 128, n, 10_000, 4, 4)[0] == "sparse_allreduce"
    assert choose_exchange("auto", 8, n, 600_000, 4, 4)[0] == "dense"  # 2.1 k * 8 > 1.75 N * 4
    assert choose_exchange("auto", 8, n, 600_000, 4, 4, dense_fallback=False)[0] == "sparse_allreduce"
    assert choose_exchange("allgather", 64, n, 10_000, 4, 4, dense_fallback=False)[0] == "allgather"
    assert choose_exchange("sparse_allreduce", 2, n, 10_000, 4, 4)[0] == "sparse_allreduce"
    assert choose_exchange("auto", 1, n, 10_000, 4, 4)[0] == "allgather"
    with pytest.raises(ValueError, match="not available"):
        choose_exchange("sparse_allreduce", 4, n, 10, 4, 4, sparse_available=False)


def test_auto_counts_each_collective_as_latency_bytes():
    """The sparse allreduce launches two collectives (alltoall, then allgather), the allgather one: "auto" takes
    it only where its saving in bytes exceeds one collective's worth (collective_latency_bytes)."""
    n = 1_000_000
    k = 10_000
    saving = allgather_exchange_nbytes(4, k, 4) - sparse_allreduce_nbytes(4, k, 4)
    assert saving == 240_000 - 3 * (2750 + 2500) * 8 == 114_000
    assert choose_exchange("auto", 4, n, k, 4, 4, collective_latency_bytes=saving - 1)[0] == "sparse_allreduce"
    assert choose_exchange("auto", 4, n, k, 4, 4, collective_latency_bytes=saving)[0] == "allgather"  # tie: fewer
    # the default (128 KiB) keeps a 1M-parameter tensor on the allgather at P = 4, gives it the sparse allreduce at 8
    assert choose_exchange("auto", 4, n, k, 4, 4) == ("allgather", 240_000)
    best, nbytes = choose_exchange("auto", 8, n, k, 4, 4)
    assert best == "sparse_allreduce" and nbytes == sparse_allreduce_nbytes(8, k, 4)  # bytes, not the cost
    # dense against a two-collective sparse allreduce: latency counts under auto ...
    small = 2048
    assert choose_exchange("auto", 64, small, 64, 4, 4, sparse_available=True)[0] == "dense"
    # ... not when the user named the exchange: dense_fallback then compares bytes only, as documented
    assert choose_exchange("sparse_allreduce", 64, 10 * small, 64, 4, 4)[0] == "sparse_allreduce"
    with pytest.raises(ValueError, match="collective_latency_bytes"):
        choose_exchange("auto", 4, n, k, 4, 4, collective_latency_bytes=-1)
    with pytest.raises(ValueError, match="collective_latency_bytes"):
        TopKConfig(collective_latency_bytes=-5)
    with pytest.raises(ValueError, match="collective_latency_bytes"):
        TopKConfig(collective_latency_bytes=1.5)
    # the config's value reaches the per-tensor plan
    assert plan_tensor("w", n, True, TopKConfig(), world_size=4, sparse_available=True).exchange == "allgather"
    assert plan_tensor("w", n, True, TopKConfig(collective_latency_bytes=0), world_size=4,
                       sparse_available=True).exchange == "sparse_allreduce"


def test_plan_carries_the_exchange():
    cfg = TopKConfig(ratio=0.01)
    assert plan_tensor("w", 10**6, True, cfg, world_size=8, sparse_available=True).exchange == "sparse_allreduce"
    assert plan_tensor("w", 10**6, True, cfg, world_size=8).exchange == "allgather"
    plan = plan_tensor("w", 10**6, True, TopKConfig(ratio=0.5), world_size=8, sparse_available=True)
    assert plan.exchange == "dense" and not plan.compressed
    assert plan_tensor("b", 10, True, cfg, world_size=8).exchange == "dense"


def test_collective_names_are_distinct_per_phase_and_tensor():
    names = {allgather_name("w"), alltoall_name("w"), owners_allgather_name("w"), allgather_name("sar1.w")}
    assert len(names) == 4
    assert alltoall_name("w") != allgather_name("sar1.w")


def test_fingerprint_covers_the_exchange_and_the_route():
    a = fingerprint(TopKConfig(), (10, 10), "float32", 0, 1, route="allgather")
    b = fingerprint(TopKConfig(exchange="sparse_allreduce"), (10, 10), "float32", 0, 1, route="sparse_allreduce")
    message = mismatch_message("w", [a, b])
    assert "exchange ('auto'" in message.replace("rank 0: ", "") or "exchange (rank 0: 'auto'" in message
    assert "route (rank 0: allgather, rank 1: sparse_allreduce)" in message
    assert mismatch_message("w", [a, list(a)]) is None


def test_every_entry_selected_fits_without_overflow():
    from horovod_topk.core.exchange import largest_region

    for numel, world in ((4, 2), (100, 3), (2048, 2), (2048, 4)):
        counts = [0] * world
        for i in range(numel):
            counts[region_of(i, world)] += 1
        assert largest_region(numel, world) == max(counts)
        assert capacity(numel, world, numel) == max(counts) == kept_per_owner(numel, world, numel)
    assert capacity(10, 2, 1000) == 6  # k < N: the slack formula



def _float16_at_least(value: float) -> float:
    """The smallest float16 that is at least ``value`` (inf beyond 65504): the rounding that goes up."""
    if value > FLOAT16_MAX:
        return math.inf
    below = float16_at_most(value)
    if below == value:
        return below
    return struct.unpack("<e", struct.pack("<H", struct.unpack("<H", struct.pack("<e", below))[0] + 1))[0]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 6, 7, 8, 24, 64, 100, 1024])
def test_the_fp16_limit_is_a_float16_whose_sum_over_every_rank_stays_finite(world_size):
    """P ranks each sending the limit, summed in float16 one rank at a time with every partial sum rounded up (the
    worst a reduction's roundings can do): the sum stays a finite float16."""
    limit = half_limit(world_size)
    assert float16_at_most(limit) == limit and 0 < limit <= FLOAT16_MAX / world_size
    total = 0.0
    for _ in range(world_size):
        total = _float16_at_least(total + limit)
    assert total <= FLOAT16_MAX, (world_size, total)


def test_65504_over_p_would_overflow_where_p_is_no_power_of_two():
    """Why the limit is not 65504 / P: at P = 3 that value casts to 21840, and three of them make 65520, an Inf."""
    nearest = struct.unpack("<e", struct.pack("<e", FLOAT16_MAX / 3))[0]
    assert nearest == 21840.0 and 3 * nearest > FLOAT16_MAX
    assert 3 * half_limit(3) <= FLOAT16_MAX


def test_float16_at_most_rounds_down_and_names_a_value_out_of_range():
    assert float16_at_most(21834.67) == 21824.0 and float16_at_most(2.0) == 2.0
    assert float16_at_most(0.0) == 0.0 and float16_at_most(FLOAT16_MAX) == FLOAT16_MAX
    with pytest.raises(ValueError, match="outside"):
        float16_at_most(70000.0)
