"""What a DDP worker on a GPU runs (tests/ddp/test_ddp_cuda.py): the same training on the CPU (a Gloo group) and on
the GPU (NCCL), in one process, so the device path's results are checked against the CPU path's."""
# no "from __future__ import annotations": DDP checks a hook's annotations as objects

import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_topk.torch import wait_stamps
from horovod_topk.torch.ddp import TopKEFState, topk_ef_hook, update_mode_optimizer

from .workers import batch, flat_params, make_model


def _step(ddp: DDP, opt: Any, x: torch.Tensor, y: torch.Tensor, count_waits: bool) -> int:
    """One whole step (zero_grad, forward, backward and the hook, the optimizer's step); with ``count_waits``, the
    host waits it took (torch's sync debug mode, which does not count an event's synchronisation), else -1."""
    if count_waits:
        torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if count_waits:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        finally:
            if count_waits:
                torch.cuda.set_sync_debug_mode(0)
    if not count_waits:
        return -1
    torch.cuda.synchronize()
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _train(device: str, group: Any, options: Dict[str, Any], steps: int, optimizer: str) -> Dict[str, Any]:
    model = make_model().to(device)
    options = dict(options)
    hold = options.pop("hold", None)
    state = TopKEFState(named_parameters=model.named_parameters(), process_group=group, **options)
    if hold is not None:  # ratio="auto" held at one choice (no decision ever due)
        state.auto.half, state.auto.ratio, state.auto.next_decision = True, hold, 1 << 62
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.3)
    ddp.register_comm_hook(state, topk_ef_hook)
    opt = torch.optim.Adam(model.parameters(), 1e-2) if optimizer == "adam" else \
        torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    if state.target == "update":
        opt = update_mode_optimizer(opt, state)
    for step in range(steps):
        x, y = (t.to(device) for t in batch(0, step))  # copied before the count: a pageable copy waits
        syncs = _step(ddp, opt, x, y, count_waits=device == "cuda" and step == steps - 1)  # the last step's
    residuals = {name: record.residual.detach().cpu().clone() for name, record in state.registry
                 if record.residual is not None}
    return {"params": flat_params(model).cpu(), "residuals": residuals, "syncs": syncs,
            "bytes_sent": state.stats()["bytes_sent"]}


def cuda_against_cpu(rank: int, world_size: int, options: Dict[str, Any], steps: int,
                     optimizer: str) -> Dict[str, Any]:
    """``steps`` steps of ``optimizer`` ("adam" or "sgd": with momentum) through the hook with ``options`` on the
    CPU (a Gloo group beside the NCCL one) and on cuda:``rank``, from the same model and batches; TF32 off so that
    both compute in float32."""
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gloo = dist.new_group(backend="gloo")
    return {"cpu": _train("cpu", gloo, options, steps, optimizer),
            "cuda": _train("cuda", None, options, steps, optimizer)}


def cuda_auto(rank: int, world_size: int, target: str, steps: int) -> Dict[str, Any]:
    """``steps`` Adam steps through the hook with ratio="auto" on cuda:``rank``: per step, the host waits it took
    (:func:`_step`), whether its wait counted toward a decision,
    and the decisions taken so far; and each reading of the CUDA events (the step it closed, the wait read)."""
    torch.cuda.set_device(rank)
    model = make_model().to("cuda")
    state = TopKEFState(named_parameters=model.named_parameters(), ratio="auto", auto_every=20, target=target)
    reads = []
    read = wait_stamps.CudaStamps.seconds

    def logged(stamps: wait_stamps.CudaStamps):
        value = read(stamps)
        reads.append((state.auto.step, value))
        return value

    wait_stamps.CudaStamps.seconds = logged
    ddp = DDP(model, bucket_cap_mb=0.3)
    ddp.register_comm_hook(state, topk_ef_hook)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    if state.target == "update":
        opt = update_mode_optimizer(opt, state)
    log = []
    for step in range(steps):
        x, y = (t.to("cuda") for t in batch(0, step))
        log.append({"syncs": _step(ddp, opt, x, y, count_waits=True),
                    "counted": state.auto.wait_counts(), "decisions": state.auto.decisions})
    return {"log": log, "reads": reads, "auto": state.auto.stats(), "samples": list(state.auto._samples),
            "params": flat_params(model).cpu()}


def cuda_whole_bucket_graphs(rank: int, world_size: int, steps: int, load_at: int) -> Dict[str, Any]:
    """The same Adam training on cuda:``rank`` twice: each steady bucket's whole step replayed as one CUDA graph
    (HOROVOD_TOPK_CUDA_GRAPHS=bucket, torch.bucket_graph) with its side stream held back before each bucket, then
    the usual path (graphs off); a checkpoint loaded into the same state at step ``load_at``. Parameters, residuals, counters, whole steps replayed, and the host waits
    of the last step."""
    import os

    from horovod_topk.torch import group_graphs

    from horovod_topk.torch import bucket_graph

    torch.cuda.set_device(rank)
    results = {}
    original_step = bucket_graph.BucketGraph.step

    def late_step(self, *args):
        # the side stream is current here: ~20 ms of spinning before the bucket's work makes any read of its results
        # that is not ordered after the side stream (DDP's copy into .grad, the next bucket, the optimizer) see stale
        # values
        torch.cuda._sleep(40_000_000)
        return original_step(self, *args)

    for mode in ("bucket", "0"):
        os.environ[group_graphs.ENV] = mode
        bucket_graph.BucketGraph.step = late_step if mode == "bucket" else original_step
        model = make_model().to("cuda")
        state = TopKEFState(ratio=0.05, min_numel=64, named_parameters=model.named_parameters())
        ddp = DDP(model, bucket_cap_mb=0.3)
        ddp.register_comm_hook(state, topk_ef_hook)
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        for step in range(steps):
            if step == load_at:
                state.load_state_dict(state.state_dict())
            x, y = (t.to("cuda") for t in batch(rank, step))
            syncs = _step(ddp, opt, x, y, count_waits=step == steps - 1)
        torch.cuda.synchronize()
        wholes = [entry[5]["steady"].whole for entry in state._layouts.values() if entry[5].get("steady") is not None]
        results[mode] = {
            "params": flat_params(model).cpu(), "syncs": syncs,
            "residuals": {n: r.residual.detach().cpu().clone() for n, r in state.registry if r.residual is not None},
            "counters": {n: (r.steps, r.bytes_sent, r.bytes_dense, int(r.nonfinite_steps)) for n, r in state.registry},
            "replays": sum(w.graphs.replays for w in wholes if w is not None),
            "buckets": state.stats()["buckets"]}
    os.environ.pop(group_graphs.ENV, None)
    bucket_graph.BucketGraph.step = original_step
    return {"whole": results["bucket"], "usual": results["0"]}
