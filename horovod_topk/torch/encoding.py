"""The compact wire encoding (core.payload): 16-bit segmented indices and float8 values with a per-payload scale.

encode   sorted (index, value) pairs of one rank -> its payload; float8 rounding goes back into the residual
decode   the gathered payloads of P ranks -> (indices, values) as int64 / float32 (P, k), for ops.scatter_sum

Pure tensor functions with no host synchronisation (the scale is chosen with ``torch.where``, counts with
``bincount``/``searchsorted``), so they run on the device a gradient lives on.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ..core.payload import FLOAT8_MAX, SEGMENT_BITS, PayloadLayout

__all__ = ["encode", "decode", "FLOAT8"]

#: The float8 format of value_dtype="float8": 4 exponent and 3 mantissa bits, no infinities, saturating casts.
FLOAT8 = torch.float8_e4m3fn
_SEGMENT_MASK = (1 << SEGMENT_BITS) - 1


def encode(indices: torch.Tensor, values: torch.Tensor, residual: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """One rank's payload of ``layout`` from its selected ``indices`` (int32/int64, k) and ``values`` (k).

    With float8 (``layout.scaled``) the values must be exact (the residual already had them removed); what float8
    cannot represent is added back into ``residual`` at those indices, so error feedback stays exact: new residual +
    sent == old residual + gradient. Non-finite values travel as NaN (e4m3 has no infinity; its casts saturate,
    which would turn an overflow into a finite number) and never enter the residual.
    """
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8, device=values.device)
    indices = indices.to(torch.int64)
    if layout.index_bits == 16:  # segments need the entries in index order
        order = torch.argsort(indices)
        indices, values = indices[order], values[order]
        # index_add_, not bincount: bincount sizes its output from the data, which waits for a GPU
        counts = torch.zeros(layout.segments, dtype=torch.int32, device=indices.device)
        counts.index_add_(0, indices >> SEGMENT_BITS, torch.ones_like(indices, dtype=torch.int32))
        buf[layout.counts_offset:layout.indices_offset].view(torch.int32).copy_(counts)
        offsets = indices & _SEGMENT_MASK
        # int16 holds the offsets 32768..65535 as negatives; decode masks them back
        offsets = torch.where(offsets >= 1 << 15, offsets - (1 << 16), offsets)
        buf[layout.indices_offset:layout.indices_end].view(torch.int16).copy_(offsets)
    else:
        buf[layout.indices_offset:layout.indices_end].view(torch.int32).copy_(indices)
    if layout.scaled:
        exact = values.to(residual.dtype)
        finite = torch.isfinite(exact)
        largest = torch.where(finite, exact.abs(), torch.zeros((), dtype=exact.dtype, device=exact.device)).max()
        scale = torch.where(largest > 0, largest / FLOAT8_MAX, torch.ones((), dtype=exact.dtype, device=exact.device))
        # clipped: largest / scale can round a hair above 448, and casts past it are not saturating everywhere
        scaled = torch.where(finite, (exact / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX),
                             torch.full((), float("nan"), dtype=exact.dtype, device=exact.device))
        wire = scaled.to(FLOAT8)
        back = wire.to(exact.dtype) * scale
        residual.index_add_(0, indices, torch.where(finite, exact - back, torch.zeros_like(exact)))
        buf[:4].view(torch.float32).copy_(scale.to(torch.float32).reshape(1))
        buf[layout.values_offset:layout.values_end].view(FLOAT8).copy_(wire)
    else:
        buf[layout.values_offset:layout.values_end].view(values.dtype).copy_(values)
    return buf


def decode(
    gathered: torch.Tensor, world_size: int, layout: PayloadLayout, value_dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values), each (P, k), from a gathered buffer of P payloads of ``layout``: float8 values come
    back as float32 (times their scale), others in ``value_dtype``."""
    rows = gathered.view(world_size, layout.nbytes)
    if layout.index_bits == 16:
        counts = rows[:, layout.counts_offset:layout.indices_offset].view(torch.int32).to(torch.int64)
        ends = counts.cumsum(1)
        position = torch.arange(layout.k, device=gathered.device).expand(world_size, layout.k).contiguous()
        segment = torch.searchsorted(ends, position, right=True)
        offsets = rows[:, layout.indices_offset:layout.indices_end].view(torch.int16).to(torch.int64) & _SEGMENT_MASK
        indices = (segment << SEGMENT_BITS) + offsets
    else:
        indices = rows[:, layout.indices_offset:layout.indices_end].view(torch.int32).to(torch.int64)
    values = rows[:, layout.values_offset:layout.values_end]
    if layout.scaled:
        scale = rows[:, :4].view(torch.float32)
        return indices, values.view(FLOAT8).to(torch.float32) * scale
    return indices, values.view(value_dtype)
