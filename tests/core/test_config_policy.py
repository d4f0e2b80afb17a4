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


def test_config_round_trips_and_refuses_unknown_keys():
    cfg = TopKConfig(ratio=0.001, k=None, min_numel=10)
    assert TopKConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="ratioo"):
        TopKConfig.from_dict({"ratioo": 0.1})


def test_default_is_one_percent():
    assert math.isclose(TopKConfig().ratio, 0.01)
