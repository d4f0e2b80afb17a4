"""What a DDP worker on a GPU runs (tests/ddp/test_ddp_cuda.py): the same training on the CPU (a Gloo group) and on
the GPU (NCCL), in one process, so the device path's results are checked against the CPU path's."""
# no "from __future__ import annotations": DDP checks a hook's annotations as objects

import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_topk.torch.ddp import TopKEFState, topk_ef_hook, update_mode_optimizer

from .workers import batch, flat_params, make_model


def _train(device: str, group: Any, options: Dict[str, Any], steps: int, optimizer: str) -> Dict[str, Any]:
    model = make_model().to(device)
    state = TopKEFState(named_parameters=model.named_parameters(), process_group=group, **options)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.3)
    ddp.register_comm_hook(state, topk_ef_hook)
    opt = torch.optim.Adam(model.parameters(), 1e-2) if optimizer == "adam" else \
        torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    if state.target == "update":
        opt = update_mode_optimizer(opt, state)
    syncs = -1
    for step in range(steps):
        x, y = (t.to(device) for t in batch(0, step))  # copied before the count: a pageable copy waits
        last = device == "cuda" and step == steps - 1
        if last:  # the host waits counted in the last whole step (zero_grad, forward, backward, hook, step)
            torch.cuda.synchronize()
            caught = warnings.catch_warnings(record=True)
            log = caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if last:
            torch.cuda.set_sync_debug_mode(0)
            caught.__exit__(None, None, None)
            torch.cuda.synchronize()
            syncs = sum("called a synchronizing" in str(w.message) for w in log)
    residuals = {name: record.residual.detach().cpu().clone() for name, record in state.registry
                 if record.residual is not None}
    return {"params": flat_params(model).cpu(), "residuals": residuals, "syncs": syncs,
            "bytes_sent": state.stats()["bytes_sent"]}


def cuda_against_cpu(rank: int, world_size: int, options: Dict[str, Any], steps: int,
                     optimizer: str) -> Dict[str, Any]:
    """``steps`` steps of ``optimizer`` ("adam" or "sgd": with momentum) through the hook with ``options`` on the CPU (a Gloo group beside the NCCL one) and on
    cuda:``rank``, from the same model and batches; TF32 off so that both compute in float32."""
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gloo = dist.new_group(backend="gloo")
    return {"cpu": _train("cpu", gloo, options, steps, optimizer),
            "cuda": _train("cuda", None, options, steps, optimizer)}
