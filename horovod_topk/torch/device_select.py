"""Error-feedback Top-K for tensors on an accelerator, in plain torch ops and without host synchronisation.

The reference path (``ops.compensate_nonfinite`` + ``ops.compensate_and_select``) asks the host whether the
gradient is finite (``bool(...)``: a device-to-host copy that stalls the launch queue, per tensor and step) and
uses ``torch.topk`` over the whole tensor. The fused CPU kernel avoids both but runs only on the CPU. This module
does the same step as the kernel with torch ops whose output sizes are all known on the host, so that nothing
waits for the device:

* compensation with the non-finite rule applied unconditionally (``torch.where`` on ``isfinite``): a NaN/Inf
  gradient entry never enters the residual or momentum buffer; whether the step sends the non-finite entries or
  the Top-K is decided on the device (a 0-dim flag) and both candidate payloads have the fixed size k;
* the k-th largest magnitude found *exactly* by a radix selection on the magnitudes' bits, with thresholds
  (bucket prefixes) kept on the device: per round a 2048-bin histogram (``torch.histc``) of the next 11 bits of
  the entries that share the prefix found so far, a cumulative sum from the top, and ``searchsorted`` for the
  bucket that holds the k-th; 3 rounds for float32 residuals (31 magnitude bits), 6 for float64;
* exactly k indices: those above the k-th magnitude and, in index order, as many equal to it as needed, each
  from ``torch.nonzero_static`` (fixed output size k), merged by one sort of 2k entries (ascending indices, as
  the kernel sends them).

Why a radix selection over all entries rather than the kernel's sampled threshold with a candidate list: on the
CPU a threshold from a sample makes the common case one pass, and the rare "too few candidates" case costs a
rescan that the host decides on. On a GPU driven by eager torch ops, the host cannot decide anything without a
sync, so a sampled threshold would need a fallback that is launched on *every* step (its size fixed on the host),
i.e. a full-size selection anyway. The radix selection has no rare case: a misleading sample, ties, heavy tails
or a handful of huge entries all take the same fixed sequence of launches, and its result is exact (the same set
as ``torch.topk``, ties aside: among equal magnitudes the lowest indices go). Its cost is a fixed number of
elementwise passes (about 6 per round) and small k-sized work; how that compares with ``torch.topk`` on a GPU is
not yet measured (``benchmarks/bench_compress.py --device cuda``).

Launches: about 170 aten calls per tensor and step (counted with torch.profiler on the CPU; many are scalar or
2048-bin sized, and dtype conversions). At a few microseconds of host time each that is ~0.5 ms per tensor,
hidden behind the backward pass only while the GPU has more work queued than that; for models with many small
tensors it may be host-bound. Because every size is fixed on the host and nothing synchronises, the whole step
can be captured in a CUDA graph per tensor shape (one launch instead of ~170) -- the next step if measurements
show the launches dominate; not done.

Tensors are handled one at a time, as Horovod hands them over (each one's allgather starts as soon as its payload
exists); batching the selection across tensors would delay the first collective until the last gradient is
ready, so it is not done here.

Everything here also runs on the CPU (that is how it is tested: bit-for-bit the reference's selections).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import ops

__all__ = ["magnitude_keys", "kth_largest_key", "first_indices", "top_k_indices", "compensate_and_select"]

_RADIX_BITS = 11
_BINS = 1 << _RADIX_BITS
_KEY = {torch.float32: (torch.int32, 31), torch.float64: (torch.int64, 63)}


def magnitude_keys(values: torch.Tensor) -> torch.Tensor:
    """The bits of |values| as non-negative integers: they order like the magnitudes (NaN above +inf, as
    ``torch.topk`` orders them). float32 gives int32, float64 int64."""
    key_dtype, bits = _KEY[values.dtype]
    return values.view(key_dtype) & ((1 << bits) - 1)


def kth_largest_key(keys: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """The k-th largest of ``keys`` (non-negative, below 2**bits; 1 <= k <= keys.numel()) as a 0-dim tensor on
    their device, found without host synchronisation (see the module docstring)."""
    # histc counts in the input's float dtype: float32 counts are exact only up to 2**24
    count_dtype = torch.float32 if keys.numel() < (1 << 24) else torch.float64
    remaining = torch.full((1,), float(k), dtype=torch.float64, device=keys.device)
    prefix = torch.zeros((), dtype=keys.dtype, device=keys.device)
    top = torch.full((1,), _BINS - 1, dtype=torch.int64, device=keys.device)  # (torch.tensor would copy from host)
    shift = bits - _RADIX_BITS
    while True:
        low = max(shift, 0)
        width = shift + _RADIX_BITS - low
        bucket = (keys >> low) & ((1 << width) - 1)
        if low + width < bits:  # only the entries that share the prefix found so far take part
            bucket = torch.where((keys >> (low + width)) == prefix, bucket, -1)
        hist = torch.histc(bucket.to(count_dtype), bins=_BINS, min=0, max=_BINS).to(torch.float64)
        from_top = hist.flip(0).cumsum(0)  # from_top[j]: entries in the buckets above _BINS - 1 - j, inclusive
        j = torch.searchsorted(from_top, remaining)
        chosen = top - j
        remaining = remaining - (from_top.index_select(0, j) - hist.index_select(0, chosen))
        prefix = (prefix << width) | chosen.to(keys.dtype).reshape(())
        if low == 0:
            return prefix
        shift -= _RADIX_BITS


def first_indices(mask: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """The ascending positions of the first ``size`` true entries of a 1-D ``mask``, padded with ``fill``
    (int64, shape (size,)): a fixed output size, so no host synchronisation."""
    return torch.nonzero_static(mask, size=size, fill_value=fill).reshape(-1)


def top_k_indices(keys: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Ascending indices (int64, (k,)) of the k largest ``keys``; among keys equal to the k-th, the lowest."""
    n = keys.numel()
    kth = kth_largest_key(keys, k, bits)
    above = keys > kth
    slots = torch.arange(k, device=keys.device)
    ties_wanted = k - above.sum()
    ties = first_indices(keys == kth, k, n)
    merged = torch.cat([first_indices(above, k, n), torch.where(slots < ties_wanted, ties, n)])
    return merged.sort().values[:k]


def _compensate(
    flat: torch.Tensor, residual: torch.Tensor, finite: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
    momentum: float,
) -> None:
    """residual += grad (or DGC momentum correction u = m u + g; residual += u) at the finite entries only: the
    non-finite rule of ops.compensate_nonfinite, which is the reference's own update where the gradient is
    finite (same operations in the same order, so the same bits)."""
    clean = torch.where(finite, flat, torch.zeros((), dtype=flat.dtype, device=flat.device)).to(residual.dtype)
    if momentum_buffer is None:
        residual.add_(clean)
        return
    momentum_buffer.copy_(torch.where(finite, momentum_buffer * momentum + clean, momentum_buffer))
    residual.add_(torch.where(finite, momentum_buffer, torch.zeros((), dtype=residual.dtype, device=flat.device)))


def compensate_and_select(
    grad: torch.Tensor,
    residual: torch.Tensor,
    k: int,
    wire_dtype: torch.dtype,
    momentum_buffer: Optional[torch.Tensor] = None,
    momentum: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step of ``ops.compensate_nonfinite`` followed, for a finite gradient, by ``ops.compensate_and_select``
    (same arguments, same results bit for bit, ties aside), with no host synchronisation.

    Returns (indices int32 (k,), values ``wire_dtype`` (k,), nonfinite): ``nonfinite`` is a 0-dim int64 tensor on
    the device, 1 when the gradient had NaN/Inf entries (then those were sent, the first k of them with the first
    repeated in the remaining slots, and the residual holds only the finite entries' compensation), else 0.
    """
    flat = grad.reshape(-1)
    n = flat.numel()
    if residual.dtype not in _KEY:
        raise ValueError(f"horovod-topk: the residual must be float32 or float64, not {residual.dtype}")
    if not 1 <= k <= n:
        raise ValueError(f"horovod-topk: k={k} is outside 1..{n} for a tensor of {n} elements")
    finite = torch.isfinite(flat)
    _compensate(flat, residual, finite, momentum_buffer, momentum)

    _, bits = _KEY[residual.dtype]
    indices = top_k_indices(magnitude_keys(residual), k, bits)
    picked = residual.index_select(0, indices)
    values = ops.to_wire(picked, wire_dtype)  # clamped to the wire's range: never an Inf into the residual

    # The non-finite case, decided on the device: the first k non-finite entries, the first one repeated.
    bad = ~finite
    bad_count = bad.sum()
    bad_indices = first_indices(bad, k, 0)
    bad_indices = torch.where(torch.arange(k, device=flat.device) < bad_count, bad_indices, bad_indices[:1])
    nonfinite = bad_count > 0

    # Sent entries leave the residual (keeping the wire dtype's rounding) and the momentum buffer (DGC's
    # momentum-factor masking); with a non-finite gradient nothing leaves: the same entries are written back.
    residual.index_copy_(0, indices, torch.where(nonfinite, picked, picked - values.to(residual.dtype)))
    if momentum_buffer is not None:
        kept = momentum_buffer.index_select(0, indices)
        momentum_buffer.index_copy_(0, indices, torch.where(nonfinite, kept, torch.zeros_like(kept)))
    bad_values = flat.index_select(0, bad_indices).to(residual.dtype).to(wire_dtype)
    return (
        torch.where(nonfinite, bad_indices, indices).to(torch.int32),
        torch.where(nonfinite, bad_values, values),
        nonfinite.to(torch.int64),
    )
