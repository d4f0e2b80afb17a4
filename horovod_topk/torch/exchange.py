"""The seam between the selection and the wire: what an exchange of selected entries is handed.

``TopKEF.start_reduction`` compensates and selects (residual, momentum, non-finite handling, the fused kernel) and
packs the k entries into one payload; then the exchange the plan chose (core.exchange) carries it and returns a
handle that ``synchronize()`` calls for the dense reduced gradient. Each exchange is a module of its own
(the allgather: ``compressor.start_allgather``; the sparse allreduce: :mod:`.sparse_allreduce`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import torch

from ..core import PayloadLayout, TensorRecord

__all__ = ["ExchangeRequest"]


@dataclass
class ExchangeRequest:
    """One tensor's selected payload, ready to travel."""

    #: The tensor's name (collectives are named from it, core.naming).
    name: str
    #: This rank's packed k entries (core.payload layout ``layout``), uint8.
    payload: torch.Tensor
    layout: PayloadLayout
    wire_dtype: torch.dtype
    #: The gradient's flat buffer: the reduced gradient is written over it.
    out: torch.Tensor
    shape: Tuple[int, ...]
    #: What the sum over ranks is multiplied by (core.pending.reduction_scale).
    scale: float
    world_size: int
    process_set: Any
    #: The selection backend (torch.selection) that compressed it: decompresses an allgather's payloads.
    backend: Any
    #: The tensor's residual (flat, ops.residual_dtype) and record: an exchange that returns entries to the
    #: residual, or counts bytes, does it there.
    residual: torch.Tensor
    record: TensorRecord[torch.Tensor]
