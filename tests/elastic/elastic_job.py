"""A Horovod elastic training job with TopKEF in its TorchState (launched by test_elastic.py).

It starts on one host; at step JOIN_STEP it adds a second host to the discovery file (a worker joins); at
KILL_STEP the worker on the added host dies abruptly (os._exit) once, between two commits (every COMMIT_EVERY
steps), so the job rolls back and goes on with one worker. Every rank appends one JSON line per step to the log
(and at each start and reset): world size, step counters, residual norms, parameter checksum. The exchange of
compressed tensors comes from ELASTIC_JOB_EXCHANGE (default "auto"; "update": update mode with AdamW and the shared
second moment; "update-calibrated": with the calibrated one).
"""
import json
import os
import sys
import time

import horovod.torch as hvd
import torch
from torch import nn

from horovod_topk.torch import TopKEF

JOIN_STEP, KILL_STEP, LAST_STEP, MAX_STEPS, STEP_SECONDS, COMMIT_EVERY = 5, 100, 140, 400, 0.25, 5
hosts_file, log_file, added_host = sys.argv[1:4]

hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
# "update": update mode with AdamW (shared second moment in the optimizer's state, first moments with the residuals);
# "update-calibrated": each rank's own Adam state in the optimizer (a joining worker gets rank 0's through the sync)
MODE = os.environ.get("ELASTIC_JOB_EXCHANGE", "auto")
if MODE.startswith("update"):
    compressor = TopKEF(ratio=0.02, target="update",
                        second_moment="calibrated" if MODE == "update-calibrated" else "shared")
    base = torch.optim.AdamW(model.parameters(), lr=0.01)
else:
    compressor = TopKEF(ratio=0.02, exchange=MODE)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compressor)
state = hvd.elastic.TorchState(model=model, optimizer=opt, compression=compressor, step=0)


def log(event: str) -> None:
    records = dict(compressor.registry)
    line = {
        "event": event, "rank": hvd.rank(), "size": hvd.size(), "host": os.environ.get("HOROVOD_HOSTNAME"),
        "step": state.step,
        "steps": {n: r.steps for n, r in records.items()},
        "world": {n: r.world_size for n, r in records.items()},
        "residual_sq": {n: float(r.residual.double().pow(2).sum()) for n, r in records.items() if r.residual is not None},
        "params": float(sum(p.double().sum() for p in model.parameters())),
        "exchanges": compressor.stats()["exchanges"],
    }
    with open(log_file, "a") as f:
        f.write(json.dumps(line) + "\n")


state.register_reset_callbacks([lambda: log("reset")])


@hvd.elastic.run
def train(state):
    log("start")  # after Horovod's sync of the state: what a new worker received
    # run at least to LAST_STEP, and on (up to MAX_STEPS) until the kill has happened: on a slow machine the
    # second worker may take long to start
    while state.step < LAST_STEP or (not os.path.exists(hosts_file + ".killed") and state.step < MAX_STEPS):
        gen = torch.Generator().manual_seed(1000 * hvd.rank() + state.step)
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        log("step")
        time.sleep(STEP_SECONDS)  # leave the elastic driver time to see the new host and start its worker
        if state.step == JOIN_STEP and hvd.size() == 1 and not os.path.exists(hosts_file + ".joined"):
            open(hosts_file + ".joined", "w").close()
            with open(hosts_file, "a") as f:
                f.write(f"{added_host}:1\n")
        if state.step >= KILL_STEP and state.step % COMMIT_EVERY == 3 and hvd.size() == 2 \
                and os.environ.get("HOROVOD_HOSTNAME") == added_host and not os.path.exists(hosts_file + ".killed"):
            open(hosts_file + ".killed", "w").close()
            os._exit(1)  # between two commits: the survivor must roll back three steps
        if state.step % COMMIT_EVERY == 0:
            state.commit()


train(state)
log("done")
