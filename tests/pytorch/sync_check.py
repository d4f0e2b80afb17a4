"""Which aten ops a piece of torch code calls: the CPU stand-in for torch.cuda.set_sync_debug_mode("error")."""
from typing import Callable, List

from torch.utils._python_dispatch import TorchDispatchMode

# What would make the host wait for a GPU: reading a value (item/bool/int/float), an output whose size depends on
# the data, or a tensor built from host data (torch.tensor: a synchronous copy to the device).
SYNCING_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero.default", "masked_select", "unique", "lift_fresh",
               "repeat_interleave", "bincount", "item")


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def recorded_ops(run: Callable[[], object]) -> List[str]:
    """Every aten op ``run`` calls, in order."""
    with _Record() as record:
        run()
    return record.ops


def syncing(ops: List[str]) -> List[str]:
    return [op for op in ops if any(bad in op for bad in SYNCING_OPS)]
