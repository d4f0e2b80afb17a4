"""ratio="auto": validation, the pure decision rule, and the state object (core.autodensity)."""
import pytest

from horovod_topk.core import TopKConfig
from horovod_topk.core.config import DEFAULT_BUDGET
from horovod_topk.core.autodensity import (
    DENSITIES,
    FASTER,
    HALF,
    FIRST_DECISION,
    LINK_NOISE,
    SETTLE_STEPS,
    WINDOW_STEPS,
    AutoDensity,
    Measurement,
    choose_density,
    predict_steps,
    steps_factor,
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
    (dict(ratio=0.01, sparsity_cost=0.1), "sparsity_cost"),
    (dict(ratio="auto", sparsity_cost=-0.1), "sparsity_cost"),
    (dict(ratio="auto", sparsity_cost=float("nan")), "sparsity_cost"),
    (dict(ratio="auto", sparsity_cost="high"), "sparsity_cost"),
    (dict(ratio="fast"), "ratio"),
])
def test_bad_auto_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        TopKConfig(**options)


def test_auto_fills_its_defaults_and_round_trips():
    assert (AUTO.budget, AUTO.auto_every, AUTO.sparsity_cost, AUTO.auto) == (0.1, 200, 0.1, True)
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


def test_steps_factor_is_one_for_dense_and_grows_as_the_density_falls():
    assert steps_factor(None, 0.1) == 1.0 and steps_factor(0.01, 0.0) == 1.0
    assert steps_factor(0.01, 0.1) == pytest.approx(10 ** 0.2)  # 1.58x dense's steps
    factors = [steps_factor(d, 0.1) for d in DENSITIES]
    assert factors == sorted(factors) and factors[0] > 1.0


def _balanced(rate_bps):
    """A job whose compute (0.3 s) and dense communication are of the same order: the sparse step saves a few tens
    of percent, the case a per-step choice gets wrong when sparsity costs steps."""
    return link(rate_bps, compute=0.3, select=2e-9)


@pytest.mark.parametrize("rate", [6e9, 1e10])
def test_a_density_that_saves_less_per_step_than_it_costs_in_steps_is_not_chosen(rate):
    per_step = choose_density(TENSORS, TopKConfig(ratio="auto", sparsity_cost=0.0), _balanced(rate), current=None,
                              first=True)
    to_target = choose_density(TENSORS, AUTO, _balanced(rate), current=None, first=True)
    times = to_target.to_target_s
    assert per_step.predicted_s == to_target.predicted_s  # the same step predictions, compared differently
    assert times["dense"] == to_target.predicted_s["dense"] and times["fp16"] == to_target.predicted_s["fp16"]
    for d in DENSITIES:
        assert times[f"{d:g}"] == pytest.approx(to_target.predicted_s[f"{d:g}"] * steps_factor(d, 0.1))
    assert times[to_target.label] <= times["dense"]  # never later to the target than dense
    # the step-time choice compresses; the predicted time to target of that density is later than dense's
    assert per_step.ratio is not None and times[per_step.label] > times["dense"], (rate, times)
    assert to_target.ratio is None


def test_a_higher_sparsity_cost_never_chooses_a_sparser_density():
    for rate in (1e7, 1e8, 3e8, 1e9, 3e9, 1e10, 3e10):
        chosen = [choose_density(TENSORS, TopKConfig(ratio="auto", sparsity_cost=cost), _balanced(rate),
                                 current=None, first=True).ratio for cost in (0.0, 0.05, 0.1, 0.2, 0.5)]
        order = [-1 if r is None else DENSITIES.index(r) for r in chosen]
        assert order == sorted(order, reverse=True), (rate, chosen)
    # over a slow link compression still pays for its steps: dense's step is ~8x the sparse one's
    slow = choose_density(TENSORS, AUTO, _balanced(1e8), current=None, first=True)
    assert slow.ratio is not None and slow.to_target_s[slow.label] < slow.to_target_s["dense"] / 3


def test_a_denser_choice_sooner_to_the_target_replaces_the_largest_that_fits():
    """The budget's rule alone takes the largest density that fits; one denser that misses the budget but is
    predicted to reach the target sooner wins."""
    m = _balanced(1e9)
    cfg0, cfg = TopKConfig(ratio="auto", sparsity_cost=0.0, budget=0.2), TopKConfig(ratio="auto", budget=0.2)
    fits = choose_density(TENSORS, cfg0, m, current=None, first=True)
    sooner = choose_density(TENSORS, cfg, m, current=None, first=True)
    assert "fits the budget" in fits.reason and fits.ratio is not None
    assert sooner.ratio is not None and sooner.ratio > fits.ratio and "soonest to the target" in sooner.reason
    assert sooner.to_target_s[sooner.label] < sooner.to_target_s[fits.label]


def test_when_nothing_fits_the_choice_is_within_faster_of_the_soonest_to_the_target():
    for rate in (3e7, 1e8, 1.58e8, 3e8, 1e9):
        choice = choose_density(TENSORS, AUTO, link(rate), current=None, first=True)
        if "nothing fits" in choice.reason:
            assert choice.to_target_s[choice.label] <= min(choice.to_target_s.values()) * (1 + FASTER) + 1e-12


def test_hysteresis_never_keeps_a_density_predicted_later_than_dense():
    cfg = TopKConfig(ratio="auto", budget=0.5)
    m = link(1e9, compute=1.0, select=1e-8)
    kept = choose_density(TENSORS, cfg, m, current=0.3, first=False, offset_s=0.02)
    assert kept.to_target_s["0.3"] > kept.to_target_s["dense"]  # the current density is later than dense here
    assert kept.ratio != 0.3 and kept.to_target_s[kept.label] <= kept.to_target_s["dense"], kept.reason


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
    first = FIRST_DECISION
    assert SETTLE_STEPS < first < SETTLE_STEPS + WINDOW_STEPS  # the dense steps before the first choice are few
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
    assert "sparsity_cost 0.1" in auto.summary_line() and " steps)" in auto.summary_line()  # x d**-0.1 shown
    assert auto.last["to_target_s"] == choice.to_target_s and auto.last["window_ratio"] is None

    # a sparse window measured far slower than predicted: the offset says so and dense comes back
    auto.step = auto.next_decision
    slow = link(1e8, compute=0.1, period=5.0)
    back = auto.decide(TENSORS, slow)
    assert auto.offset_s > 4.0 and back.ratio is None

    auto.shared_scopes.append("opt1.")  # an update-mode optimizer whose last step ran as gradient mode
    saved = auto.state_dict()
    other = AutoDensity(AUTO)
    other.load_state_dict(saved)
    assert other.state_dict() == saved and other.effective_config() is None
    assert other.shared_scopes == ["opt1."] and other.holds_dense
    with pytest.raises(ValueError, match="density"):
        other.load_state_dict({**saved, "ratio": 0.5})


def test_fp16_is_chosen_only_where_the_front_end_sends_it_and_it_is_soonest():
    """A link where dense's step is mostly exposed communication and sparsity costs steps: fp16 (half the bytes,
    dense's steps) is the soonest to the target, so a front end that sends fp16 takes it, and one that does not
    takes what it took before; a fast link stays dense either way."""
    m = link(2.4e9, compute=1.0, select=2e-9)
    without = choose_density(TENSORS, AUTO, m, current=None, first=True)
    with_half = choose_density(TENSORS, AUTO, m, current=None, first=True, half=True)
    times = with_half.to_target_s
    assert with_half.ratio == HALF and with_half.label == "fp16", with_half.reason
    assert times["fp16"] < times["dense"] and times["fp16"] <= min(times.values()) + 1e-12
    assert without.ratio != HALF and without.predicted_s == with_half.predicted_s
    assert choose_density(TENSORS, AUTO, link(1e12), current=None, first=True, half=True).ratio is None
    # a front end that stops sending fp16 (a load) decides afresh instead of keeping it
    again = choose_density(TENSORS, AUTO, m, current=HALF, first=False)
    assert again.ratio != HALF and again.ratio == without.ratio


def test_a_sparser_choice_must_be_faster_sooner_even_where_the_current_one_misses_the_budget():
    """Dense in force and missing the budget by far: fp16 predicted less than FASTER sooner leaves dense in force
    (the margin that would bring dense back from fp16: otherwise the two trade places at every decision on a job
    where their steps differ by a window's noise); predicted more than FASTER sooner, it is taken."""
    m = link(2.4e9, compute=1.0, select=2e-9)
    free = choose_density(TENSORS, AUTO, m, current=None, first=True, half=True)
    steps, exposed, budget = free.predicted_s, free.exposed_s, DEFAULT_BUDGET
    assert exposed["dense"] > budget * steps["dense"] * 1.25  # dense misses the budget by more than the hysteresis
    for sooner, taken in ((FASTER / 2, None), (2 * FASTER, HALF)):
        offset = steps["dense"] / (1 + sooner) - steps["fp16"]
        choice = choose_density(TENSORS, AUTO, m, current=None, first=False, half=True, half_offset_s=offset)
        assert choice.to_target_s["fp16"] * (1 + sooner) == pytest.approx(choice.to_target_s["dense"])
        assert choice.ratio == taken, choice.reason
        if taken is None:
            assert "kept" in choice.reason and f"{FASTER:.0%} sooner" in choice.reason


def test_an_fp16_window_measures_its_own_offset_and_round_trips():
    auto = AutoDensity(AUTO, half=True)
    auto.step = SETTLE_STEPS + WINDOW_STEPS
    m = link(2.4e9, compute=1.0, select=2e-9)
    raw = predict_steps(TENSORS, AUTO, m, compute_s=0.0, hidden_s=0.0, offset_s=0.0)[0]
    dense_step = 1.0 + raw["dense"]  # what backward hides: nothing
    assert auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step)).ratio == HALF
    assert auto.effective_config() is None and auto.held_plan(1000, True, 4).exchange == "dense_fp16"
    assert auto.held_plan(1000, True, 2).exchange == "dense" and auto.held_plan(1000, False, 8).exchange == "dense"
    assert "-> fp16" in auto.summary_line()
    # the fp16 window measured 2 s slower than predicted: its offset says so, and dense comes back
    auto.step = auto.next_decision
    back = auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step + 2.0))
    assert auto.half_offset_s == pytest.approx(dense_step + 2.0 - (1.0 + raw["fp16"]))
    assert back.ratio is None and auto.offset_s == 0.0  # the sparse offset is not fp16's
    saved = {**auto.state_dict(), "ratio": HALF}
    same = AutoDensity(AUTO, half=True)
    same.load_state_dict(saved)
    assert same.ratio == HALF and same.state_dict() == saved
    # a front end that does not send fp16 loads it as dense and decides again after a fresh window
    other = AutoDensity(AUTO)
    other.load_state_dict(saved)
    assert other.ratio is None and other.next_decision == other.step + 1 + SETTLE_STEPS + WINDOW_STEPS


def test_history_keeps_the_first_decision_and_every_change_not_the_kept_ones():
    auto = AutoDensity(AUTO, half=True)
    auto.step = first = SETTLE_STEPS + WINDOW_STEPS
    m = link(2.4e9, compute=1.0, select=2e-9)
    dense_step = 1.0 + predict_steps(TENSORS, AUTO, m, compute_s=0.0, hidden_s=0.0, offset_s=0.0)[0]["dense"]
    auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step))  # fp16
    auto.step = second = auto.next_decision
    auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step + 2.0))  # back to dense
    for _ in range(3):  # kept: not in the history
        auto.step = auto.next_decision
        auto.decide(TENSORS, link(1e12))
    assert auto.stats()["history"] == [[first, "fp16"], [second, "dense"]] and auto.decisions == 5


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
    costs = [fingerprint(TopKConfig(ratio="auto", sparsity_cost=c), (64, 64), "float32", 3, None, "dense")
             for c in (0.1, 0.0)]
    assert "sparsity_cost (rank 0: 0.1, rank 1: 0)" in mismatch_message("w", costs)
    shown = mismatch_message("w", [rows[0], fingerprint(TopKConfig(ratio=0.5), (64, 64), "float32", 3, None,
                                                         "dense")])
    assert "ratio (rank 0: 'auto', rank 1: 0.5)" in shown


def test_a_choice_no_window_has_run_needs_the_hysteresis_margin_to_replace_the_current_one():
    """Predictions of a choice the job never ran lack its measured offset: a 5-25% predicted gain is enough to move
    to a measured choice, not to an unmeasured one; past 25% both move."""
    cases = 0
    for rate in (3e7, 1e8, 3e8, 1e9, 3e9):
        for current in DENSITIES:
            for offset in (0.0, 0.02, 0.05, 0.1):
                kwargs = dict(current=current, first=False, offset_s=offset, half=True)
                moved = choose_density(TENSORS, AUTO, _balanced(rate), **kwargs)
                if moved.ratio == current:
                    continue
                gain = moved.to_target_s[f"{current:g}"] / moved.to_target_s[moved.label]
                guarded = choose_density(TENSORS, AUTO, _balanced(rate), unmeasured=[moved.label], **kwargs)
                if moved.predicted_s[f"{current:g}"] > moved.predicted_s["dense"]:
                    continue  # a density predicted later than dense is never kept, measured or not
                if 1 + FASTER < gain <= 1.25:
                    cases += 1
                    assert guarded.ratio == current and "25%" in guarded.reason, (rate, current, offset, gain)
                elif gain > 1.25:
                    assert guarded.ratio == moved.ratio
    assert cases, "no decision in the sweep moved on a gain between 5% and 25%"


def test_a_choice_left_at_the_check_of_its_change_needs_the_hysteresis_margin_to_come_back():
    """fp16 taken, measured slower at its check and left: from then on fp16 replaces dense only on a 25% predicted
    gain (a 12% one moves a job that never left it), and the record survives a checkpoint."""
    auto = AutoDensity(AUTO, half=True)
    auto.step = SETTLE_STEPS + WINDOW_STEPS
    m = link(2.4e9, compute=1.0, select=2e-9)
    raw = predict_steps(TENSORS, AUTO, m, compute_s=0.0, hidden_s=0.0, offset_s=0.0)[0]
    dense_step = 1.0 + raw["dense"]
    assert auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step)).ratio == HALF
    assert auto.abandoned == []
    auto.step = auto.next_decision
    assert auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step + 2.0)).ratio is None
    assert auto.abandoned == ["fp16"]
    auto.step = auto.next_decision  # a regular decision that keeps dense records nothing
    auto.decide(TENSORS, link(1e12))
    assert auto.abandoned == ["fp16"]

    def regular(abandoned):
        """A regular dense window after which fp16 is predicted 12% sooner than dense."""
        job = AutoDensity(AUTO, half=True)
        job.load_state_dict(auto.state_dict())
        job.abandoned = abandoned
        job.ratio, job.step = None, job.step + 200
        job.half_offset_s = dense_step / 1.12 - (1.0 + raw["fp16"])
        return job.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step))

    assert AutoDensity(AUTO, half=True).state_dict().get("abandoned") == []
    back = regular(auto.state_dict()["abandoned"])
    assert back.ratio is None and "25%" in back.reason
    assert back.to_target_s["dense"] / back.to_target_s["fp16"] == pytest.approx(1.12)
    assert regular([]).ratio == HALF


def test_probes_that_read_the_link_within_its_noise_leave_the_link_the_predictions_take():
    """Re-probing the same link reads rates ~1.3x apart; dense, priced with each reading, was predicted a fifth
    off the step its window measured. Within LINK_NOISE the first probes' link stays (dense predicted at its
    measured step), beyond it the new reading is taken; a load or new workers probe a link of their own."""
    auto = AutoDensity(AUTO)
    assert auto.steady_link(link(1e8)) == link(1e8)  # the first probes are the link
    near = auto.steady_link(link(1.3e8, compute=0.5))
    assert near.link().bandwidth_bps == pytest.approx(1e8) and near.compute_s == 0.5  # the window's own numbers
    assert auto._probed_bps == pytest.approx(1.3e8)
    assert auto.steady_link(link(1e8 / 1.3)).link().bandwidth_bps == pytest.approx(1e8)
    assert auto.steady_link(link(2e8)) == link(2e8)  # a link that moved by more than the noise is taken as read
    assert auto.steady_link(link(1.4e8)).link().bandwidth_bps == pytest.approx(2e8)
    auto.decide_soon()
    assert auto.steady_link(link(1.4e8)) == link(1.4e8)
    auto.load_state_dict(auto.state_dict())
    assert auto.steady_link(link(3e8)) == link(3e8)

    # dense measured 2 s a step; the next window (sparse) re-probes the link 1.3x faster: dense stays at 2 s
    for rate, dense_stays in ((1.3e8, True), (2 * LINK_NOISE * 1e8, False)):
        auto = AutoDensity(AUTO)
        auto.step = FIRST_DECISION
        auto.decide(TENSORS, auto.steady_link(link(1e8, compute=0.1, period=2.0)))
        assert auto.ratio is not None
        auto.step = auto.next_decision
        choice = auto.decide(TENSORS, auto.steady_link(link(rate, compute=0.1, period=0.3)))
        assert (choice.predicted_s["dense"] == pytest.approx(2.0)) is dense_stays, choice.predicted_s["dense"]
        assert auto.last["probed_bps"] == pytest.approx(rate)
        assert (f"(probed {rate / 1e6:.1f})" in auto.summary_line()) is dense_stays


def test_held_schedule_keeps_dense_and_fp16_branches_only():
    """Update mode's gradient route traces the routes of dense and fp16 alone; a density's position points at dense's
    branch (never in force there), and a tensor auto always sends dense keeps one branch, still scheduled."""
    from horovod_topk.core.autodensity import CHOICES, auto_schedule, held_schedule
    from horovod_topk.core.config import TopKConfig
    from horovod_topk.core.exchange import DENSE, DENSE_HALF

    config = TopKConfig(ratio="auto", min_numel=256)
    full = auto_schedule("w", 65536, True, config, world_size=4, value_itemsize=4, grad_itemsize=4, half=True)
    held = held_schedule(full)
    assert len(full.routes) > 2 and held.routes == (DENSE, DENSE_HALF)
    assert len(held.phase) == len(CHOICES) == len(full.phase)
    assert [held.routes[p] for p in held.phase] == [DENSE, DENSE_HALF] + [DENSE] * (len(CHOICES) - 2)
    assert set(held.count) == {0}
    no_half = auto_schedule("w", 65536, True, config, world_size=4, value_itemsize=4, grad_itemsize=4, half=False)
    assert held_schedule(no_half).routes == (DENSE,)


def test_int8_is_chosen_where_it_is_soonest_and_only_where_offered():
    """dense's step mostly exposed communication, sparsity costing steps: int8 (a quarter of the bytes, dense's
    steps) is sooner than fp16 and every density, so a front end that sends it takes it; one that does not, or
    more workers than int8 is offered to (core.exchange.int8_offered), takes fp16; a fast link stays dense."""
    from horovod_topk.core.autodensity import INT8

    m = link(2.4e9, compute=1.0, select=2e-9)
    with_int8 = choose_density(TENSORS, AUTO, m, current=None, first=True, half=True, int8=True)
    times = with_int8.to_target_s
    assert with_int8.ratio == INT8 and with_int8.label == "int8", with_int8.reason
    assert times["int8"] < times["fp16"] < times["dense"] and times["int8"] <= min(times.values()) + 1e-12
    assert with_int8.predicted_s["int8"] - 1.0 == pytest.approx((with_int8.predicted_s["fp16"] - 1.0) / 2, rel=0.01)
    assert choose_density(TENSORS, AUTO, m, current=None, first=True, half=True).ratio == HALF
    many = link(2.4e9, compute=1.0, select=2e-9, world_size=16)
    assert choose_density(TENSORS, AUTO, many, current=None, first=True, half=True, int8=True).ratio != INT8
    assert "int8" not in choose_density(TENSORS, AUTO, many, current=None, first=True, int8=True).predicted_s
    assert choose_density(TENSORS, AUTO, link(1e12), current=None, first=True, half=True, int8=True).ratio is None


def test_an_int8_window_measures_its_own_offset_and_round_trips():
    from horovod_topk.core.autodensity import INT8

    auto = AutoDensity(AUTO, half=True, int8=True)
    auto.step = SETTLE_STEPS + WINDOW_STEPS
    raw = predict_steps(TENSORS, AUTO, link(2.4e9, compute=1.0), compute_s=0.0, hidden_s=0.0, offset_s=0.0)[0]
    dense_step = 1.0 + raw["dense"]
    assert auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step)).ratio == INT8
    assert auto.holds_dense and auto.effective_config() is None
    assert auto.held_plan(1000, True, 4).exchange == "dense_int8" and auto.held_route == "dense_int8"
    assert auto.held_plan(1000, True, 1).exchange == "dense" and auto.held_plan(1000, False, 8).exchange == "dense"
    assert "-> int8" in auto.summary_line()
    auto.step = auto.next_decision  # the int8 window measured 2 s slower than predicted: dense or fp16 instead
    back = auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=dense_step + 2.0))
    assert auto.int8_offset_s == pytest.approx(dense_step + 2.0 - (1.0 + raw["int8"]))
    assert back.ratio != INT8 and auto.half_offset_s == 0.0 and auto.offset_s == 0.0
    saved = {**auto.state_dict(), "ratio": INT8}
    same = AutoDensity(AUTO, half=True, int8=True)
    same.load_state_dict(saved)
    assert same.ratio == INT8 and same.state_dict() == saved
    other = AutoDensity(AUTO, half=True)  # a front end without int8: dense, and a fresh window
    other.load_state_dict(saved)
    assert other.ratio is None and other.next_decision == other.step + 1 + SETTLE_STEPS + WINDOW_STEPS


def test_withdrawing_int8_leaves_it_out_and_sends_an_int8_in_force_dense_until_a_fresh_decision():
    """A front end whose gradients are off the CPU withdraws int8 (its grid's reference would be read on the host):
    int8 is no longer chosen, and a checkpoint's int8 in force turns dense and decides again after a fresh window."""
    from horovod_topk.core.autodensity import CHECK_STEPS, INT8

    auto = AutoDensity(AUTO, half=True, int8=True)
    auto.ratio, auto.step, auto.next_decision = INT8, 50, 400
    auto.withdraw_int8()
    assert not auto.int8 and auto.ratio is None and auto.held_route == "dense"
    assert auto.next_decision == 50 + 1 + CHECK_STEPS
    auto.step = auto.next_decision
    raw = predict_steps(TENSORS, AUTO, link(2.4e9, compute=1.0), compute_s=0.0, hidden_s=0.0, offset_s=0.0)[0]
    assert auto.decide(TENSORS, link(2.4e9, compute=1.0, select=2e-9, period=1.0 + raw["dense"])).ratio != INT8
