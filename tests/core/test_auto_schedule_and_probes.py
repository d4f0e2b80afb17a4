"""ratio="auto"'s pieces that both frameworks share: the routes a traced graph switches among (auto_schedule) and
the probe sequence whose times become a Measurement (core.linkprobe)."""
import pytest

from horovod_topk.core import TopKConfig, linkprobe
from horovod_topk.core.autodensity import CHOICES, DENSITIES, HALF, AutoDensity, auto_schedule, choice_index, config_at
from horovod_topk.core.policy import plan_tensor


@pytest.mark.parametrize("world_size", [2, 4, 16])
@pytest.mark.parametrize("numel", [2048, 1 << 20])
def test_each_position_takes_the_plan_of_its_density(world_size, numel):
    config = TopKConfig(ratio="auto")
    schedule = auto_schedule("w", numel, True, config, world_size=world_size, value_itemsize=4, grad_itemsize=4,
                             sparse_available=True)
    assert schedule is not None and len(schedule.phase) == len(CHOICES)
    assert schedule.routes[schedule.phase[0]] == "dense" and schedule.count[0] == 0
    # fp16 is dense where the compressor does not offer it, its own route where it does
    assert schedule.routes[schedule.phase[choice_index(HALF)]] == "dense" and schedule.count[choice_index(HALF)] == 0
    offered = auto_schedule("w", numel, True, config, world_size=world_size, value_itemsize=4, grad_itemsize=4,
                            sparse_available=True, half=True)
    assert offered.routes[offered.phase[choice_index(HALF)]] == "dense_fp16"
    assert offered.count[choice_index(HALF)] == 0 and offered.phase[0] != offered.phase[choice_index(HALF)]
    assert [offered.count[i] for i in range(len(CHOICES))] == list(schedule.count)
    for ratio in DENSITIES:
        position = choice_index(ratio)
        plan = plan_tensor("w", numel, True, config_at(config, ratio), world_size=world_size, value_itemsize=4,
                           grad_itemsize=4, sparse_available=True)
        assert schedule.routes[schedule.phase[position]] == plan.exchange
        assert schedule.count[position] == (plan.k or 0)
    assert len(set(schedule.routes)) == len(schedule.routes)  # one branch per route, not per density


def test_a_tensor_dense_at_every_density_has_no_schedule():
    config = TopKConfig(ratio="auto", min_numel=4096)
    assert auto_schedule("b", 1000, True, config, world_size=2, value_itemsize=4, grad_itemsize=4) is None
    assert auto_schedule("i", 1 << 20, False, config, world_size=2, value_itemsize=4, grad_itemsize=4) is None


def test_with_fp16_offered_a_small_tensor_goes_in_float16_and_only_a_floating_one():
    """As PyTorch sends it while fp16 is in force (AutoDensity.held_plan): every floating tensor, however small,
    in float16; not one that is not floating point or already 2 bytes a value."""
    config = TopKConfig(ratio="auto", min_numel=4096)
    small = auto_schedule("b", 1000, True, config, world_size=2, value_itemsize=4, grad_itemsize=4, half=True)
    assert small is not None and small.routes == ("dense", "dense_fp16") and set(small.count) == {0}
    assert [small.routes[p] for p in small.phase] == ["dense", "dense_fp16"] + ["dense"] * len(DENSITIES) + ["dense"]  # int8: not sent by a traced graph
    assert auto_schedule("i", 1 << 20, False, config, world_size=2, value_itemsize=4, grad_itemsize=4,
                         half=True) is None
    assert auto_schedule("h", 1000, True, config, world_size=2, value_itemsize=2, grad_itemsize=2, half=True) is None


def test_choice_index_round_trips_and_names_a_stranger():
    assert [choice_index(r) for r in CHOICES] == list(range(len(CHOICES)))
    with pytest.raises(ValueError, match="0.02"):
        choice_index(0.02)


class ScriptedProbes:
    """LinkProbes with fixed times: 1 ms a small allreduce, 9 ms the large one, 4 ms a burst of 16."""

    def __init__(self):
        self.calls = []

    def allreduce_seconds(self, numel, name, repeats):
        self.calls.append(("allreduce", numel, name, repeats))
        return [0.001] * repeats if numel == 1 else [0.010, 0.009][:repeats]

    def burst_seconds(self, count):
        self.calls.append(("burst", count))
        return 0.004

    def select_seconds_per_entry(self, numel):
        self.calls.append(("select", numel))
        return 2e-9

    def gather_rows(self, row):
        self.calls.append(("rows",))
        return [list(row), [v * 2 for v in row]]


def test_the_probe_sequence_and_its_arithmetic():
    auto = AutoDensity(TopKConfig(ratio="auto"))
    probes = ScriptedProbes()
    m = linkprobe.measure(auto, [("a", 100_000), ("b", 10_000_000)], probes, world_size=2)
    large = linkprobe.probe_nbytes(4 * 10_100_000)
    assert large == linkprobe.PROBE_MAX_BYTES
    assert probes.calls == [("allreduce", 1, linkprobe.SMALL_PROBE_NAME, linkprobe.SMALL_REPEATS),
                            ("allreduce", large // 4, linkprobe.large_probe_name(large), linkprobe.LARGE_REPEATS),
                            ("burst", linkprobe.BURST), ("select", linkprobe.SELECT_PROBE_NUMEL), ("rows",)]
    marginal = (0.004 - 0.001) / (linkprobe.BURST - 1)
    # the slowest rank's row (the second, 2x) decides; the large probe counts the marginal latency, not the lone one
    assert m.latency_s == pytest.approx(2 * marginal)
    assert m.large_s == pytest.approx(2 * (0.009 - 0.001 + marginal))
    assert m.lone_s == pytest.approx(0.002)
    assert m.select_s_per_entry == pytest.approx(4e-9)
    assert m.large_nbytes == pytest.approx(large)  # a ring allreduce at P = 2 sends 2 (P - 1) / P of it
    assert linkprobe.probe_nbytes(10) == linkprobe.PROBE_MIN_BYTES


class AgreeingProbes(ScriptedProbes):
    """ScriptedProbes whose ranks all send the same row (as ranks reusing reduced probes do)."""

    def gather_rows(self, row):
        self.calls.append(("rows",))
        return [list(row), list(row)]


def test_the_check_of_a_change_takes_the_probes_of_the_decision_that_made_it():
    """A change is checked one window later from the new choice's measured step, with the link as probed at the
    change (no probes: only the rows are gathered); the next decision probes again unless the last probes
    settle it (the test below), and a decision after decide_soon (a load, workers changed) probe again."""
    tensors = [("a", 100_000), ("b", 10_000_000)]
    auto, probes = AutoDensity(TopKConfig(ratio="auto")), AgreeingProbes()
    probed = ["allreduce", "allreduce", "burst", "select", "rows"]

    def decision_at(step):
        probes.calls.clear()
        auto.step = step
        m = linkprobe.measure(auto, tensors, probes, world_size=2)
        auto.decide(tensors, m)
        return [c[0] for c in probes.calls], m

    calls, first = decision_at(12)  # the first decision always changes (it is the first)
    assert calls == probed and auto.last["probed_at"] == 12
    calls, check = decision_at(24)
    assert calls == ["rows"] and auto.last["probed_at"] == 12
    assert (check.latency_s, check.large_s, check.select_s_per_entry, check.lone_s) == (
        first.latency_s, first.large_s, first.select_s_per_entry, first.lone_s)
    calls, _ = decision_at(36)  # a regular decision: the empty windows keep dense on any link (the test below)
    assert calls == ["rows"] and auto.last["probed_at"] == 12
    auto._recheck = True  # a check due ...
    auto.decide_soon()  # ... but the workers changed
    assert decision_at(48)[0] == probed
    auto._recheck = True
    auto.load_state_dict(auto.state_dict())  # a load probes its own link
    assert decision_at(60)[0] == probed


def test_a_regular_decision_takes_the_last_probes_when_a_link_twice_as_fast_or_slow_changes_nothing():
    """After a decision that kept the choice, a regular decision gathers the rows with the last probes and keeps
    them when the choice in force stands with that link LINK_MARGIN times faster and slower; a choice near its
    boundary, a change, probes older than PROBES_KEPT_DECISIONS x auto_every, or decide_soon make it probe."""
    from horovod_topk.core.autodensity import PROBES_KEPT_DECISIONS

    tensors = [("a", 100_000), ("b", 10_000_000)]
    probed = ["allreduce", "allreduce", "burst", "select", "rows"]

    def run(sparse_step_s, steps):
        """Dense 100 ms with 80 ms of exposed communication, then 0.03 at ``sparse_step_s``: the probe calls of
        the decisions at ``steps`` (the first, its check, then regular ones)."""
        auto, probes = AutoDensity(TopKConfig(ratio="auto", auto_every=50, sparsity_cost=0.0)), AgreeingProbes()
        calls = []
        for n, step in enumerate(steps):
            probes.calls.clear()
            auto._samples[:] = [(0.100, 0.080, 0.0) if n == 0 else (sparse_step_s, 0.0, 0.002)] * 10
            auto.step = step
            auto.decide(tensors, linkprobe.measure(auto, tensors, probes, world_size=2))
            calls.append([c[0] for c in probes.calls])
            assert auto.ratio == 0.03
        return auto, calls

    # 0.03 at 50 ms against dense's 100: it stays the choice on a link twice as fast or slow; the check (24) takes
    # the first decision's probes, the regular decisions the last ones, until they are PROBES_KEPT_DECISIONS old
    last = 12 + PROBES_KEPT_DECISIONS * 50
    auto, calls = run(0.050, [12, 24, 74, last, last + 50])
    assert calls == [probed, ["rows"], ["rows"], ["rows"], probed]
    assert auto.last["probed_at"] == last + 50
    # 0.03 at 90 ms: on a link twice as fast dense would be sooner; at 30 ms, on one twice as slow 0.01 would:
    # the regular decision probes
    for sparse_step_s in (0.090, 0.030):
        auto, calls = run(sparse_step_s, [12, 24, 74])
        assert calls == [probed, ["rows"], ["rows"] + probed] and auto.last["probed_at"] == 74
    # after decide_soon (a load, workers changed) the next decision probes, kept choice or not
    auto._last_did = "kept"
    auto.decide_soon()
    auto.step, auto._samples[:] = 200, [(0.050, 0.0, 0.002)] * 10
    probes = AgreeingProbes()
    auto.decide(tensors, linkprobe.measure(auto, tensors, probes, world_size=2))
    assert [c[0] for c in probes.calls] == probed


class ScaledProbes(AgreeingProbes):
    """AgreeingProbes whose large probe takes ``scale`` times as long (a link 1 / scale as fast)."""

    scale = 1.0

    def allreduce_seconds(self, numel, name, repeats):
        times = super().allreduce_seconds(numel, name, repeats)
        return times if numel == 1 else [t * self.scale for t in times]


def test_fresh_probes_within_the_links_noise_give_the_link_the_first_probes_read():
    tensors = [("a", 100_000), ("b", 10_000_000)]
    auto, probes = AutoDensity(TopKConfig(ratio="auto")), ScaledProbes()
    first = linkprobe.measure(auto, tensors, probes, world_size=2)
    auto._recheck, auto._last_did = False, ""  # the next decision probes afresh
    probes.scale = 1 / 1.3
    again = linkprobe.measure(auto, tensors, probes, world_size=2)
    assert again.link() == first.link() and auto._probed_bps > 1.2 * first.link().bandwidth_bps
    probes.scale = 1 / 3
    assert linkprobe.measure(auto, tensors, probes, world_size=2).link().bandwidth_bps > 2 * first.link().bandwidth_bps
