"""Horovod elastic with the TensorFlow TopKEF tracked by a TensorFlowKerasState: a worker joins, then one is killed
mid-run (horovodrun --gloo in elastic mode on this machine, as test_elastic.py)."""
from collections import defaultdict

import pytest

from .launch import run_elastic_job


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    return run_elastic_job("elastic_job_tf.py", tmp_path_factory.mktemp("elastic_tf"), timeout=400)


def test_the_job_survives_a_join_and_a_killed_worker_with_identical_updates(events):
    sizes = [e["size"] for e in events if e["rank"] == 0 and e["event"] == "step"]
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1
    assert events[-1]["event"] == "done" and events[-1]["step"] >= 70
    params = defaultdict(dict)
    for e in events:
        if e["event"] == "step" and e["size"] == 2:
            params[e["step"]][e["rank"]] = e["params"]
    both = [p for p in params.values() if len(p) == 2]
    assert len(both) > 10 and all(p[0] == p[1] for p in both)


def test_the_new_worker_starts_without_residuals_and_with_the_survivors_counters(events):
    (start,) = [e for e in events if e["rank"] == 1 and e["event"] == "start"]
    assert start["residual_sq"] == {}
    first = [e for e in events if e["rank"] == 1 and e["event"] == "step"][0]
    survivor = [e for e in events if e["rank"] == 0 and e["event"] == "step" and e["step"] == first["step"]]
    assert first["steps"] and (not survivor or first["steps"] == survivor[-1]["steps"])
    assert set(first["world"].values()) == {2}


def test_after_the_kill_residuals_come_back_from_the_commit_rescaled_to_one_worker(events):
    reset = [e for e in events if e["event"] == "reset" and e["size"] == 1][-1]
    restart = [e for e in events if e["event"] == "start" and e["rank"] == 0 and e["size"] == 1][-1]
    committed = [e for e in events if e["rank"] == 0 and e["event"] == "step" and e["size"] == 2
                 and e["step"] == restart["step"]][-1]
    last_step = max(e["step"] for e in events if e["rank"] == 0 and e["event"] == "step" and e["size"] == 2)
    assert restart["step"] % 5 == 0 and restart["step"] < last_step, "rolled back to the last commit"
    assert reset["params"] == committed["params"] == restart["params"]
    assert restart["steps"] == committed["steps"] and set(restart["world"].values()) == {1}
    assert committed["residual_sq"] and all(v > 0 for v in committed["residual_sq"].values())
    for name, squared in committed["residual_sq"].items():  # Average: P'/P = 1/2, so a quarter of the square
        assert restart["residual_sq"][name] == pytest.approx(squared / 4, rel=1e-5)
