"""Per-tensor decisions: dense or Top-K, and how many entries.

Pure functions of (configuration, tensor size, dtype kind): every rank computes the same answer without talking
to the others, which is what keeps the collectives matched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .config import MAX_COMPRESSED_NUMEL, TopKConfig

__all__ = ["TensorPlan", "selected_count", "plan_tensor"]


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor on one step.

    ``k`` is None when the tensor goes dense; ``reason`` says why, for logs and ``stats()``.
    """

    numel: int
    k: Optional[int]
    reason: str

    @property
    def compressed(self) -> bool:
        return self.k is not None


def selected_count(numel: int, config: TopKConfig) -> int:
    """k for a tensor of ``numel`` elements: ceil(ratio * numel), or the fixed k, never more than numel nor < 1."""
    if numel < 1:
        raise ValueError(f"cannot select entries of an empty tensor (numel={numel})")
    if config.k is not None:
        return min(config.k, numel)
    # The small epsilon keeps ratio * numel that is an integer up to float rounding (0.01 * 300 = 3.0000000000000004)
    # from being rounded up to one entry more.
    return max(1, min(numel, math.ceil(config.ratio * numel - 1e-9)))


def plan_tensor(name: str, numel: int, is_floating: bool, config: TopKConfig) -> TensorPlan:
    """Decide how the tensor called ``name`` travels.

    Non-floating tensors (integer counters, masks) and tensors under ``config.min_numel`` go dense. A tensor too
    large for int32 indices is refused with an error that names it.
    """
    if not is_floating:
        return TensorPlan(numel, None, "not floating point")
    if numel == 0:
        return TensorPlan(numel, None, "empty")
    if numel < config.min_numel:
        return TensorPlan(numel, None, f"smaller than min_numel={config.min_numel}")
    if numel > MAX_COMPRESSED_NUMEL:
        raise ValueError(
            f"tensor {name!r} has {numel} elements; Top-K payloads index with int32, so a compressed tensor must "
            f"have at most {MAX_COMPRESSED_NUMEL}: split it into several smaller parameters."
        )
    return TensorPlan(numel, selected_count(numel, config), "top-k")
