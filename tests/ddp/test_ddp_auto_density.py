"""ratio="auto" in the DDP hook on real torch.distributed workers (Gloo, CPU): the same decisions on every rank from
the real probes; error feedback exact and parameters identical through dense -> sparse -> dense -> sparse; exact
resume with the density in force; ranks that part raise RankMismatch instead of hanging."""
from __future__ import annotations

import pytest
import torch

from tests.auto_links import FIRST_DECISION, SECOND_DECISION, THIRD_DECISION

from . import auto_workers, harness
from .test_ddp_hook import _check_invariant
from .test_ddp_update_mode import check_update_invariant


@pytest.mark.parametrize("target", ["gradient", "auto"])  # "auto": update mode for the Adam optimizer
def test_measured_decisions_are_the_same_on_every_rank(target):
    results = harness.run(auto_workers.measured, 2, target)
    assert all(r["same"] for r in results)
    assert all(r["target"] == ("update" if target == "auto" else "gradient") for r in results)
    assert results[0]["decisions"] >= 2
    assert results[0]["history"][:FIRST_DECISION] == [None] * FIRST_DECISION  # dense while measuring
    for r in results[1:]:
        assert r["history"] == results[0]["history"]
        assert r["last"] == results[0]["last"]  # the reduced measurement, bit for bit
    last = results[0]["last"]
    assert last["bandwidth_bps"] > 0 and last["compute_s"] > 0 and last["world_size"] == 2
    # a window's compute is its step less wait and compression (per rank, then the max over ranks of each column)
    assert last["measured_step_s"] >= last["window_compute_s"] > 0
    if last["window_ratio"] is None:  # a dense window: its compute is the one the prediction uses
        assert last["compute_s"] == last["window_compute_s"]


@pytest.mark.parametrize("world_size,micro_batches,ddp_options", [
    (2, 1, {}),
    (3, 1, {}),
    (2, 3, {}),  # gradient accumulation under no_sync(): auto counts synchronised steps only
    (2, 1, {"static_graph": True, "gradient_as_bucket_view": True}),
])
def test_error_feedback_stays_exact_through_every_change_of_density(world_size, micro_batches, ddp_options):
    results = harness.run(auto_workers.invariant, world_size, "changes", micro_batches, ddp_options)
    _check_invariant(results, world_size)  # per bucket call, per member, across the changes
    assert all(r["same"] for r in results)
    ratios = results[0]["ratios"]
    assert all(r["ratios"] == ratios and r["decided"] == results[0]["decided"] for r in results)
    changes = [(i, r) for i, r in enumerate(ratios) if i and r != ratios[i - 1]]
    assert ratios[0] is None and len(changes) >= 3, changes
    assert changes[0][0] == FIRST_DECISION  # decided at the first bucket of that step, which ran sparse
    assert any(r is None for _, r in changes[1:]), changes  # back to dense once
    sent, dense = results[0]["sent"], results[0]["sent"][0]
    by_ratio: dict = {}
    for i, ratio in enumerate(ratios):
        by_ratio.setdefault(ratio, set()).add(sent[i])
        if ratio is None:
            assert sent[i] == dense  # every member dense (leftovers travel inside the dense bytes)
        else:
            # an entry costs at most twice a dense entry (index + value); the tiny dense member and k's rounding up
            assert 0 < sent[i] < dense * 2 * ratio + 1024, (ratio, sent[i], dense)
    assert all(len(bytes_) == 1 for bytes_ in by_ratio.values()), by_ratio  # the density in force decides the bytes


def test_fp16_keeps_error_feedback_exact_halves_the_bytes_and_hands_over_to_dense_and_back():
    """ratio="auto"'s fp16 (dense, values in float16, the rounding in the residual): per bucket call and member the
    invariant holds within the float16 sum's own rounding, through dense -> fp16 -> dense (the residual's
    leftovers go with the first dense step) -> fp16; parameters identical on every rank; half dense's bytes."""
    world_size = 2
    results = harness.run(auto_workers.invariant, world_size, "half")
    assert _check_invariant(results, world_size) > 0  # fp16 steps were checked
    assert all(r["same"] for r in results)
    ratios = results[0]["ratios"]
    assert all(r["ratios"] == ratios for r in results)
    assert ratios[:FIRST_DECISION] == [None] * FIRST_DECISION
    assert ratios[FIRST_DECISION] == "fp16" and ratios[SECOND_DECISION] is None and ratios[-1] == "fp16", ratios
    sent, dense = results[0]["sent"], results[0]["sent"][0]
    for i, ratio in enumerate(ratios):
        assert sent[i] == (dense if ratio is None else dense // 4), (i, ratio)  # float64 model: 8 -> 2 bytes
    stats = results[0]["stats"]
    assert set(stats["exchanges"]) == {"dense_fp16"} and stats["exchanges"]["dense_fp16"] > 0
    assert stats["buckets"]["compressed"] == 0  # sent whole in float16, not compressed


def test_int8_keeps_error_feedback_exact_sends_a_byte_a_value_and_hands_over_to_dense_and_back():
    """ratio="auto"'s int8 in the DDP hook (each member's values one byte on its own grid, four to an int32 word, one
    allreduce per bucket): per bucket call and member the invariant holds exactly (an integer sum rounds nothing;
    a member's first step on the route, without a grid, goes fp16 and sets it), through dense -> int8 -> dense ->
    int8 (the grid kept across the dense steps); parameters identical on every rank; a byte a value."""
    from horovod_topk.torch.int8_route import int8_words

    from .workers import make_model

    world_size = 2
    results = harness.run(auto_workers.invariant, world_size, "int8")
    first_steps = _check_invariant(results, world_size)  # the member checks made on fp16 (the grids' first steps)
    assert all(r["same"] for r in results)
    ratios = results[0]["ratios"]
    assert all(r["ratios"] == ratios for r in results)
    assert ratios[:FIRST_DECISION] == [None] * FIRST_DECISION
    assert ratios[FIRST_DECISION] == "int8" and ratios[SECOND_DECISION] is None and ratios[-1] == "int8", ratios
    log = results[0]["log"]
    # the int8 calls of the first int8 step went fp16 (no grid yet), every later one on its members' grids
    by_call = [any(e["half"]) for e in log if e["int8"]]
    assert first_steps > 0 and by_call == sorted(by_call, reverse=True), by_call
    assert by_call.count(False) >= len(log) // 3, (by_call, len(log))  # checked exactly above
    sizes = [p.numel() for p in make_model(torch.float64).parameters()]
    words = sum(4 * int8_words(n) for n in sizes)
    sent, dense = results[0]["sent"], results[0]["sent"][0]
    assert dense == 8 * sum(sizes)
    for i, ratio in enumerate(ratios):
        expected = dense if ratio is None else dense // 4 if i == FIRST_DECISION else words
        assert sent[i] == expected, (i, ratio, sent[i], expected)
    assert words < dense // 7  # float64: 8 bytes a value, int8 one (and each member's control word)
    stats = results[0]["stats"]
    assert stats["exchanges"].get("dense_int8", 0) > 0 and stats["buckets"]["compressed"] == 0


def test_int8_a_nan_on_one_rank_makes_its_member_nan_everywhere_and_no_residual_takes_it():
    """A NaN in rank 1's c.weight on an int8 step: c.weight's averaged gradient is NaN on every rank (a byte cannot
    carry it; the member's control word does), its bucket-mates' are finite and their residuals carry on, no
    residual holds a non-finite value, and the ranks' grids stay alike."""
    results = harness.run(auto_workers.int8_nonfinite, 2)
    for r in results:
        assert r["ratio"] == "int8"
        assert torch.isnan(r["grads"]["c.weight"]).all()
        assert all(torch.isfinite(g).all() for n, g in r["grads"].items() if n != "c.weight")
        assert all(torch.isfinite(v).all() for v in r["residuals"].values())
        assert not torch.equal(r["residuals"]["b.weight"], r["before"]["b.weight"])  # a bucket-mate carried on
    # the NaN entry's residual is kept, not taken; the finite entries were sent as on any step (and are dropped with
    # the step everywhere, as dense DDP's would be)
    assert results[1]["residuals"]["c.weight"][0] == results[1]["before"]["c.weight"][0]
    assert results[1]["nonfinite_steps"] >= 1 and results[0]["nonfinite_steps"] == 0
    assert results[0]["grids"] == results[1]["grids"]


def test_update_mode_with_int8_runs_its_steps_as_gradient_mode_a_byte_a_value():
    """Update mode (Adam) while auto holds int8: the step takes the gradient route (the hook reduces the buckets on
    the int8 route, every rank's Adam takes the same averaged gradient), through dense -> int8 -> dense -> int8;
    identical parameters on every rank; the bytes of a step on the grids are a byte a value."""
    from horovod_topk.torch.int8_route import int8_words

    from .workers import make_model

    results = harness.run(auto_workers.update_invariant, 2, "int8")
    assert all(r["same"] for r in results)
    ratios = results[0]["ratios"]
    assert all(r["ratios"] == ratios for r in results)
    assert ratios[FIRST_DECISION] == "int8" and ratios[SECOND_DECISION] is None and ratios[-1] == "int8", ratios
    words = sum(4 * int8_words(p.numel()) for p in make_model(torch.float64).parameters())
    sent = results[0]["sent"]
    on_grid = [i for i, r in enumerate(ratios) if r == "int8" and i != FIRST_DECISION]
    assert on_grid and all(sent[i] == words for i in on_grid), [(i, sent[i], words) for i in on_grid]


def test_update_mode_keeps_error_feedback_exact_through_every_change_of_density():
    """Update mode (Adam), the density decided at the optimizer's step: per step and compressed update, the ranks'
    residuals + P x applied == their old residuals + local updates, through dense -> sparse -> dense -> sparse (a
    turn to dense sends each residual's leftovers with the update); identical parameters; the bytes follow the
    density in force."""
    world_size = 2
    results = harness.run(auto_workers.update_invariant, world_size, "changes")
    assert all(r["same"] for r in results)
    ratios = results[0]["ratios"]
    assert all(r["ratios"] == ratios and r["decided"] == results[0]["decided"] for r in results)
    changes = [(i, r) for i, r in enumerate(ratios) if i and r != ratios[i - 1]]
    assert ratios[0] is None and len(changes) >= 3, changes
    assert changes[0][0] == FIRST_DECISION  # decided at that step's optimizer step, which ran sparse
    assert any(r is None for _, r in changes[1:]), changes
    # every sparse step from the first on is checked, and every dense step right after a sparse one (its residuals'
    # leftovers leave with it and the residuals are dropped, so the dense steps after it hold none)
    assert all(results[0]["log"][i]["new"] for i in range(FIRST_DECISION, len(ratios))
               if ratios[i] is not None or ratios[i - 1] is not None)
    assert check_update_invariant(results, world_size, steps=len(ratios)) > 0  # the tolerance of the fixed ratio's test
    sent, by_ratio = results[0]["sent"], {}
    for i, ratio in enumerate(ratios):
        by_ratio.setdefault(ratio, set()).add(sent[i])
    assert all(len(bytes_) == 1 for bytes_ in by_ratio.values()), by_ratio  # the density in force decides the bytes
    for ratio, (bytes_,) in by_ratio.items():
        # dense: every update (leftovers inside the same bytes); a density: at most 2 x ratio of them (an entry is an
        # index and a value), beside the small dense tensors and the second moment's sketch
        assert ratio is None and bytes_ == sent[0] or 0 < bytes_ < sent[0] * 2 * ratio + 8192, (ratio, by_ratio)


@pytest.mark.parametrize("target,script", [("gradient", "slow_then_sparse_slower"), ("update", "slow_then_sparse_slower"),
                                           ("gradient", "int8")])
def test_checkpoint_resumes_exactly_with_the_density_in_force(target, script):
    results = harness.run(auto_workers.resume, 2, target, script)
    for r in results:
        assert r["saved_ratio"] is not None  # saved while sparse (or int8)
        if script == "int8":  # each member's grid came back with the checkpoint
            assert r["saved_ratio"] == "int8" and all(g > 0 for g in r["grids"]), r["grids"]
        assert torch.equal(r["straight"], r["resumed"])
        assert r["straight_auto"]["ratio"] == r["resumed_auto"]["ratio"]
    assert torch.equal(results[0]["resumed"], results[1]["resumed"])


@pytest.mark.parametrize("how,named", [("budget", "budget"), ("decision", "")])
def test_ranks_that_part_raise_together(how, named):
    messages = harness.run(auto_workers.disagree, 2, how)
    for message in messages:
        assert message.startswith("RankMismatch"), message
        assert named in message
    if how == "decision":  # at the decision's step, before any payload of another size was exchanged
        assert all(f"at step {FIRST_DECISION}:" in m for m in messages), messages


def test_update_mode_held_dense_is_adam_on_the_averaged_gradient():
    """Update mode with auto kept dense: every step takes the gradient route (the hook reduces the buckets), and the
    model trains as DDP's allreduce with torch's Adam; the averaged gradient is in .grad on every rank."""
    results = harness.run(auto_workers.update_held_dense, 2)
    for r in results:
        assert r["routes"] == ["gradient"] * len(r["routes"]) and r["ratio"] is None and r["decisions"] >= 1
        # Adam's rounding differs between torch's kernels and the update rule: a step moves a weight by up to 1e-2
        torch.testing.assert_close(r["ours"], r["plain"], rtol=1e-5, atol=1e-5)
        assert r["same"] and r["grads_same"]


def test_update_mode_entering_the_gradient_route_averages_state_and_applies_the_mean_residual():
    results = harness.run(auto_workers.update_entering, 2)
    for r in results:
        assert r["had_residuals"] >= 1
        assert r["routes"][SECOND_DECISION - 1] == "local" and r["routes"][SECOND_DECISION:] == ["gradient"] * 3
        assert r["param_gap"] < 1e-12 and r["moment_gap"] < 1e-6, r
        assert r["moments_same"] and r["same"] and r["residuals_left"] == [] and r["shared"] == [""]


def test_update_mode_steps_the_optimizer_skipped_are_closed_at_the_next_bucket_zero():
    """A step whose optimizer step did not run (AMP's GradScaler skipping it) entering the gradient route, and one
    leaving it: no error at the next decision, the state shared, parameters identical on every rank."""
    results = harness.run(auto_workers.update_skipped_steps, 2)
    for r in results:
        assert r["routes"][SECOND_DECISION - 1] == "local", r["routes"]
        assert r["ratios"][SECOND_DECISION] is None and isinstance(r["ratios"][THIRD_DECISION], float), r["ratios"]
        assert r["routes"][-1] == "local" and r["same"], r["routes"]
    assert results[0]["ratios"] == results[1]["ratios"]
