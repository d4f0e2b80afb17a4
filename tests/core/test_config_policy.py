import math

import pytest

from horovod_topk.core import MAX_COMPRESSED_NUMEL, TopKConfig, plan_tensor, selected_count


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.0001, float("nan"), float("inf"), "0.1", True])
def test_bad_ratio_is_refused_by_name(ratio):
    with pytest.raises(ValueError, match="ratio"):
        TopKConfig(ratio=ratio)


@pytest.mark.parametrize("k", [0, -3, 2.5, True])
def test_bad_k_is_refused(k):
    with pytest.raises(ValueError, match="k must be"):
        TopKConfig(k=k)


def test_bad_min_numel_is_refused():
    with pytest.raises(ValueError, match="min_numel"):
        TopKConfig(min_numel=-1)


@pytest.mark.parametrize(
    "numel,ratio,expected",
    [(1000, 0.01, 10), (1001, 0.01, 11), (300, 0.01, 3), (5, 0.01, 1), (7, 1.0, 7), (10**6, 0.001, 1000)],
)
def test_k_is_ceil_of_ratio_times_n(numel, ratio, expected):
    assert selected_count(numel, TopKConfig(ratio=ratio)) == expected


def test_fixed_k_is_capped_at_numel():
    assert selected_count(100, TopKConfig(k=7)) == 7
    assert selected_count(5, TopKConfig(k=7)) == 5


def test_plan_sends_small_and_integer_tensors_dense():
    cfg = TopKConfig(ratio=0.1, min_numel=100)
    assert not plan_tensor("b", 99, True, cfg).compressed
    assert not plan_tensor("i", 10**6, False, cfg).compressed
    assert not plan_tensor("e", 0, True, TopKConfig(min_numel=0)).compressed
    plan = plan_tensor("w", 100, True, cfg)
    assert plan.compressed and plan.k == 10


def test_plan_refuses_tensors_beyond_int32_indices_by_name():
    with pytest.raises(ValueError, match="'huge'.*int32"):
        plan_tensor("huge", MAX_COMPRESSED_NUMEL + 1, True, TopKConfig())
    with pytest.raises(ValueError, match="'other'.*int32"):  # each name its own message, asked again
        plan_tensor("other", MAX_COMPRESSED_NUMEL + 1, True, TopKConfig())
    assert not plan_tensor("small", MAX_COMPRESSED_NUMEL + 1, True, TopKConfig(min_numel=MAX_COMPRESSED_NUMEL + 2)).compressed


def test_plans_are_remembered_but_each_warmup_step_has_its_own():
    """Every framework asks for every tensor's plan on every step: the same inputs give the same plan object
    (the cost model runs once), while during warm-up each step's k is its own."""
    steady = TopKConfig(ratio=0.01)
    first = plan_tensor("w", 1_000_000, True, steady, world_size=4, step=3)
    assert plan_tensor("v", 1_000_000, True, steady, world_size=4, step=900) is first
    assert first.k == 10_000 and plan_tensor("w", 1_000_000, True, TopKConfig(ratio=0.02), world_size=4).k == 20_000
    warm = TopKConfig(ratio=0.001, warmup_steps=10)
    ks = [plan_tensor("w", 1_000_000, True, warm, step=t).k for t in range(12)]
    assert ks[0] is None and ks[2] > ks[5] > ks[9] > ks[10] == ks[11] == 1000  # dense first, then decaying
    assert ks == [plan_tensor("w", 1_000_000, True, warm, step=t).k for t in range(12)]
    assert plan_tensor("w", 1_000_000, True, warm, step=10) is plan_tensor("w", 1_000_000, True, warm, step=5000)


def test_config_round_trips_and_refuses_unknown_keys():
    cfg = TopKConfig(ratio=0.001, k=None, min_numel=10)
    assert TopKConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="ratioo"):
        TopKConfig.from_dict({"ratioo": 0.1})


def test_default_is_one_percent():
    assert math.isclose(TopKConfig().ratio, 0.01)


def test_new_options_are_validated_by_name():
    with pytest.raises(ValueError, match="selector"):
        TopKConfig(selector="approx")
    with pytest.raises(ValueError, match="value_dtype"):
        TopKConfig(value_dtype="int8")
    with pytest.raises(ValueError, match="warmup_steps"):
        TopKConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="momentum"):
        TopKConfig(momentum=1.0)
    with pytest.raises(ValueError, match="dense_fallback"):
        TopKConfig(dense_fallback="yes")
    for bad in (8, 64, "16", True):
        with pytest.raises(ValueError, match="index_bits"):
            TopKConfig(index_bits=bad)
    assert "index_bits=16" in TopKConfig(index_bits=16, value_dtype="float8").describe()
    with pytest.raises(ValueError, match="compact encoding .* travels by allgather"):
        TopKConfig(index_bits=16, exchange="sparse_allreduce")


def test_compact_encoding_moves_the_crossover():
    """3 bytes per entry (16-bit indices, float8 values): a rank receives (P - 1) payloads of 3k bytes against a
    ring allreduce's 2 (P - 1) / P * 4N: on 4 workers dense is cheaper from k > 2N/3."""
    n, world = 200_000, 4
    compact = dict(index_bits=16, value_dtype="float8")
    assert plan_tensor("w", n, True, TopKConfig(ratio=0.66, **compact), world_size=world, value_itemsize=1).compressed
    assert not plan_tensor("w", n, True, TopKConfig(ratio=0.67, **compact), world_size=world,
                           value_itemsize=1).compressed


@pytest.mark.parametrize("world", [2, 4, 8])
def test_dense_fallback_switches_exactly_at_the_crossover(world):
    """Allgather: (P - 1) * k * 8 > 2 (P - 1) / P * N * 4  <=>  k > N / P (float32 values and gradients)."""
    from horovod_topk.core.exchange import allgather_exchange_nbytes, dense_nbytes

    n = 100_000
    crossover = n // world
    assert allgather_exchange_nbytes(world, crossover, 4) <= dense_nbytes(world, n, 4)
    assert allgather_exchange_nbytes(world, crossover + 1, 4) > dense_nbytes(world, n, 4)
    cfg = dict(exchange="allgather")
    assert plan_tensor("w", n, True, TopKConfig(ratio=(crossover - 1) / n, **cfg), world_size=world).compressed
    assert not plan_tensor("w", n, True, TopKConfig(ratio=(crossover + 1) / n, **cfg), world_size=world).compressed
    assert plan_tensor("w", n, True, TopKConfig(ratio=(crossover + 1) / n, dense_fallback=False, **cfg),
                       world_size=world).compressed


def test_float16_values_move_the_crossover():
    n, world = 120_000, 2  # 6 bytes per entry against 4 per dense entry: dense is cheaper from k > 2N/3
    assert plan_tensor("w", n, True, TopKConfig(ratio=0.66, value_dtype="float16"), world_size=world,
                       value_itemsize=2).compressed
    assert not plan_tensor("w", n, True, TopKConfig(ratio=0.67, value_dtype="float16"), world_size=world,
                           value_itemsize=2).compressed


def test_warmup_is_monotone_and_ends_at_the_target():
    from horovod_topk.core.policy import warmup_ratio

    cfg = TopKConfig(ratio=0.001, warmup_steps=10)
    ratios = [warmup_ratio(cfg, 10_000, t) for t in range(15)]
    assert ratios[0] == 1.0
    assert all(a >= b for a, b in zip(ratios, ratios[1:]))
    assert ratios[10:] == [0.001] * 5
    ks = [plan_tensor("w", 10_000, True, cfg, step=t, world_size=2).k for t in range(15)]
    assert ks[:2] == [None, None] and ks[2] is not None  # ratio > 1/2: dense is cheaper on 2 workers
    assert ks[-1] == 10


def test_a_rank_rescales_its_residual_to_keep_what_it_owes_when_workers_come_or_go():
    from horovod_topk.core.policy import residual_world_factor

    assert residual_world_factor("average", 2, 1) == 0.5   # owed r/2 before, r'/1 after
    assert residual_world_factor("average", 1, 2) == 2.0   # a new worker joins with zero residual
    assert residual_world_factor("sum", 2, 1) == 1.0       # Sum applies the residual itself
    assert residual_world_factor("average", None, 4) == 1.0
    assert residual_world_factor("average", 3, 3) == 1.0


def test_spike_guard_waits_for_a_settled_level_then_caps_and_keeps_the_spike_out_of_the_level():
    from horovod_topk.core.policy import SPIKE_GUARD_WARMUP_STEPS, spike_guard_scale

    level = 0.0
    for step in range(SPIKE_GUARD_WARMUP_STEPS):  # early, large and changing gradients: never capped
        factor, level = spike_guard_scale(10.0 if step % 2 else 1.0, level, 3.0, step)
        assert factor == 1.0
    settled = level
    factor, after = spike_guard_scale(100 * settled, settled, 3.0, SPIKE_GUARD_WARMUP_STEPS)
    assert abs(factor * 100 * settled - 3 * settled) < 1e-9  # capped at 3x the level
    assert after <= 1.2 * settled + 1e-9                    # the level moved by the cap only
    assert spike_guard_scale(settled, settled, 3.0, SPIKE_GUARD_WARMUP_STEPS)[0] == 1.0
    assert spike_guard_scale(float("inf"), settled, 3.0, SPIKE_GUARD_WARMUP_STEPS) == (1.0, settled)


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("nan"), True, "3"])
def test_spike_guard_is_validated(bad):
    with pytest.raises(ValueError, match="spike_guard"):
        TopKConfig(spike_guard=bad)


def test_warmup_schedule_gives_each_step_its_plan_and_one_branch_per_route():
    from horovod_topk.core.policy import plan_tensor, warmup_schedule

    config = TopKConfig(ratio=0.01, warmup_steps=10)
    schedule = warmup_schedule("w", 100_000, True, config, world_size=2, value_itemsize=4, grad_itemsize=4)
    plans = [plan_tensor("w", 100_000, True, config, world_size=2, step=t) for t in range(11)]
    assert len(schedule.phase) == len(schedule.count) == 11
    for t, plan in enumerate(plans):
        assert schedule.routes[schedule.phase[t]] == plan.exchange
        assert schedule.count[t] == (plan.k or 0)
    # dense first (k > N/2 costs more than a ring allreduce on 2 workers), then the allgather: two branches, not
    # one per payload size
    assert schedule.routes == ("dense", "allgather") and schedule.count[-1] == 1000
    assert schedule.count[0] == 0 and len({k for k in schedule.count if k}) >= 4  # one branch, many k
    assert warmup_schedule("b", 100, True, config, world_size=2, value_itemsize=4, grad_itemsize=4) is None


def test_bucket_routes_has_one_combination_per_distinct_set_of_member_routes():
    """A bucket's members over one warm-up: on 32 workers the large tensor keeps the sparse allreduce through
    steps where the small one goes dense, and the small one ends on the allgather (its k is small enough), so the
    bucket has four combinations, in the order the steps first take them, and every step points at the routes each
    member's own schedule gives it there."""
    from horovod_topk.core.policy import bucket_routes, warmup_schedule

    config = TopKConfig(ratio=0.01, warmup_steps=10)
    args = dict(world_size=32, value_itemsize=4, grad_itemsize=4, sparse_available=True)
    schedules = [warmup_schedule("big", 1_000_000, True, config, **args),
                 warmup_schedule("small", 20_000, True, config, **args)]
    combinations, which = bucket_routes(schedules)
    assert len(which) == 11 and len(combinations) == len(set(combinations)) == max(which) + 1
    for t, c in enumerate(which):
        assert combinations[c] == tuple(s.routes[s.phase[t]] for s in schedules)
    assert combinations == (("dense", "dense"), ("sparse_allreduce", "dense"),
                            ("sparse_allreduce", "sparse_allreduce"), ("sparse_allreduce", "allgather"))
    assert list(which) == sorted(which)  # first taken, first listed
    with pytest.raises(ValueError, match="same positions"):
        bucket_routes([schedules[0], warmup_schedule("w", 1_000_000, True, TopKConfig(ratio=0.01, warmup_steps=3),
                                                     **args)])


def test_warmup_schedule_with_the_sparse_allreduce_keeps_large_warm_up_ks_compressed():
    """On 32 workers an allgather of the warm-up's large k costs more than a dense allreduce, a sparse allreduce
    does not: with the sparse allreduce available, steps that would go dense stay compressed, with the k that
    plan_tensor gives them, and the schedule's last step is the same either way."""
    from horovod_topk.core.policy import plan_tensor, warmup_schedule

    config = TopKConfig(ratio=0.01, warmup_steps=10)
    args = dict(world_size=32, value_itemsize=4, grad_itemsize=4)
    plain = warmup_schedule("w", 100_000, True, config, **args)
    sparse = warmup_schedule("w", 100_000, True, config, **args, sparse_available=True)
    dense_without = {t for t in range(11) if plain.count[t] == 0}
    dense_with = {t for t in range(11) if sparse.count[t] == 0}
    assert dense_with < dense_without and len(dense_without - dense_with) >= 4  # here steps 2-7 (k 39811 to 3982)
    for t in range(11):
        plan = plan_tensor("w", 100_000, True, config, step=t, sparse_available=True, **args)
        assert sparse.count[t] == (plan.k or 0)
        assert plan.exchange == ("dense" if t in dense_with else "sparse_allreduce")
        assert sparse.routes[sparse.phase[t]] == plan.exchange
        assert plain.count[t] in (0, sparse.count[t])
    assert sparse.count[-1] == plain.count[-1] == 1000
