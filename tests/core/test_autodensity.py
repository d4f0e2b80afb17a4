"""ratio="auto": validation, the pure decision rule, and the state object (core.autodensity)."""
import pytest

from horovod_topk.core import TopKConfig
from horovod_topk.core.autodensity import (
    DENSITIES,
    FASTER,
    SETTLE_STEPS,
    WINDOW_STEPS,
    AutoDensity,
    Measurement,
    choose_density,
    predict_steps,
)
from horovod_topk.core.consistency import fingerprint, mismatch_message

TENSORS = [(f"w{i}", 1_000_000) for i in range(25)] + [(f"b{i}", 1000) for i in range(25)]
AUTO = TopKConfig(ratio="auto")
PROBE_BYTES = 6e6


def link(rate_bps, *, compute=0.2, latency=2e-4, lone=1e-3, select=1e-9, period=None, world_size=4):
    """A measurement whose probes describe a link of ``rate_bps``."""
    large = latency + PROBE_BYTES * 8 / rate_bps
    return Measurement(period_s=compute if period is None else period, compute_s=compute, compress_s=0.0,
                       latency_s=latency, large_s=large, large_nbytes=PROBE_BYTES, select_s_per_entry=select,
                       world_size=world_size, lone_s=lone)


@pytest.mark.parametrize("options, match", [
    (dict(ratio="auto", k=10), "k"),
    (dict(ratio="auto", warmup_steps=5), "warmup_steps"),
    (dict(ratio="auto", budget=0.0), "budget"),
    (dict(ratio="auto", budget=1.0), "budget"),
    (dict(ratio="auto", auto_every=0), "auto_every"),
    (dict(ratio=0.01, budget=0.2), "budget"),
    (dict(ratio=0.01, auto_every=5), "auto_every"),
    (dict(ratio="fast"), "ratio"),
])
def test_bad_auto_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        TopKConfig(**options)


def test_auto_fills_its_defaults_and_round_trips():
    assert (AUTO.budget, AUTO.auto_every, AUTO.auto) == (0.1, 200, True)
    assert TopKConfig.from_dict(AUTO.to_dict()) == AUTO
    assert "ratio='auto'" in AUTO.describe()


def test_measurement_takes_the_slowest_rank_of_each_column():
    rows = [[1.0, 0.5, 0.1, 0.002, 0.05, 1e-9, 0.004], [0.9, 0.6, 0.2, 0.001, 0.07, 2e-9, 0.003]]
    m = Measurement.from_rows(rows, PROBE_BYTES, 2)
    assert (m.period_s, m.compute_s, m.compress_s, m.latency_s, m.large_s, m.select_s_per_entry, m.lone_s) == (
        1.0, 0.6, 0.2, 0.002, 0.07, 2e-9, 0.004)
    assert m.link().bandwidth_bps == pytest.approx(PROBE_BYTES * 8 / (0.07 - 0.002))
    with pytest.raises(ValueError, match="columns"):
        Measurement.from_rows([[1.0, 2.0]], PROBE_BYTES, 2)


def test_a_fast_link_stays_dense_and_slower_links_compress_more():
    fast = choose_density(TENSORS, AUTO, link(1e12), current=None, first=True)
    assert fast.ratio is None and "budget" in fast.reason
    chosen = [choose_density(TENSORS, AUTO, link(rate), current=None, first=True).ratio
              for rate in (10e9, 1e9, 100e6, 10e6)]
    assert all(r in DENSITIES for r in chosen[1:])
    order = [DENSITIES.index(r) if r is not None else -1 for r in chosen]
    assert order == sorted(order), chosen  # never denser on a slower link
    assert chosen[-1] < 0.01


def test_one_worker_is_dense_and_nothing_is_chosen_slower_than_dense():
    assert choose_density(TENSORS, AUTO, link(1e6, world_size=1), current=None, first=True).ratio is None
    # selection so slow that every density costs more than dense's communication
    slow_select = choose_density(TENSORS, AUTO, link(10e9, select=1e-6), current=None, first=True)
    assert slow_select.ratio is None and slow_select.predicted_s["dense"] <= min(
        slow_select.predicted_s[f"{d:g}"] for d in DENSITIES)


def test_a_chained_sparse_allreduce_pays_a_lone_collective_per_phase():
    cfg = TopKConfig(ratio="auto", exchange="sparse_allreduce")
    cheap = predict_steps(TENSORS, cfg, link(1e9, lone=0.0), compute_s=0.2, hidden_s=0.0, offset_s=0.0)[0]
    dear = predict_steps(TENSORS, cfg, link(1e9, lone=0.01), compute_s=0.2, hidden_s=0.0, offset_s=0.0)[0]
    assert dear["0.01"] - cheap["0.01"] == pytest.approx(25 * 2 * (0.01 - 2e-4))


def test_hysteresis_keeps_the_density_unless_the_change_is_large():
    m = link(1e9)
    best = choose_density(TENSORS, AUTO, m, current=None, first=True)
    assert best.ratio is not None
    steps = best.predicted_s
    sparser = DENSITIES[DENSITIES.index(best.ratio) + 1]
    assert steps[f"{sparser:g}"] <= steps[f"{best.ratio:g}"] * (1 + FASTER)  # the denser one is not much faster
    kept = choose_density(TENSORS, AUTO, m, current=sparser, first=False)
    assert kept.ratio == sparser and "kept" in kept.reason
    # the same link 100x slower: the current density misses the budget by far, so it changes
    moved = choose_density(TENSORS, AUTO, link(1e7), current=best.ratio, first=False)
    assert moved.ratio != best.ratio and DENSITIES.index(moved.ratio) > DENSITIES.index(best.ratio)
    # a dense choice predicted much faster than a sparse current one is taken at once
    back = choose_density(TENSORS, AUTO, link(1e12), current=0.01, first=False, offset_s=1.0)
    assert back.ratio is None


def test_the_state_object_measures_after_settling_and_decides_on_schedule():
    auto = AutoDensity(AUTO)
    first = SETTLE_STEPS + WINDOW_STEPS
    due = [auto.begin(step, now=step * 1.0) for step in range(first + 1)]
    assert due == [False] * first + [True]
    assert len(auto._samples) == first - SETTLE_STEPS  # steps 0..SETTLE_STEPS-1 not measured
    for _ in range(3):
        auto.waited(0.25)
    auto.compressed(0.05)
    period, compute, compress = auto.local_row(0.0, 0.0, 0.0)[:3]
    assert (period, compute, compress) == (1.0, 1.0, 0.0)  # the window's medians (no waits recorded in it)

    # a dense window of a slow link: dense's predicted step is the measured one, and a density is chosen
    m = link(1e8, compute=0.1, period=2.0)
    choice = auto.decide(TENSORS, m)
    assert choice.predicted_s["dense"] == pytest.approx(2.0)
    assert auto.compute_s == 0.1 and auto.ratio == choice.ratio is not None
    assert auto.next_decision == auto.step + SETTLE_STEPS + WINDOW_STEPS
    assert auto.effective_config().ratio == auto.ratio and auto.effective_config().budget is None
    assert "Mbit/s" in auto.summary_line() and f"ratio {auto.ratio:g}" in auto.summary_line()

    # a sparse window measured far slower than predicted: the offset says so and dense comes back
    auto.step = auto.next_decision
    slow = link(1e8, compute=0.1, period=5.0)
    back = auto.decide(TENSORS, slow)
    assert auto.offset_s > 4.0 and back.ratio is None

    saved = auto.state_dict()
    other = AutoDensity(AUTO)
    other.load_state_dict(saved)
    assert other.state_dict() == saved and other.effective_config() is None
    with pytest.raises(ValueError, match="density"):
        other.load_state_dict({**saved, "ratio": 0.5})


def test_no_change_waits_auto_every_steps():
    auto = AutoDensity(TopKConfig(ratio="auto", auto_every=50))
    auto.step = 12
    auto.decide(TENSORS, link(1e12))  # the first decision: dense, checked again one window later
    assert auto.ratio is None and auto.next_decision == 12 + SETTLE_STEPS + WINDOW_STEPS
    auto.step = auto.next_decision
    auto.decide(TENSORS, link(1e12))
    assert auto.ratio is None and auto.next_decision == auto.step + 50


def test_a_wait_read_only_when_it_counts_gives_the_same_decisions():
    """TensorFlow reads a step's wait only when AutoDensity.wait_counts(): the rows decided from must equal those
    of a front end that records every step's wait, and most steps between decisions must not be read."""
    config = TopKConfig(ratio="auto", auto_every=50)
    every, counted = AutoDensity(config), AutoDensity(config)
    read, rows = 0, []
    for step in range(130):
        for auto, only_counted in ((every, False), (counted, True)):
            if step and (not only_counted or auto.wait_counts()):
                auto.waited(0.001 * (step % 7))  # the wait of the step just finished, before the next begins
                read += only_counted
            if auto.begin(step, now=step * 0.1 + 0.0001 * (step % 5)):
                rows.append((only_counted, auto.local_row(0.0, 0.0, 0.0)))
                auto.decide(TENSORS, link(1e12))  # a fast link: dense, checked again, then every 50 steps
    assert [r for c, r in rows if c] == [r for c, r in rows if not c] and len(rows) == 2 * 4
    assert read <= 4 * (WINDOW_STEPS + 2) < 129 / 2


def test_the_fingerprint_carries_auto_and_its_budget():
    rows = [fingerprint(cfg, (64, 64), "float32", 3, None, "dense")
            for cfg in (AUTO, TopKConfig(ratio="auto", budget=0.2))]
    assert rows[0] != rows[1] != fingerprint(TopKConfig(ratio=0.01), (64, 64), "float32", 3, None, "dense")
    message = mismatch_message("w", rows)
    assert "budget (rank 0: 0.1, rank 1: 0.2)" in message and "ratio (" not in message
    shown = mismatch_message("w", [rows[0], fingerprint(TopKConfig(ratio=0.5), (64, 64), "float32", 3, None,
                                                         "dense")])
    assert "ratio (rank 0: 'auto', rank 1: 0.5)" in shown
