"""Probe (run 1): can a DDP comm hook record selection-like work, an NCCL allgather and allreduce and an adding back
as one CUDA graph in autograd's device thread, replay it, and return an already-completed CUDA future? One process,
NCCL. Then the host time of launching that work eagerly against replaying it.

    python docs/gpu-runs/2026-11-27-bucket-graphs/probe_nccl_graph.py
"""
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
dev = torch.device("cuda", 0)
print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), flush=True)

model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)).to(dev)
ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.1)
graphs = {}
calls = {"n": 0, "replays": 0}


def work(buf, out):
    x = buf * 2.0  # "selection"
    dist.all_gather_into_tensor(out, x, async_op=True).wait()
    d = buf[:16] * 0.5
    dist.all_reduce(d, async_op=True).wait()
    buf.copy_(out * 0.5)  # "adding back"
    buf[:16].copy_(d * 2.0)


def hook(state, bucket):
    buf = bucket.buffer()
    calls["n"] += 1
    out = state.setdefault(("out", bucket.index(), buf.numel()), torch.empty_like(buf))
    key = (bucket.index(), buf.data_ptr())
    g = graphs.get(key)
    if g is None and calls["n"] > 4:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            work(buf, out)
        graphs[key] = g
        print("recorded", key, flush=True)
    if g is not None:
        g.replay()
        calls["replays"] += 1
    else:
        work(buf, out)
    fut = torch.futures.Future(devices=[dev])
    fut.set_result(buf)
    return fut


ddp.register_comm_hook({}, hook)
ref = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)).to(dev)
ref.load_state_dict(model.state_dict())
ok = True
for step in range(10):
    x = torch.randn(32, 256, device=dev) * (step + 1)
    ddp.zero_grad(); ref.zero_grad()
    ddp(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.cuda.synchronize()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5):
            ok = False
            print("MISMATCH step", step, n, (p.grad - q.grad).abs().max().item(), flush=True)
print("probe: replays", calls["replays"], "graphs", len(graphs), "ok", ok, flush=True)

buf = torch.randn(1 << 20, device=dev); out = torch.empty_like(buf)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    work(buf, out)
for name, fn in (("eager", lambda: work(buf, out)), ("graph", g.replay)):
    for _ in range(5):
        fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200):
        fn()
    host = (time.perf_counter() - t) / 200 * 1e3
    torch.cuda.synchronize(); tot = (time.perf_counter() - t) / 200 * 1e3
    print(f"probe: {name}: host {host:.3f} ms per call, with device {tot:.3f} ms", flush=True)
dist.destroy_process_group()
