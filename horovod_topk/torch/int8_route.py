"""The int8 route (core.exchange.DENSE_INT8): a tensor sent dense, each value one byte on a grid every rank shares,
with error feedback.

ratio="auto" takes it (core.autodensity.INT8) where a quarter of dense's bytes at dense's steps reaches the target
soonest: a link too slow for fp16 whose step still has to pay for every entry not sent. What it sends:

- each rank rounds ``scale`` x (gradient + residual) to the nearest multiple of ``delta`` and clamps it to +-L,
  L = 127 // P (core.exchange.int8_lane_limit), so that P ranks' integers sum to a signed byte; the rounding and
  what the clamp cut stay in the rank's residual and go out on later steps (nothing is lost);
- ``delta`` = SPREAD x M / (L x P), where M is the largest magnitude of this tensor's reduced result on its step
  before (the same bits on every rank: every rank holds the same result), so no collective is spent on agreeing on
  a scale: each rank's share of the result (its value times the reduction's scale) is sent on a grid that covers
  +-SPREAD x M / P, i.e. for an average each rank's own value within +-SPREAD x the previous average's largest
  entry. A grid too narrow for this step's values clamps them, the result's largest entry then is P x L x delta =
  SPREAD x M, and the next grid is SPREAD times wider;
- four values travel in one int32 word (Horovod sums no 8- or 16-bit integers), plus one word that counts the
  ranks whose gradient had a NaN/Inf: then every rank's result is NaN for the whole tensor, so that AMP's scaler
  (or the non-finite rule) skips the step on every rank, and no rank's residual takes the non-finite entries.

Without a previous result (the tensor's first step on this route, a load without one, an elastic reset) or with
one that was all zero or not finite, the front end sends the tensor on the fp16 route instead (torch.half_route)
and takes M from that result. Steps on other routes (dense, fp16) leave M as it was: a grid that no longer fits
when int8 resumes corrects itself in a step (a clamped result makes the next grid SPREAD times wider, a result far
inside it the next one finer; what the grid did not carry is in the residual). On the CPU M is read on the host
for free; on a GPU it would be a host synchronisation per tensor and step, so ratio="auto" offers int8 only to CPU
gradients.

On the CPU one pass of the fused kernel each way (csrc/int8_route.cpp); without a compiler the torch operations
below, which give the same bits.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional, Tuple

import torch

from ..core.exchange import int8_lane_limit, int8_word_bias
from . import kernels

__all__ = ["SPREAD", "int8_words", "to_int8", "from_int8", "largest_finite", "Int8Handle"]

#: Each rank's grid covers +-SPREAD x the previous average's largest entry (in the rank's own units): its own
#: values spread wider than their average (the average's noise is sqrt(P) smaller). Screened in the simulator at 4
#: workers (benchmarks/compression_sim.py, isumavg:SPREAD; docs/auto-density.md): the transformer as good at 2 as
#: at 4, the GRU best at 2 (1 clamps too much, 4 rounds too coarsely).
SPREAD = 2.0
#: Words after the values: the count of ranks with a non-finite gradient.
CONTROL_WORDS = 1


def int8_words(numel: int) -> int:
    """int32 words one rank sends for a tensor of ``numel`` values: four values a word, and the control word."""
    return (numel + 3) // 4 + CONTROL_WORDS


def largest_finite(values: torch.Tensor) -> float:
    """A reduced result's largest magnitude as the next grid's reference, 0 where it is empty or not finite (that
    tensor's next step then goes fp16). Read on the host: on the CPU for free."""
    largest = float(values.abs().max()) if values.numel() else 0.0
    return largest if math.isfinite(largest) else 0.0


def to_int8(flat: torch.Tensor, residual: torch.Tensor, scale: float, world_size: int, reference: float
            ) -> Tuple[torch.Tensor, int, float]:
    """This rank's words for a sum-allreduce of ``scale`` x (``flat`` + ``residual``) on the grid of ``reference``
    (the previous result's largest magnitude, > 0); ``residual`` (flat, floating) is left holding what the grid did
    not carry, in ``flat``'s units, untouched where the gradient is not finite. Returns (the int32 words, 1 if
    ``flat`` had a non-finite entry else 0, the grid's step in the result's units)."""
    if sys.byteorder != "little":  # the words are read back byte by byte
        raise RuntimeError("horovod-topk: the int8 route packs bytes little-endian; this host is big-endian")
    limit = int8_lane_limit(world_size)
    if limit < 1 or scale == 0.0 or not (reference > 0.0 and math.isfinite(reference)):
        raise ValueError(f"horovod-topk: no int8 grid for {world_size} ranks, scale {scale} and reference "
                         f"{reference}")
    delta = SPREAD * reference / (limit * world_size)
    numel = flat.numel()
    words = torch.empty(int8_words(numel), dtype=torch.int32, device=flat.device)
    module = kernels.load() if flat.device.type == "cpu" and flat.is_contiguous() else None
    if module is not None and flat.dtype in (torch.float32, torch.float64) and residual.dtype in (
            torch.float32, torch.float64) and residual.dtype.itemsize >= flat.dtype.itemsize:
        bad = module.to_int8(flat.reshape(-1), residual, scale / delta, delta / scale, limit, words)
        return words, bad, delta
    packed = words[:-CONTROL_WORDS].view(torch.uint8)
    acc = flat.reshape(-1).to(residual.dtype) + residual
    finite = torch.isfinite(acc)
    bad = int(not bool(finite.all()))
    steps = torch.round(acc * (scale / delta)).clamp_(-limit, limit)
    steps = torch.where(finite, steps, steps.new_zeros(()))
    residual.copy_(torch.where(finite, acc - steps * (delta / scale), residual))
    packed[numel:].fill_(limit)  # padding: value 0
    packed[:numel].copy_(steps.add_(limit))
    words[:-CONTROL_WORDS].sub_(int8_word_bias(limit))
    words[-1] = bad
    return words, bad, delta


def from_int8(summed: torch.Tensor, numel: int, world_size: int, delta: float, out: torch.Tensor
              ) -> Tuple[torch.Tensor, float]:
    """The reduced tensor from the summed ``summed`` words, written into ``out`` (flat, ``numel`` values), and the
    reference of the next step (its largest magnitude; 0 where it is not finite: that step goes fp16)."""
    limit = int8_lane_limit(world_size)
    if int(summed[-1]) > 0:  # a rank's gradient was not finite: the tensor is, on every rank
        out.fill_(float("nan"))
        return out, 0.0
    module = kernels.load() if summed.device.type == "cpu" else None
    if module is not None and out.dtype in (torch.float32, torch.float64) and out.is_contiguous():
        largest = module.from_int8(summed, numel, world_size, limit, delta, out)
        return out, float(largest) * delta
    values = summed[:-CONTROL_WORDS].to(torch.int64).add_(world_size * int8_word_bias(limit))
    lanes = values.view(torch.uint8).view(-1, 8)[:, :4].reshape(-1)[:numel]
    out.copy_(lanes.to(out.dtype).sub_(world_size * limit).mul_(delta))
    return out, float(lanes.to(torch.int16).sub_(world_size * limit).abs_().max()) * delta if numel else 0.0


class Int8Handle:
    """Handle of one tensor's int8-route allreduce (Horovod's optimizer accepts a callable in ``synchronize()``):
    calling it waits, writes the reduced tensor over ``out`` (the gradient's own buffer), hands ``keep`` the next
    step's reference, and returns ``out`` in ``shape``."""

    def __init__(self, handle: Any, wait: Callable[[Any], torch.Tensor], out: torch.Tensor, shape: Tuple[int, ...],
                 world_size: int, delta: float, keep: Callable[[float], None]) -> None:
        self._handle = handle
        self._wait = wait
        self._out = out
        self._shape = shape
        self._world_size = world_size
        self._delta = delta
        self._keep = keep
        self._result: Optional[torch.Tensor] = None

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            summed = self._wait(self._handle)
            _, reference = from_int8(summed, self._out.numel(), self._world_size, self._delta, self._out)
            self._keep(reference)
            self._result = self._out.view(self._shape)
            self._handle = None
        return self._result
