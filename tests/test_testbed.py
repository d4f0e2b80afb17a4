"""Two Horovod workers on two network namespaces joined by a shaped link (scripts/testbed.sh), training TopKEF."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the test bed needs root and iproute2 (scripts/testbed.sh says why when run)",
)


@pytest.mark.parametrize("launch", [[], ["--gloo"]], ids=["mpi", "gloo"])
def test_two_hosts_train_topkef_across_a_shaped_link(launch):
    """Started by mpirun (Horovod over MPI) or by scripts/testbed_gloo.py (over Gloo, as horovodrun --gloo)."""
    result = subprocess.run(
        [str(ROOT / "scripts" / "testbed.sh"), "run", "2", "--rate", "100mbit", *launch, "--",
         "python", str(ROOT / "tests" / "testbed_job.py")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        # os.environ explicitly: this pytest process may have initialised MPI (single-rank Horovod tests), whose
        # C-level environment variables would make mpirun believe it runs inside another MPI job
        env=dict(os.environ),
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    reports = re.findall(r"TESTBED rank=(\d) size=(\d) steps=(\d+) bytes_sent=(\d+) bytes_dense=(\d+) "
                         r"max_param_spread=([-+.0-9eE]+)", out)
    assert sorted(r[0] for r in reports) == ["0", "1"], out
    for rank, size, steps, sent, dense, spread in reports:
        assert size == "2" and steps == "5"
        assert int(sent) < int(dense) / 5
        assert float(spread) == 0.0, "every rank must hold identical parameters"
    links = dict(re.findall(r"host(\d) tx_bytes=(\d+)", out))
    assert set(links) == {"1", "2"} and all(int(b) > 10_000 for b in links.values()), out
    if launch:
        assert "TESTBED controller=gloo" in out, out
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "topk-" not in listed, "the test bed must remove its namespaces"
    assert not list(Path("/etc/netns").glob("topk-*")), "the test bed must remove its hosts' files"
