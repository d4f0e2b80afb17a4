"""``TopKEF`` for ``horovod.torch``: Top-K sparsification with error feedback behind Horovod's compressor API.

Horovod calls ``compress(tensor)`` without the tensor's name, and then hands the result to a dense allreduce. So
``compress`` only *marks* the tensor (a storage-sharing alias carrying a :class:`PendingReduction`); the routing
installed by :mod:`horovod_topk.torch.routing` sees the mark where Horovod launches the collective, knows the
name there, and calls :meth:`TopKEF.start_reduction`, which does the error-feedback selection and one allgather of
the packed payload. Outside ``hvd.DistributedOptimizer`` (e.g. ``hvd.allreduce(t, compression=TopKEF)``) nothing
routes the mark and the tensor is simply reduced dense.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from ..core import PayloadLayout, PendingReduction, TopKEFBase, allgather_name, plan_tensor, reduction_scale
from . import ops

__all__ = ["TopKEF", "TopKHandle"]

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

    def _alias(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()  # shares storage with the gradient: a dense in-place allreduce still lands there

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
        from horovod.torch.mpi_ops import Average, Sum, allgather_async, synchronize

        op_name = "average" if op == Average else "sum" if op == Sum else repr(op)
        scale = reduction_scale(op_name, prescale_factor, postscale_factor, process_set.size())
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
