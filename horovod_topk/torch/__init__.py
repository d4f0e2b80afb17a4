"""horovod-topk for PyTorch.

    import horovod.torch as hvd
    from horovod_topk.torch import TopKEF
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=TopKEF)

or, with PyTorch DDP and no Horovod at all (:mod:`horovod_topk.torch.ddp`):

    from horovod_topk.torch.ddp import TopKEFState, topk_ef_hook
    ddp_model.register_comm_hook(TopKEFState(ratio=0.01), topk_ef_hook)

Taking ``TopKEF``, ``gather_state`` or ``restore_state`` from this package installs the routing of
:mod:`horovod_topk.torch.routing` into Horovod (in memory, once per process) and the elastic handler; so does
importing the package where ``horovod.torch`` is loaded already, so that ``hvd.DistributedOptimizer(...,
compression=horovod_topk.torch.TopKEF(...))`` -- Horovod's function looked up before TopKEF is -- is the routed one.
Nothing else here touches Horovod: importing the package without Horovod loaded, its tensor math (ops,
device_select, selection, kernels) or the DDP hook never imports Horovod, so a DDP user needs torch alone, and
benchmarks/bench_compress.py runs without it.
"""
import importlib
import importlib.util
import sys
from typing import Any

from ..core import RankMismatch, TopKConfig

#: What is looked up lazily, and in which module: the Horovod front end.
_HOROVOD_FRONT_END = {"TopKEF": "compressor", "gather_state": "checkpoint", "restore_state": "checkpoint"}


def _install_into_horovod() -> None:
    """Route TopKEF's marked gradients inside Horovod's optimizer and teach Horovod elastic about TopKEF (once)."""
    if importlib.util.find_spec("horovod") is None:
        return
    from .checkpoint import register_elastic_handler
    from .routing import install

    install()
    register_elastic_handler()


def __getattr__(name: str) -> Any:
    module = _HOROVOD_FRONT_END.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _install_into_horovod()
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["TopKEF", "TopKConfig", "RankMismatch", "gather_state", "restore_state"]

if "horovod.torch" in sys.modules:  # Horovod is loaded: route it now, before any attribute of ours is looked up
    _install_into_horovod()
