"""What every PyTorch front end (Horovod's ``TopKEF``, the DDP hook's ``TopKEFState``) does with one tensor's
state on one step: residual buffers created lazily on the gradient's device, the wire dtype of a gradient, the
spike guard, the error-feedback selection into a payload, the leftovers a tensor carries when it goes dense, and
residuals in and out of checkpoints. The front ends differ only in how they name tensors and which collectives
carry the payloads."""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence, Tuple

import torch

from ..core import PayloadLayout, TensorRecord
from ..core.policy import residual_world_factor, spike_guard_scale, tensor_payload_layout
from ..core.exchange import DENSE_HALF, DENSE_INT8
from . import encoding, kernels, ops
from .half_route import to_half
from .int8_route import to_int8
from .selection import Backend, backend_for, compress_tensor, dtype_token

__all__ = ["TorchResiduals", "WIRE_DTYPES"]

#: TopKConfig.value_dtype -> the dtype values travel as.
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "float8": encoding.FLOAT8}


class TorchResiduals:
    """Mixin for a core.CompressorState over torch tensors (needs ``self.config``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not torch.cuda.is_available():  # a GPU job's gradients take the Triton kernels, not these
            kernels.load_in_background()  # ready by the first compressed step (torch.kernels)

    config: Any
    auto: Any
    #: ratio="auto" may choose fp16: every PyTorch front end sends it (torch.half_route)
    _sends_half = True
    #: and int8 (torch.int8_route), on CPU gradients only: each front end withdraws it on another device
    #: (core.autodensity.AutoDensity.withdraw_int8)
    _sends_int8 = True

    def _wire_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        """What the values of ``tensor``'s payload travel as (TopKConfig.value_dtype, or its own dtype)."""
        if not tensor.is_floating_point():
            return tensor.dtype
        return WIRE_DTYPES.get(self.config.value_dtype or "", tensor.dtype)

    def _state_buffers(
        self, name: str, record: TensorRecord[torch.Tensor], tensor: torch.Tensor
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The residual (and momentum buffer) of ``name``: created on first use, moved to the gradient's device
        and dtype after a load, and checked against the gradient's size."""
        acc_dtype = ops.residual_dtype(tensor.dtype)
        buffers = []
        for field, wanted in (("residual", True), ("momentum", self.config.momentum > 0)):
            buf = getattr(record, field)
            if not wanted:
                buffers.append(None)
                continue
            if buf is None:
                buf = torch.zeros(tensor.numel(), dtype=acc_dtype, device=tensor.device)
            elif buf.device != tensor.device or buf.dtype != acc_dtype:
                buf = buf.to(device=tensor.device, dtype=acc_dtype)
            if buf.numel() != tensor.numel():
                raise ValueError(
                    f"horovod-topk: the {field} of {name!r} has {buf.numel()} elements, the gradient "
                    f"{tensor.numel()} (a state_dict of another model?)"
                )
            setattr(record, field, buf)
            buffers.append(buf)
        return buffers[0], buffers[1]

    def _group_selection(self) -> Any:
        """The grouped selection's residual buffers of this state (torch.bucket_select), made on first use."""
        found = getattr(self, "_grouped_selection", None)
        if found is None:
            from .bucket_select import GroupSelection

            found = self._grouped_selection = GroupSelection()
        return found

    def _backend(self, tensor: torch.Tensor) -> Backend:
        """Who selects and packs this tensor's entries, for its device and the selector (torch/selection.py)."""
        return backend_for(tensor, self.config.selector)

    def _guard_spike(self, record: TensorRecord[torch.Tensor], tensor: torch.Tensor) -> None:
        """TopKConfig.spike_guard: scale the gradient in place (like clip_grad_norm_) when its norm exceeds the
        guard times its running level."""
        if self.config.spike_guard is None or not tensor.is_floating_point():
            return
        factor, record.gradient_level = spike_guard_scale(
            float(tensor.float().norm()), record.gradient_level, self.config.spike_guard, record.steps
        )
        if factor < 1.0:
            tensor.mul_(factor)
            record.guarded_steps += 1

    def _send_leftovers(self, record: TensorRecord[torch.Tensor], tensor: torch.Tensor) -> None:
        """``tensor`` goes dense this step: the leftovers of its earlier compressed steps travel in it, so nothing
        is lost. A non-finite gradient keeps them for a later step (AMP skips the step, or it is lost anyway).

        On the CPU, once sent, the residual is dropped (a later compressed step makes a new one, zeros, as on its
        first step): otherwise every later dense step would add and zero an all-zero buffer, three passes over the
        tensor for nothing, for as long as the tensor stays dense (ratio="auto" back to dense, say). On a GPU the
        finiteness is not read (a host read per tensor and step would stall the job), so the residual stays and is
        added with the kernel that keeps it where the gradient is not finite."""
        if record.residual is None:
            return
        if tensor.device.type != "cpu":  # a host read per tensor and dense step would stall a job that went dense
            record.nonfinite_steps += ops.add_leftovers(tensor, record.residual)
            return
        if bool(torch.isfinite(tensor).all()):  # reading the flag is free on the CPU
            tensor.add_(record.residual.to(tensor.dtype).view(tensor.shape))
            record.residual = None
        else:
            record.nonfinite_steps += 1

    def _residual_for(self, name: str, record: TensorRecord[torch.Tensor], tensor: torch.Tensor, world_size: int,
                      op_name: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The residual (and momentum buffer) of ``name``, rescaled first if it was built under another number of
        workers (policy.residual_world_factor), so that the mass it owes the model stays the same."""
        residual, momentum_buffer = self._state_buffers(name, record, tensor)
        world_factor = residual_world_factor(op_name, record.world_size, world_size)
        if world_factor != 1.0:  # workers left or joined since this residual was built
            residual.mul_(world_factor)
        record.world_size = world_size
        return residual, momentum_buffer

    def _send_half(self, name: str, record: TensorRecord[torch.Tensor], flat: torch.Tensor, scale: float,
                   world_size: int, op_name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ratio="auto"'s fp16 route for one tensor this step (torch.half_route): its float16 values for a
        sum-allreduce (into ``out`` when given), the residual left holding what float16 did not carry; counts its
        bytes and non-finite step."""
        residual, _ = self._residual_for(name, record, flat, world_size, op_name)
        half, nonfinite = to_half(flat, residual, scale, world_size, out)
        self._sent_half(record, half.numel(), nonfinite)
        return half

    def _send_int8(self, name: str, record: TensorRecord[torch.Tensor], flat: torch.Tensor, scale: float,
                   world_size: int, op_name: str) -> Tuple[torch.Tensor, float]:
        """ratio="auto"'s int8 route for one tensor this step (torch.int8_route), on the grid of the record's
        reference (> 0): its int32 words for a sum-allreduce and the grid's step, the residual left holding what
        the grid did not carry; counts its bytes and non-finite step."""
        residual, _ = self._residual_for(name, record, flat, world_size, op_name)
        words, nonfinite, delta = to_int8(flat, residual, scale, world_size, record.int8_reference)
        record.nonfinite_steps += nonfinite
        record.bytes_sent += 4 * words.numel()
        record.exchange = DENSE_INT8
        return words, delta

    def _sent_half(self, record: TensorRecord[torch.Tensor], numel: int, nonfinite: Any) -> None:
        """Count one fp16 step of ``record``'s tensor: 2 bytes an entry, and ``nonfinite`` (0/1 or a device
        tensor) in its non-finite steps."""
        record.nonfinite_steps += nonfinite
        record.bytes_sent += 2 * numel
        record.exchange = DENSE_HALF

    def _select(
        self, name: str, record: TensorRecord[torch.Tensor], tensor: torch.Tensor, flat: torch.Tensor, k: int,
        world_size: int, op_name: str,
    ) -> Tuple[torch.Tensor, PayloadLayout, torch.dtype, Backend, torch.Tensor]:
        """Error feedback and selection of the k entries of ``tensor`` (``flat`` its flat view) at the record's
        current step: returns (payload, its layout, the wire dtype, the backend that selected, the residual).

        A residual built under another number of workers is rescaled first (policy.residual_world_factor) so the
        mass it owes the model stays the same. A gradient's NaN/Inf entries are sent as such and never enter the
        residual or momentum buffer, on every backend (csrc/topk_kernels.cpp, ops.compensate_nonfinite).
        """
        residual, momentum_buffer, layout, wire_dtype, backend = self._prepare(name, record, tensor, flat, k,
                                                                               world_size, op_name)
        started = time.perf_counter()  # host time only: no sync on a GPU (there it is the launch time)
        payload, nonfinite = compress_tensor(backend, flat, residual, momentum_buffer, self.config.momentum, layout,
                                             wire_dtype, record.steps)
        self._selected(record, nonfinite, time.perf_counter() - started)
        return payload, layout, wire_dtype, backend, residual

    def _prepare(
        self, name: str, record: TensorRecord[torch.Tensor], tensor: torch.Tensor, flat: torch.Tensor, k: int,
        world_size: int, op_name: str, layout: Optional[PayloadLayout] = None,
        how: Optional[Tuple[torch.dtype, Backend]] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], PayloadLayout, torch.dtype, Backend]:
        """Everything a selection of ``tensor`` needs before its kernels run: (residual, momentum buffer, payload
        layout, wire dtype, backend); the residual rescaled if the number of workers changed. A bucket passes
        the ``layout`` its plan holds and ``how`` (wire dtype, backend) found once for all its members: the same
        values, without recomputing them per member and step."""
        residual, momentum_buffer = self._residual_for(name, record, tensor, world_size, op_name)
        wire_dtype, backend = how if how is not None else (self._wire_dtype(tensor), self._backend(tensor))
        if layout is None:
            layout = tensor_payload_layout(self.config, k, flat.numel(), dtype_token(wire_dtype).element_size())
        return residual, momentum_buffer, layout, wire_dtype, backend

    def _selected(self, record: TensorRecord[torch.Tensor], nonfinite: Any, seconds: float) -> None:
        """Count one selection in the record (``nonfinite``: 0/1, or a device tensor, read without a sync here)
        and its host time (on a GPU, the launch time)."""
        record.nonfinite_steps += nonfinite
        record.compress_seconds += seconds
        if self.auto is not None:
            self.auto.compressed(seconds)

    def _selected_group(self, records: Sequence[TensorRecord[torch.Tensor]], numels: Sequence[int],
                        seconds: float) -> None:
        """:meth:`_selected` for a group selected at once (its non-finite counts are the group's, added on the
        device): each record's share of the host time, by size."""
        total = sum(numels)
        for record, numel in zip(records, numels):
            record.compress_seconds += seconds * numel / total
        if self.auto is not None:
            self.auto.compressed(seconds)

    # ---- state hooks ---------------------------------------------------------------------------------------
    def _export_residual(self, residual: torch.Tensor) -> torch.Tensor:
        return residual.detach().clone().cpu()

    def _import_residual(self, name: str, value: Any) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"horovod-topk: residual of {name!r} in the state_dict is not a torch.Tensor")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"horovod-topk: the saved residual of {name!r} holds NaN/Inf (a corrupted state); "
                             f"refusing to load it")
        return value.detach().clone().reshape(-1)

    def _residual_squared_norm(self, residual: torch.Tensor) -> float:
        return float(residual.double().pow(2).sum())

