"""Horovod elastic with TopKEF in the TorchState: a worker joins, then one is killed mid-run (horovodrun --gloo in
elastic mode on this machine: two host names for the same machine, a discovery script reading a file)."""
from collections import defaultdict

import pytest

from .launch import run_elastic_job


@pytest.fixture(scope="module", params=["auto", "sparse_allreduce", "update", "update-calibrated"])
def events(request, tmp_path_factory):
    """The same job with each exchange: "auto" (the allgather at these sizes) and the sparse allreduce forced; and
    in update mode (AdamW, the allgather), with the shared and the calibrated second moment."""
    events = run_elastic_job("elastic_job.py", tmp_path_factory.mktemp("elastic"), timeout=300,
                             env={"ELASTIC_JOB_EXCHANGE": request.param})
    on_two = [e["exchanges"] for e in events if e["event"] == "step" and e["size"] == 2]
    expected = request.param if request.param == "sparse_allreduce" else "allgather"
    assert on_two and all(set(x) == {expected} for x in on_two)
    return events


def first_layer(events) -> str:
    """The first layer's record name: its parameter name, or its update's in update mode."""
    names = next(e["world"] for e in events if e["event"] == "step")
    return "update.0.weight" if "update.0.weight" in names else "0.weight"


def test_the_job_survives_a_join_and_a_killed_worker(events):
    sizes = [e["size"] for e in events if e["rank"] == 0 and e["event"] == "step"]
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1
    assert sizes[sizes.index(2):].count(1) > 0  # back to one worker after the kill
    assert events[-1]["event"] == "done" and 140 <= events[-1]["step"] < 400
    # on two workers both ranks applied identical updates, step after step
    params = defaultdict(dict)
    for e in events:
        if e["event"] == "step" and e["size"] == 2:
            params[e["step"]][e["rank"]] = e["params"]
    both = [p for p in params.values() if len(p) == 2]
    assert len(both) > 20 and all(p[0] == p[1] for p in both)


def test_the_new_worker_adopts_the_step_counters_and_residuals_follow_the_world_size(events):
    (start,) = [e for e in events if e["rank"] == 1 and e["event"] == "start"]
    assert start["residual_sq"] == {}, "a new worker starts without residuals (never a copy of another rank's)"
    assert start["steps"] and all(steps == start["step"] for steps in start["steps"].values())
    joined = [e for e in events if e["rank"] == 1 and e["event"] == "step"]
    first = joined[0]
    # its counters continue the survivors' (no cross-rank mismatch on its first step)
    assert all(steps == first["step"] for steps in first["steps"].values())
    assert first["world"][first_layer(events)] == 2
    survivor = [e for e in events if e["rank"] == 0 and e["event"] == "step"]
    worlds = [e["world"][first_layer(events)] for e in survivor]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1


def test_after_the_kill_model_optimizer_and_residuals_come_back_from_the_same_commit(events):
    resets = [e for e in events if e["event"] == "reset" and e["size"] == 1]
    assert resets, "no reset after the killed worker"
    reset = resets[-1]
    last_step = max(e["step"] for e in events if e["rank"] == 0 and e["event"] == "step" and e["size"] == 2)
    assert reset["step"] % 5 == 0 and reset["step"] < last_step, "rolled back to the last commit"
    committed = [e for e in events if e["rank"] == 0 and e["event"] == "step" and e["step"] == reset["step"]
                 and e["size"] == 2][-1]
    assert reset["params"] == committed["params"]
    assert reset["residual_sq"] == committed["residual_sq"]
    assert all(steps == reset["step"] for steps in reset["steps"].values())
