"""horovod-topk for PyTorch.

    import horovod.torch as hvd
    from horovod_topk.torch import TopKEF
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=TopKEF)

Importing this package installs the routing of :mod:`horovod_topk.torch.routing` (in memory, once per process).
Without Horovod installed at all there is nothing to route: the tensor math (ops, device_select, selection,
kernels) still imports, e.g. for benchmarks/bench_compress.py on a machine with torch alone.
"""
import importlib.util

from ..core import RankMismatch, TopKConfig
from .checkpoint import gather_state, register_elastic_handler, restore_state
from .compressor import TopKEF
from .routing import install as _install_routing

if importlib.util.find_spec("horovod") is not None:
    _install_routing()
    register_elastic_handler()

__all__ = ["TopKEF", "TopKConfig", "RankMismatch", "gather_state", "restore_state"]
