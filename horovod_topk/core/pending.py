"""The hand-off between ``compress`` and the routed collective, shared by both frameworks.

Horovod calls ``compress(tensor)`` without a name and hands the result to its dense allreduce. ``compress`` marks
a storage-sharing alias of the gradient with a :class:`PendingReduction`; the routing (one module per framework)
recognises the mark where the collective is launched and the name is known. Both torch tensors and TensorFlow
tensors (eager and symbolic) accept a Python attribute, so one mechanism serves both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

__all__ = ["PendingReduction", "PENDING_ATTR", "mark", "pending_of", "reduction_scale", "refuse_unsupported_op"]

#: The attribute that carries the mark.
PENDING_ATTR = "_horovod_topk_pending"


@dataclass
class PendingReduction:
    """The ``ctx`` of one compress() call; ``route`` records what the routing did with it."""

    compressor: Any
    dtype: Any
    shape: Tuple[Optional[int], ...]
    #: The gradient's own graph name (TensorFlow graph mode), used to name the collective when Horovod does not.
    source_name: Optional[str] = None
    #: "unrouted" until the routing sees it, then "dense", "topk", "fp16" (ratio="auto"'s fp16) or "local" (update
    #: mode: the gradient stays on its rank).
    route: str = "unrouted"
    #: On a tensor's first step: a callable that raises core.consistency.RankMismatch unless every rank agrees
    #: about this tensor; the routing calls it before waiting for the tensor's own collective.
    check: Any = None
    #: The prefix of the optimizer that compressed the tensor (core.scopes), put in front of its name.
    scope: str = ""
    #: Whether the compressor reached Horovod through horovod-topk's ``DistributedOptimizer`` (PyTorch), which sets
    #: up what TopKEF keeps per optimizer (its scope, buckets, update mode's step); a mark without it comes from an
    #: optimizer Horovod's own function built, and the routing refuses it rather than train in another mode.
    wrapped: bool = False


def mark(alias: Any, pending: PendingReduction) -> Any:
    setattr(alias, PENDING_ATTR, pending)
    return alias


def pending_of(tensor: Any) -> Optional[PendingReduction]:
    return getattr(tensor, PENDING_ATTR, None)


def reduction_scale(op_name: str, prescale_factor: float, postscale_factor: float, world_size: int) -> float:
    """The factor Horovod's allreduce applies to the sum of the ranks' tensors: pre * post, and 1/P for Average.

    Args:
        op_name: "average" or "sum" (the frameworks map Horovod's op constants to these).
    """
    if op_name == "average":
        return prescale_factor * postscale_factor / world_size
    if op_name == "sum":
        return prescale_factor * postscale_factor
    raise ValueError(f"horovod-topk: TopKEF supports op=hvd.Average and op=hvd.Sum, not {op_name}")


def refuse_unsupported_op(uses_topk: bool, op: Any, average: Any, sum_: Any, adasum: Any) -> None:
    """Raise at construction of a distributed optimizer/tape when TopKEF is combined with an op it cannot do."""
    if not uses_topk or op is None or op in (average, sum_):
        return
    if op == adasum:
        raise ValueError(
            "horovod-topk: TopKEF cannot be combined with op=hvd.Adasum (Adasum combines dense gradients "
            "pairwise); use op=hvd.Average or hvd.Sum."
        )
    raise ValueError(f"horovod-topk: TopKEF supports op=hvd.Average and op=hvd.Sum, not op={op!r}")
