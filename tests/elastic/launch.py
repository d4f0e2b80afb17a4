"""Runs one of this folder's elastic jobs under `horovodrun --gloo` in elastic mode on this machine (one slot to
start with, at most two, a discovery script reading a hosts file that the job itself edits) and returns the events
it logged, one JSON object per line."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def run_elastic_job(job: str, workdir: Path, timeout: int, env: Optional[Dict[str, str]] = None) -> List[dict]:
    hosts, log = workdir / "hosts", workdir / "log.jsonl"
    hosts.write_text("localhost:1\n")
    discover = workdir / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    result = subprocess.run(
        [horovodrun, "-np", "1", "--min-np", "1", "--max-np", "2", "--network-interfaces", "lo",
         "--host-discovery-script", str(discover), "--gloo",
         sys.executable, os.path.join(HERE, job), str(hosts), str(log), "127.0.0.1"],
        capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(os.path.dirname(HERE)),
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]
