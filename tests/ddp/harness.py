"""Real torch.distributed workers for the DDP hook's tests: P processes (spawned, Gloo on CPU, loopback), each
running one function of tests/ddp/workers.py; what each returns comes back to the test, and a worker that fails or
hangs fails the test instead of the suite."""
from __future__ import annotations

import faulthandler
import gc
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: A hung collective becomes a failure well inside the suite's time.
TIMEOUT_SECONDS = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple,
           backend: str = "gloo") -> None:
    faulthandler.enable(all_threads=True)  # a worker that aborts in C++ prints where every thread was
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        finished = True
    except BaseException:
        finished = False
        raise
    finally:
        # A worker whose backward() raised (a RankMismatch from the hook) leaves its DDP reducer in a reference
        # cycle with the exception, and the reducer holds the process group: collected only at interpreter exit,
        # where a Gloo thread that still has to release a finished collective's tensor cannot take the GIL and
        # aborts the process (seen ~1 run in 25). Collected here, the group ends in destroy_process_group, which
        # joins its threads while the interpreter is alive.
        gc.collect()
        dist.destroy_process_group()
    if finished:
        # The group's Gloo threads outlive destroy_process_group while anything still holds the group, and one
        # may be releasing a finished collective's tensors; such a release takes the GIL, and during interpreter
        # finalization a thread that asks for the GIL is ended inside C++, which aborts the process (a core dump
        # showed ~AsyncAllreduceWork freeing its output there, ~1 run in 30). The result is on disk: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` real workers (Gloo unless ``backend`` names another;
    NCCL needs a GPU per worker); their return values in rank order. A worker's exception is re-raised here with
    its traceback."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_entry, args=(world_size, _free_port(), out_dir, fn, args, backend),
                                     nprocs=world_size,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"DDP workers still running after {TIMEOUT_SECONDS} s (a hang)")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
