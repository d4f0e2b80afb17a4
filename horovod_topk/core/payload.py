"""The wire format of one compressed tensor: one packed byte buffer per tensor, so one allgather carries it.

Layout of a rank's payload (little-endian, as every platform Horovod runs on):

    [ k int32 indices | pad to the value size | k values | pad to 8 bytes ]

One buffer instead of two collectives halves the per-tensor latency and keeps indices and values of one rank
together. Shipping raw bytes (uint8) also lets values travel in dtypes Horovod's allgather does not know
(bfloat16). Every row of the gathered (P, nbytes) buffer starts 8-byte aligned, so the framework adapters can view
the indices and values of all ranks in place, without copies.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PayloadLayout", "INDEX_ITEMSIZE", "ALIGNMENT", "PayloadSizeMismatch"]

INDEX_ITEMSIZE = 4
ALIGNMENT = 8


def _align_up(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class PayloadSizeMismatch(RuntimeError):
    """Ranks sent payloads of different sizes for one tensor: they disagree on its shape or configuration."""


@dataclass(frozen=True)
class PayloadLayout:
    """Byte offsets of the indices and values of a k-entry payload with values of ``value_itemsize`` bytes."""

    k: int
    value_itemsize: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"a payload needs k >= 1, got {self.k}")
        if self.value_itemsize not in (1, 2, 4, 8):
            raise ValueError(f"value_itemsize must be 1, 2, 4 or 8 bytes, got {self.value_itemsize}")

    @property
    def indices_nbytes(self) -> int:
        return self.k * INDEX_ITEMSIZE

    @property
    def values_offset(self) -> int:
        return _align_up(self.indices_nbytes, max(self.value_itemsize, INDEX_ITEMSIZE))

    @property
    def values_nbytes(self) -> int:
        return self.k * self.value_itemsize

    @property
    def values_end(self) -> int:
        return self.values_offset + self.values_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes one rank hands to the allgather for this tensor."""
        return _align_up(self.values_end, ALIGNMENT)

    def check_gathered(self, tensor_name: str, gathered_nbytes: int, world_size: int) -> None:
        """Raise, on every rank alike, when the gathered buffer is not world_size payloads of this layout.

        Horovod's allgather accepts rows of different lengths, so a rank configured with another ratio, or holding
        a different shape under the same name, would otherwise be decoded as garbage. All ranks receive the same
        gathered size, so all of them raise together instead of some of them hanging.
        """
        if gathered_nbytes != world_size * self.nbytes:
            raise PayloadSizeMismatch(self.mismatch_message(tensor_name, world_size, gathered_nbytes))

    def mismatch_message(self, tensor_name: str, world_size: int, gathered_nbytes: object = "a different number of") -> str:
        return (
            f"horovod-topk: ranks disagree about tensor {tensor_name!r}: received {gathered_nbytes} payload bytes "
            f"from {world_size} ranks, but this rank expects {world_size} x {self.nbytes} (k={self.k}, "
            f"{self.value_itemsize}-byte values). Check that every rank uses the same TopKEF configuration and "
            f"the same model."
        )
