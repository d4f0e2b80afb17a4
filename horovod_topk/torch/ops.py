"""The tensor math of TopKEF for PyTorch, as pure functions (testable without Horovod or a process group).

compensate_and_select  residual += grad; pick the k largest |residual|; keep what is not sent in the residual
compensate_nonfinite   the same step for a gradient with NaN/Inf entries (they are sent, never kept)
pack / unpack          the core payload layout (core.payload) as a uint8 buffer and back, without copies
scatter_sum            the dense sum of all ranks' payloads: one index_add_ over the P*k entries
add_leftovers          a tensor that goes dense takes its residual's leftovers, if it is finite, without a host read
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..core.payload import PayloadLayout

__all__ = ["residual_dtype", "to_wire", "compensate_and_select", "compensate_nonfinite", "pack", "unpack",
           "scatter_sum", "add_leftovers"]


def residual_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """Residuals accumulate many small unsent updates: keep them in float32 even for fp16/bf16 gradients (in
    half precision an update smaller than the residual's last bit would be lost), float64 for float64."""
    return torch.float64 if grad_dtype == torch.float64 else torch.float32


def to_wire(values: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """``values`` as they travel in ``wire_dtype``: clamped to its largest finite magnitude first where it is
    narrower than theirs. Why: a finite value beyond float16's 65504 (a residual that grew, a gradient under an AMP
    loss scale) would otherwise travel as an Inf, and ``value - sent`` would put an Inf into the residual, which
    then never leaves it (every later step sends it, and AMP skips every step). Clamped, the excess stays in the
    residual as rounding does, and goes out on later steps. NaN and Inf travel as they are (a non-finite sum must
    reach every rank's update, as with a dense allreduce)."""
    if values.dtype == wire_dtype or not wire_dtype.is_floating_point:
        return values.to(wire_dtype)
    limit = torch.finfo(wire_dtype).max
    if torch.finfo(values.dtype).max > limit:
        values = torch.where(torch.isinf(values), values, values.clamp(-limit, limit))
    return values.to(wire_dtype)


def compensate_and_select(
    grad: torch.Tensor,
    residual: torch.Tensor,
    k: int,
    wire_dtype: torch.dtype,
    momentum_buffer: Optional[torch.Tensor] = None,
    momentum: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Error-feedback Top-K on one tensor with exact ``torch.topk``. Updates ``residual`` (flat, residual_dtype)
    in place. The reference implementation; the fused kernel (kernels.py) does the same in one pass.

    With a ``momentum_buffer`` u (DGC momentum correction): u = m u + g, residual += u, and u is zeroed where
    entries are sent (momentum-factor masking).

    After the call, for every element: ``new residual + sent == old residual + grad`` where ``sent`` is the
    returned values scattered at the returned indices, converted back to the residual's dtype. Rounding of the
    sent values to ``wire_dtype`` is kept in the residual, so no gradient mass is ever lost.

    Returns:
        (indices int32 of shape (k,), values of ``wire_dtype`` of shape (k,)).
    """
    if momentum_buffer is not None:
        momentum_buffer.mul_(momentum).add_(grad.reshape(-1))
        residual.add_(momentum_buffer)
    else:
        residual.add_(grad.reshape(-1))
    indices = torch.topk(residual.abs(), k, sorted=False).indices.sort().values
    picked = residual[indices]
    values = to_wire(picked, wire_dtype)
    residual[indices] = picked - values.to(residual.dtype)
    if momentum_buffer is not None:
        momentum_buffer[indices] = 0
    return indices.to(torch.int32), values


def compensate_nonfinite(
    grad: torch.Tensor,
    residual: torch.Tensor,
    k: int,
    wire_dtype: torch.dtype,
    momentum_buffer: Optional[torch.Tensor] = None,
    momentum: float = 0.0,
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """None (and nothing touched) when ``grad`` is finite. Otherwise the step of a gradient with NaN/Inf entries,
    as the fused kernel does it: those entries never enter the residual (a NaN there would never be sent nor
    leave) and are what is sent (the first k of them; the other slots repeat the first one, and a non-finite value
    added to itself stays non-finite), so every rank's average turns non-finite there as with a dense allreduce;
    the finite entries are compensated into the residual (and momentum buffer) and wait for later steps.
    """
    flat = grad.reshape(-1)
    finite = torch.isfinite(flat)
    if bool(finite.all()):
        return None
    clean = torch.where(finite, flat, torch.zeros((), dtype=flat.dtype)).to(residual.dtype)
    if momentum_buffer is not None:
        momentum_buffer.copy_(torch.where(finite, momentum_buffer * momentum + clean, momentum_buffer))
        residual.add_(torch.where(finite, momentum_buffer, torch.zeros((), dtype=residual.dtype)))
    else:
        residual.add_(clean)
    bad = (~finite).nonzero().reshape(-1)
    indices = bad[:k]
    if indices.numel() < k:
        indices = torch.cat([indices, indices[:1].expand(k - indices.numel())])
    return indices.to(torch.int32), flat[indices].to(residual.dtype).to(wire_dtype)


def pack(indices: torch.Tensor, values: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """One uint8 buffer holding ``indices`` (int32) and ``values`` at the offsets of ``layout``."""
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=values.device)
    buf[: layout.indices_nbytes].view(torch.int32).copy_(indices)
    buf[layout.values_offset : layout.values_end].view(values.dtype).copy_(values)
    # Padding bytes are zeroed so that identical inputs give identical bytes on the wire.
    buf[layout.indices_nbytes : layout.values_offset].zero_()
    buf[layout.values_end :].zero_()
    return buf


def unpack(
    gathered: torch.Tensor, world_size: int, layout: PayloadLayout, value_dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Views (no copies) of the indices (P, k) int32 and values (P, k) in a gathered buffer of P payloads."""
    rows = gathered.view(world_size, layout.nbytes)
    indices = rows[:, : layout.indices_nbytes].view(torch.int32)
    values = rows[:, layout.values_offset : layout.values_end].view(value_dtype)
    return indices, values


def scatter_sum(indices: torch.Tensor, values: torch.Tensor, numel: int, acc_dtype: torch.dtype) -> torch.Tensor:
    """Dense flat tensor of ``numel`` elements with every (index, value) pair of every rank added in.

    Ranks may select the same index; index_add_ adds them all, which is the sum a dense allreduce would give.
    """
    dense = torch.zeros(numel, dtype=acc_dtype, device=values.device)
    dense.index_add_(0, indices.reshape(-1), values.reshape(-1).to(acc_dtype))
    return dense


def add_leftovers(tensor: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``tensor += residual`` and ``residual = 0`` when every entry of ``tensor`` is finite; both unchanged
    otherwise (a non-finite step is skipped or lost, the leftovers wait for a later one). Returns 1 when
    ``tensor`` was not finite, else 0 (0-dim int64 on its device). No host synchronisation: on a GPU this runs for
    every tensor of every dense step while a residual exists."""
    finite = torch.isfinite(tensor).all()
    leftovers = residual.to(tensor.dtype).view(tensor.shape)
    tensor.add_(torch.where(finite, leftovers, torch.zeros((), dtype=tensor.dtype, device=tensor.device)))
    residual.mul_((~finite).to(residual.dtype))
    return (~finite).to(torch.int64)
