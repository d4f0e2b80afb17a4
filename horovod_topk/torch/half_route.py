"""The fp16 route (core.exchange.DENSE_HALF): a tensor sent dense with its values in float16, with error feedback.

ratio="auto" takes it (core.autodensity.HALF) where half dense's bytes at dense's steps reach the target soonest:
a link too slow for dense but fast enough that dropping entries costs more steps than it saves. It sends what
Horovod's ``Compression.fp16`` and DDP's ``fp16_compress_hook`` send, with two differences a long job needs:

- what float16 does not carry -- the rounding, values below its smallest subnormal -- stays in the tensor's
  residual and goes out on later steps (error feedback, as for the entries Top-K does not send): nothing is lost;
- values are scaled by the reduction's factor (1/P for an average) before the cast and clamped to a float16 a little
  under 65504 / P (core.exchange.half_limit), so that the sum of P ranks' values cannot overflow float16 into an Inf
  no rank had; what the clamp cut stays in the residual too. A plain cast turns a finite gradient of 70000 (a large
  AMP loss scale) into Inf on every rank.

A gradient's NaN/Inf entries are sent as such (every rank's average turns non-finite there, as with a dense
allreduce, so AMP's scaler skips the step on every rank) and never enter the residual.

On the CPU one pass of the fused kernel (csrc/half_route.cpp); elsewhere, or without a compiler, the torch
operations below, which give the same bits. The front ends (Horovod's TopKEF, the DDP hook's bucket step) run the
collective.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch

from ..core.exchange import FLOAT16_MAX, half_limit
from . import kernels
from .int8_route import largest_finite

__all__ = ["FLOAT16_MAX", "to_half", "HalfHandle"]


def to_half(flat: torch.Tensor, residual: torch.Tensor, scale: float, world_size: int,
            out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Union[int, torch.Tensor]]:
    """This rank's share of a sum-allreduce of ``scale`` x (``flat`` + ``residual``) in float16, written into ``out``
    (a float16 tensor of ``flat``'s size, e.g. a slice of a bucket's buffer) or a new tensor; ``residual`` (flat,
    float32 or float64) is left holding what float16 did not carry, in ``flat``'s units. Returns (the float16 values,
    1 if ``flat`` had a non-finite entry else 0: an int on the CPU, a 0-dim int64 tensor elsewhere, read without a
    host synchronisation)."""
    if scale == 0.0:
        raise ValueError("horovod-topk: a reduction scaled by 0 cannot be sent in float16 with error feedback")
    limit = half_limit(world_size)
    if out is None:
        out = torch.empty(flat.numel(), dtype=torch.float16, device=flat.device)
    module = kernels.load() if flat.device.type == "cpu" and flat.is_contiguous() else None
    if module is not None and flat.dtype in (torch.float32, torch.float64) and residual.dtype in (
            torch.float32, torch.float64) and out.is_contiguous():
        return out, module.to_half(flat, residual, float(scale), limit, out)
    acc = flat.reshape(-1).to(residual.dtype) + residual
    scaled = acc * scale
    # a gradient's Inf stays an Inf (the clamp would make it finite); NaN passes the clamp as NaN; a finite value
    # that the scale made infinite is clamped
    out.copy_(torch.where(torch.isinf(acc), scaled, scaled.clamp(-limit, limit)))
    finite = torch.isfinite(acc)
    residual.copy_(torch.where(finite, acc - out.to(acc.dtype) * (1.0 / scale), residual))  # as the kernel
    bad = ~finite.all()
    return out, (int(bad) if flat.device.type == "cpu" else bad.to(torch.int64))


class HalfHandle:
    """Handle of one tensor's float16 allreduce (Horovod's optimizer accepts a callable in ``synchronize()``):
    calling it waits and writes the sum over ``out`` (the gradient's own buffer), which it returns in ``shape``;
    ``keep``, where given, gets the sum's largest magnitude (0 if it is not finite): the int8 route's grid
    reference (torch.int8_route), the same on every rank."""

    def __init__(self, handle: Any, wait: Callable[[Any], torch.Tensor], out: torch.Tensor,
                 shape: Tuple[int, ...], keep: Optional[Callable[[float], None]] = None) -> None:
        self._handle = handle
        self._wait = wait
        self._out = out
        self._shape = shape
        self._keep = keep
        self._result: Any = None

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            summed = self._wait(self._handle)
            self._out.copy_(summed.view(self._out.shape))
            if self._keep is not None:
                self._keep(largest_finite(summed))
            self._result = self._out.view(self._shape)
            self._handle = None
        return self._result
