"""``TopKEF`` for ``horovod.torch``: Top-K sparsification with error feedback behind Horovod's compressor API.

Horovod calls ``compress(tensor)`` without the tensor's name, and then hands the result to a dense allreduce. So
``compress`` only *marks* the tensor (a storage-sharing alias carrying a :class:`PendingReduction`); the routing
installed by :mod:`horovod_topk.torch.routing` sees the mark where Horovod launches the collective, knows the
name there, and calls :meth:`TopKEF.start_reduction`, which does the error-feedback selection and one allgather of
the packed payload. Outside ``hvd.DistributedOptimizer`` (e.g. ``hvd.allreduce(t, compression=TopKEF)``) nothing
routes the mark and the tensor is simply reduced dense.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from ..core import PayloadLayout, TopKEFBase, allgather_name, plan_tensor
from . import ops

__all__ = ["TopKEF", "PendingReduction", "TopKHandle", "PENDING_ATTR"]

#: Attribute set on the alias returned by ``compress`` so the routing can recognise it.
PENDING_ATTR = "_horovod_topk_pending"


@dataclass
class PendingReduction:
    """The ``ctx`` of one compress() call; ``route`` records what the routing did with it."""

    compressor: "TopKEF"
    dtype: torch.dtype
    shape: Tuple[int, ...]
    #: "unrouted" until the routing sees it, then "dense" or "topk".
    route: str = "unrouted"


class TopKHandle:
    """Handle of one in-flight compressed reduction; calling it waits and returns the dense reduced gradient.

    Horovod's optimizer accepts a callable handle in ``synchronize()``.
    """

    def __init__(
        self,
        name: str,
        allgather_handle: Any,
        wait: Callable[[Any], torch.Tensor],
        layout: PayloadLayout,
        world_size: int,
        value_dtype: torch.dtype,
        shape: Tuple[int, ...],
        out_dtype: torch.dtype,
        scale: float,
    ) -> None:
        self.name = name
        self._allgather_handle = allgather_handle
        self._wait = wait
        self._layout = layout
        self._world_size = world_size
        self._value_dtype = value_dtype
        self._shape = shape
        self._out_dtype = out_dtype
        self._scale = scale
        self._result: Optional[torch.Tensor] = None

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            gathered = self._wait(self._allgather_handle)
            self._layout.check_gathered(self.name, gathered.numel(), self._world_size)
            indices, values = ops.unpack(gathered, self._world_size, self._layout, self._value_dtype)
            numel = 1
            for d in self._shape:
                numel *= d
            dense = ops.scatter_sum(indices, values, numel, ops.residual_dtype(self._out_dtype))
            if self._scale != 1.0:
                dense.mul_(self._scale)
            self._result = dense.view(self._shape).to(self._out_dtype)
        return self._result


class TopKEF(TopKEFBase[torch.Tensor]):
    """Top-K with error feedback for ``hvd.DistributedOptimizer(..., compression=TopKEF)``.

    Each step, per compressed gradient: add this rank's residual, send the k largest-magnitude entries as one packed
    (int32 index, value) payload with one allgather named ``topk.<parameter name>``, keep the rest as the new
    residual, and build the dense average from all ranks' payloads. Pass the class for the defaults (ratio 0.01)
    or an object for other options; see :class:`horovod_topk.core.TopKConfig`.

    Use one compressor object per optimizer: residuals are keyed by parameter name.
    """

    _warned_unrouted = False

    # ---- Horovod's compressor API --------------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, PendingReduction]:
        """Mark ``tensor`` for the routing; the actual selection happens when Horovod launches the collective."""
        pending = PendingReduction(self, tensor.dtype, tuple(tensor.shape))
        marked = tensor.detach()  # shares storage with the gradient: a dense in-place allreduce still lands there
        setattr(marked, PENDING_ATTR, pending)
        return marked, pending

    def decompress(self, tensor: torch.Tensor, ctx: Optional[PendingReduction]) -> torch.Tensor:
        """The reduced tensor: the routing already produced it in the gradient's dtype and shape."""
        if ctx is not None and ctx.route == "unrouted" and not TopKEF._warned_unrouted:
            TopKEF._warned_unrouted = True
            warnings.warn(
                "horovod-topk: TopKEF was used outside hvd.DistributedOptimizer / DistributedGradientTape; the "
                "tensor was reduced dense (no Top-K, no error feedback).",
                stacklevel=2,
            )
        return tensor

    # ---- called by the routing -----------------------------------------------------------------------------
    def start_reduction(
        self,
        tensor: torch.Tensor,
        pending: PendingReduction,
        name: str,
        *,
        op: Any,
        prescale_factor: float,
        postscale_factor: float,
        process_set: Any,
    ) -> Optional[TopKHandle]:
        """Start the compressed reduction of ``tensor`` called ``name``; None if it must go dense.

        The caller issues the dense allreduce itself for a None, so that dense tensors of a group stay one
        grouped collective.
        """
        from horovod.torch.mpi_ops import allgather_async, synchronize

        scale = _reduction_scale(op, prescale_factor, postscale_factor, process_set.size())
        plan = plan_tensor(name, tensor.numel(), tensor.is_floating_point(), self.config)
        record = self.registry.record(name, tuple(tensor.shape))
        dense_nbytes = tensor.numel() * tensor.element_size()
        record.steps += 1
        record.bytes_dense += dense_nbytes
        if not plan.compressed:
            pending.route = "dense"
            record.bytes_sent += dense_nbytes
            return None

        pending.route = "topk"
        acc_dtype = ops.residual_dtype(tensor.dtype)
        if record.residual is None:
            record.residual = torch.zeros(tensor.numel(), dtype=acc_dtype, device=tensor.device)
        elif record.residual.device != tensor.device or record.residual.dtype != acc_dtype:
            record.residual = record.residual.to(device=tensor.device, dtype=acc_dtype)
        if record.residual.numel() != tensor.numel():
            raise ValueError(
                f"horovod-topk: the residual of {name!r} has {record.residual.numel()} elements, the gradient "
                f"{tensor.numel()} (a state_dict of another model?)"
            )
        assert plan.k is not None
        indices, values = ops.compensate_and_select(tensor, record.residual, plan.k, tensor.dtype)
        layout = PayloadLayout(plan.k, values.element_size())
        payload = ops.pack(indices, values, layout)
        record.bytes_sent += layout.nbytes
        handle = allgather_async(payload, name=allgather_name(name), process_set=process_set)
        return TopKHandle(
            name, handle, synchronize, layout, process_set.size(), values.dtype, tuple(tensor.shape), tensor.dtype, scale
        )

    # ---- state hooks ---------------------------------------------------------------------------------------
    def _export_residual(self, residual: torch.Tensor) -> torch.Tensor:
        return residual.detach().clone().cpu()

    def _import_residual(self, name: str, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"horovod-topk: residual of {name!r} in the state_dict is not a torch.Tensor")
        return value.detach().clone().reshape(-1)

    def _residual_squared_norm(self, residual: torch.Tensor) -> float:
        return float(residual.double().pow(2).sum())


def _reduction_scale(op: Any, prescale_factor: float, postscale_factor: float, world_size: int) -> float:
    """The factor Horovod's allreduce would apply to the sum: pre * post, and 1/size for Average."""
    from horovod.torch.mpi_ops import Average, Sum

    if op == Average:
        return prescale_factor * postscale_factor / world_size
    if op == Sum:
        return prescale_factor * postscale_factor
    raise ValueError(f"horovod-topk: TopKEF supports op=hvd.Average and op=hvd.Sum, not op={op!r}")
