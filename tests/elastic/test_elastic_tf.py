"""Horovod elastic with the TensorFlow TopKEF tracked by a TensorFlowKerasState: a worker joins, then one is killed
mid-run (horovodrun --gloo in elastic mode on this machine, as test_elastic.py)."""
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic_tf")
    hosts, log = d / "hosts", d / "log.jsonl"
    hosts.write_text("localhost:1\n")
    discover = d / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    result = subprocess.run(
        [horovodrun, "-np", "1", "--min-np", "1", "--max-np", "2", "--network-interfaces", "lo",
         "--host-discovery-script", str(discover), "--gloo",
         sys.executable, os.path.join(HERE, "elastic_job_tf.py"), str(hosts), str(log), "127.0.0.1"],
        capture_output=True, text=True, timeout=400, cwd=os.path.dirname(os.path.dirname(HERE)),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


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
