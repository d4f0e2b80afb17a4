"""Save and restore the error-feedback state of *all* ranks in one checkpoint (PyTorch).

    state = gather_state(compressor)                 # every rank calls it; a dict on rank 0, None elsewhere
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "topk": state}, path)
    ...
    ckpt = torch.load(path) if hvd.rank() == 0 else None
    restore_state(compressor, ckpt["topk"] if ckpt else None)   # every rank calls it

The policy (exact on the same number of workers, mass-preserving on another) is in horovod_topk.core.checkpoint.
Residuals travel with Horovod's alltoall, which only the root receives into: no rank but the root ever holds more
than its own copy. Uses the global process set.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch

from ..core import checkpoint as core

__all__ = ["gather_state", "restore_state", "ElasticStateHandler", "register_elastic_handler", "TorchTensors"]


class TorchTensors:
    """The tensor-side parts of a core.checkpoint Transport that do not depend on the collectives (shared by the
    Horovod transport here and the DDP hook's torch.distributed one)."""

    def describe(self, value: torch.Tensor) -> Dict[str, Any]:
        return {"numel": int(value.numel()), "dtype": str(value.dtype).replace("torch.", "")}

    def mean(self, values: List[torch.Tensor], factor: float) -> torch.Tensor:
        total = torch.zeros(values[0].numel(), dtype=torch.float64)
        for v in values:
            total += v.reshape(-1).double()
        return (total * (factor / len(values))).to(values[0].dtype)


class _TorchTransport(TorchTensors, core.ObjectCollectives):
    def __init__(self) -> None:
        import horovod.torch as hvd

        super().__init__(hvd)

    def _splits(self, counts: Dict[int, int]) -> torch.Tensor:
        return torch.tensor([counts.get(r, 0) for r in range(self.size)], dtype=torch.int32)

    def gather(self, value: torch.Tensor, root: int, key: str) -> Optional[List[torch.Tensor]]:
        flat = value.reshape(-1).contiguous()
        received, _ = self.hvd.alltoall(flat, splits=self._splits({root: flat.numel()}), name=f"topk.ckpt.g.{key}")
        return list(received.view(self.size, -1).clone()) if self.rank == root else None

    def scatter(self, values: Optional[List[torch.Tensor]], root: int, key: str, like: Mapping[str, Any]) -> torch.Tensor:
        dtype = getattr(torch, like["dtype"])
        if self.rank == root:
            assert values is not None
            send = torch.cat([v.reshape(-1).to(dtype) for v in values])
            splits = self._splits({r: int(v.numel()) for r, v in enumerate(values)})
        else:
            send, splits = torch.empty(0, dtype=dtype), self._splits({})
        received, _ = self.hvd.alltoall(send, splits=splits, name=f"topk.ckpt.s.{key}")
        return received.clone()

    def broadcast(self, value: Optional[torch.Tensor], root: int, key: str, like: Mapping[str, Any]) -> torch.Tensor:
        dtype = getattr(torch, like["dtype"])
        tensor = value.reshape(-1).to(dtype) if value is not None else torch.empty(like["numel"], dtype=dtype)
        return self.hvd.broadcast(tensor, root_rank=root, name=f"topk.ckpt.b.{key}")


def gather_state(compressor: Any, root_rank: int = 0) -> Optional[Dict[str, Any]]:
    """Collective: all ranks' TopKEF state in one dict on ``root_rank`` (None on the others); ``torch.save`` it
    next to the model and optimizer. ``compressor`` is the TopKEF object (or class) given to the optimizer."""
    return core.gather_state(core.resolve_compressor(compressor), _TorchTransport(), root_rank)


def restore_state(
    compressor: Any, checkpoint: Optional[Mapping[str, Any]], root_rank: int = 0, reduction: str = "average"
) -> None:
    """Collective: give every rank its share of a :func:`gather_state` checkpoint held by ``root_rank`` (other
    ranks may pass None). On a different number of workers the residual mass owed to the model is preserved:
    ``reduction`` is the optimizer's op, "average" (Horovod's default) or "sum"."""
    core.restore_state(core.resolve_compressor(compressor), checkpoint, _TorchTransport(), root_rank, reduction)


class ElasticStateHandler(core.ElasticCompressorState):
    """Horovod elastic handler for a TopKEF object given to ``hvd.elastic.TorchState(..., compression=topk)``.

    commit (save): keep a copy of this rank's state; restore (after a failure): load that copy back, matching the
    model and optimizer, which Horovod rolls back to the same commit; sync (after a reset): adopt the step counters
    of a rank that has state (a new worker has none). The semantics are core's ElasticCompressorState (shared with
    TensorFlow); PyTorch needs no rescale at sync: each rank rescales its own residual when it first sees the new
    world size (policy.residual_world_factor), because nothing here is traced for a fixed world size.
    """

    def __init__(self, compressor: Any) -> None:
        super().__init__(compressor, _TorchTransport)

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


def register_elastic_handler() -> None:
    """Teach ``hvd.elastic.TorchState`` to treat TopKEF objects with :class:`ElasticStateHandler` (idempotent;
    done when horovod_topk.torch is imported)."""
    from horovod.torch.elastic import state as elastic_state

    from .compressor import TopKEF

    registry = elastic_state.get_handler_registry()
    if not any(cls is ElasticStateHandler for _, cls in registry):
        elastic_state.set_handler_registry([(TopKEF, ElasticStateHandler), *registry])
