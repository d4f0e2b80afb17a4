#!/usr/bin/env python
"""Start one Horovod job across the test bed's hosts with Gloo, as ``horovodrun --gloo`` does between real hosts.

scripts/testbed.sh runs this inside the first host's namespace (``run N --gloo -- CMD``). Why a launcher of its own:
mpirun (the bed's default launch) makes Horovod negotiate and reduce over MPI, whose collectives poll a core while
they wait and, on 4 workers sharing 2 cores, took 1.4-1.7x Gloo's time for the same bytes at 100 Mbit/s
(benchmarks/bench_collectives.py); ``horovodrun --gloo`` (what the README's commands use) needs ssh to each host.
So this does what horovodrun's Gloo launch does
(horovod/runner/gloo_run.py): a rendezvous server on this host, the slot plan of one worker per host, each worker's
HOROVOD_* variables, and each worker started in its host's namespace with ``ip netns exec`` instead of ssh.

    python scripts/testbed_gloo.py N PREFIX SUBNET -- CMD...

Output lines are tagged ``[1,RANK]<stdout>:`` / ``<stderr>:`` as mpirun's --tag-output does. When one worker fails
the others are stopped (they would otherwise wait in a collective until Horovod's stall shutdown), and the exit
status is the first failure's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import IO, List


def relay(stream: IO[str], tag: str, out: IO[str], lock: threading.Lock) -> None:
    """Copy a worker's stream line by line with its tag (one writer at a time, so lines never interleave)."""
    for line in stream:
        with lock:
            out.write(f"{tag}{line}")
            out.flush()


def main(argv: List[str]) -> int:
    if "--" not in argv or argv.index("--") != 3:
        sys.exit("usage: testbed_gloo.py N PREFIX SUBNET -- CMD...")
    n, prefix, subnet = int(argv[0]), argv[1], argv[2]
    command = argv[4:]
    if not command:
        sys.exit("testbed_gloo.py: no command to run")
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    plan = get_host_assignments(parse_hosts(",".join(f"{subnet}.{i}:1" for i in range(1, n + 1))), n)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    shared = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": f"{subnet}.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",  # torch.distributed's Gloo, for scripts that also open a process group
    }
    workers = []
    lock = threading.Lock()
    relays = []
    for slot in plan:
        env = dict(os.environ, **shared,
                   HOROVOD_HOSTNAME=slot.hostname, HOROVOD_RANK=str(slot.rank), HOROVOD_SIZE=str(slot.size),
                   HOROVOD_LOCAL_RANK=str(slot.local_rank), HOROVOD_LOCAL_SIZE=str(slot.local_size),
                   HOROVOD_CROSS_RANK=str(slot.cross_rank), HOROVOD_CROSS_SIZE=str(slot.cross_size))
        host = slot.hostname.rsplit(".", 1)[1]
        proc = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-h{host}", *command], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        workers.append(proc)
        for stream, name, out in ((proc.stdout, "stdout", sys.stdout), (proc.stderr, "stderr", sys.stderr)):
            thread = threading.Thread(target=relay, args=(stream, f"[1,{slot.rank}]<{name}>:", out, lock),
                                      daemon=True)
            thread.start()
            relays.append(thread)
    status = 0
    running = list(workers)
    while running:
        for proc in list(running):
            code = proc.poll()
            if code is None:
                continue
            running.remove(proc)
            if code != 0 and status == 0:
                status = code
                for other in running:
                    other.terminate()
        time.sleep(0.1)
    for thread in relays:
        thread.join(timeout=5)
    server.stop()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
