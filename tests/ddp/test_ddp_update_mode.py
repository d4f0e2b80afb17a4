"""Update mode under DDP (horovod_topk.torch.ddp_update) on real torch.distributed workers (Gloo, CPU): parity with
DDP's own allreduce for SGD at ratio 1, the error-feedback invariant with bit-identical parameters for each second
moment and exchange, the non-finite skip on every rank, exact resume, ranks in different modes, refusals."""
from __future__ import annotations

import pytest
import torch

from horovod_topk.torch import wait_stamps
from horovod_topk.torch.ddp import TopKEFState, update_mode_optimizer

from . import harness, update_workers, workers


def check_update_invariant(results, world_size: int, steps: int, rtol: float = 1e-5, atol: float = 1e-7) -> int:
    """Per step and compressed update (update_workers.logged_step's log): the sum of the ranks' new residuals + P x
    the applied update == the sum of (old residual + local update). Returns the checks whose residuals were not
    all zero (a sparse step)."""
    checked = 0
    for step in range(steps):
        entries = [r["log"][step] for r in results]  # a tensor enters the log once it has a residual
        for name in entries[0]["new"]:
            owed = sum(e["old"][name] + e["local"][name] for e in entries)
            kept = sum(e["new"][name] for e in entries)
            torch.testing.assert_close(kept + world_size * entries[0]["applied"][name], owed, rtol=rtol, atol=atol)
            checked += bool(kept.abs().sum() > 0)
    return checked


def test_sgd_at_ratio_one_trains_as_ddps_allreduce():
    results = harness.run(update_workers.sgd_parity, 2)
    for r in results:
        torch.testing.assert_close(r["ours"], r["plain"], rtol=1e-5, atol=1e-6)
        assert r["same"] and r["second_moment"] == "local"


@pytest.mark.parametrize("exchange,second_moment", [("allgather", "calibrated"), ("sparse_allreduce", "calibrated"),
                                                    ("allgather", "local"), ("allgather", "shared")])
def test_error_feedback_invariant_and_identical_parameters(exchange, second_moment):
    """Per step and compressed update: sum of the ranks' new residuals + P * applied == sum of (old residual +
    local update), the local update recomputed from each rank's Adam state (for "shared" the state holds the
    shared second moment, not Adam's keys: only the parameters are compared there)."""
    world_size = 2
    results = harness.run(update_workers.invariant, world_size, exchange, second_moment)
    assert all(r["same"] for r in results)
    assert all(r["second_moment"] == second_moment for r in results)
    if second_moment != "shared":
        assert check_update_invariant(results, world_size, steps=4) > 0
    stats = results[0]["stats"]
    assert stats["bytes_sent"] < stats["bytes_dense"] / 2 and stats["exchanges"].get(exchange, 0) > 0
    # each rank's own second moment, or for "shared" the same one on every rank
    assert all(r["own_same"] for r in results) == (second_moment == "shared")
    assert ("noise_share" in stats) == (second_moment == "calibrated")


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank():
    results = harness.run(update_workers.nonfinite, 2)
    assert "c.weight" in results[0]["nan_params"] and all(r["nan_params"] == results[0]["nan_params"] for r in results)
    for r in results:
        assert r["params_kept"] and r["residuals_kept"] and r["moments_kept"], r
        assert r["finite"] and r["moved"] and r["same"] and r["skipped"] == 1


def test_checkpoint_resumes_exactly():
    results = harness.run(update_workers.resume, 2)
    for r in results:
        assert torch.equal(r["straight"], r["resumed"]) and r["same"]
        assert r["names"] and all(name.startswith("update.") for name in r["names"])


def test_ranks_in_different_modes_raise_together_naming_the_target():
    update, gradient = dict(ratio=0.05, min_numel=64, target="update"), dict(ratio=0.05, min_numel=64, target="gradient")
    for message in harness.run(workers.mismatch, 2, update, gradient):
        assert "RankMismatch" in message and "target" in message, message


def test_the_default_target_picks_update_mode_for_adam_only():
    for r in harness.run(update_workers.default_target, 2):
        adamw, sgd = r["adamw"], r["sgd"]
        assert adamw["wrapped"] and adamw["target"] == "update" and adamw["same"]
        assert adamw["keys"] and all(k.startswith("update.") for k in adamw["keys"])
        assert not sgd["wrapped"] and sgd["target"] == "gradient" and sgd["same"]
        assert sgd["keys"] and not any(k.startswith("update.") for k in sgd["keys"])
        assert "before the first backward" in r["late"], r["late"]


def test_what_update_mode_cannot_do_is_refused_by_name():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="needs TopKEFState\\(target='update'\\)"):
        update_mode_optimizer(torch.optim.Adam(model.parameters()), TopKEFState(ratio=0.01, target="gradient"))
    # ratio="auto" goes with update mode too (the optimizer's step is its clock): target="auto" picks it for Adam
    adam = torch.optim.Adam(model.parameters())
    auto_state = TopKEFState(ratio="auto")
    assert update_mode_optimizer(adam, auto_state) is adam and auto_state.target == "update"
    assert hasattr(adam, "topk_update_step")
    # on a device with neither a host clock nor CUDA events its waits cannot be timed: refused by name
    with pytest.raises(ValueError, match="'meta' have neither"):
        wait_stamps.stamps_for(torch.device("meta"))
    state = TopKEFState(ratio=0.01, target="update", second_moment="calibrated")
    with pytest.raises(ValueError, match="second_moment='calibrated'.*SGD"):
        update_mode_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), state)
    with pytest.raises(ValueError, match="closure"):
        update_mode_optimizer(torch.optim.Adam(model.parameters()), TopKEFState(target="update")).step(lambda: 0.0)
