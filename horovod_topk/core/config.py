"""The one validated configuration object shared by the PyTorch and TensorFlow compressors.

Everything that decides *what* goes on the wire lives here, so that both frameworks (and every rank) take the same
decision from the same numbers. Validation happens at construction: a typo in a job's config must fail before
the first collective, not as a hang in the middle of one.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional

__all__ = ["TopKConfig", "MAX_COMPRESSED_NUMEL"]

#: Indices travel as int32 (4 bytes instead of 8 per selected entry), so a tensor compressed as one payload must
#: have fewer than 2**31 elements. Larger tensors are refused by name rather than silently wrapped.
MAX_COMPRESSED_NUMEL = 2**31 - 1


@dataclass(frozen=True)
class TopKConfig:
    """How much of each gradient to send.

    Args:
        ratio (float): fraction of each compressed tensor's entries sent per step, in (0, 1]; k = ceil(ratio * N).
            0.01 cuts the bytes handed to collectives ~50x (8 bytes per sent entry versus 4 per dense entry).
        k (int, optional): a fixed number of entries per tensor instead of a ratio (capped at the tensor's size).
            Fixed k keeps every rank's payload the same size, as ``ratio`` does too.
        min_numel (int): tensors with fewer elements go through Horovod's ordinary dense allreduce. Biases and
            norm scales are tiny; for them the latency of an extra collective costs more than the bytes saved,
            and dense tensors stay eligible for Horovod's tensor fusion.
    """

    ratio: float = 0.01
    k: Optional[int] = None
    min_numel: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise ValueError(f"ratio must be a number in (0, 1], got {self.ratio!r}")
        if not (math.isfinite(self.ratio) and 0.0 < self.ratio <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio!r}")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"k must be a positive integer (or None to use ratio), got {self.k!r}")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative integer, got {self.min_numel!r}")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TopKConfig":
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown TopKConfig option(s): {', '.join(sorted(unknown))}")
        return cls(**dict(values))

    def describe(self) -> str:
        """A short human-readable summary, used in error messages and logs."""
        amount = f"k={self.k}" if self.k is not None else f"ratio={self.ratio:g}"
        return f"TopKConfig({amount}, min_numel={self.min_numel})"
