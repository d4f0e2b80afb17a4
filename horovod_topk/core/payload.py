"""The wire format of one compressed tensor: one packed byte buffer per tensor, so one allgather carries it.

Layout of a rank's payload (little-endian, as every platform Horovod runs on):

    [ k int32 indices | pad to the value size | k values | pad to 8 bytes ]

or, with the compact options (TopKConfig.index_bits=16 and/or value_dtype="float8"):

    [ float32 scale, pad to 8 (float8 only) | S int32 counts (16-bit indices only) | k indices | pad | k values | pad ]

With 16-bit indices the tensor is cut into S = ceil(N / 65536) segments; the entries are sent sorted by index, each
as its offset within its segment, and ``counts[s]`` says how many belong to segment s, so a receiver recovers
index = 65536 * segment + offset. That halves the index bytes for 4 bytes per 65536 entries, and keeps the payload's
size fixed (k, N and the options alone decide it: no rank waits on a size it cannot predict). float8 values are
e4m3 numbers times the one scale of the tensor's payload (its largest finite magnitude / 448, e4m3's largest).

One buffer instead of two collectives halves the per-tensor latency and keeps indices and values of one rank
together. Shipping raw bytes (uint8) also lets values travel in dtypes Horovod's allgather does not know
(bfloat16). Every row of the gathered (P, nbytes) buffer starts 8-byte aligned, so the framework adapters can view
the indices and values of all ranks in place, without copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

__all__ = ["PayloadLayout", "INDEX_ITEMSIZE", "ALIGNMENT", "PayloadSizeMismatch", "SEGMENT_BITS", "FLOAT8_MAX",
           "float8_e4m3_values", "payload_layout"]

INDEX_ITEMSIZE = 4
ALIGNMENT = 8
#: 16-bit indices are offsets within segments of 2**SEGMENT_BITS entries.
SEGMENT_BITS = 16
#: The largest finite float8 e4m3 ("fn") number: a payload's scale maps its largest magnitude there.
FLOAT8_MAX = 448.0


def float8_e4m3_values() -> list:
    """The number each of the 256 float8 e4m3fn bytes stands for (sign bit, 4 exponent bits with bias 7, 3 mantissa
    bits; exponent 0 is subnormal; 0x7F and 0xFF are NaN; no infinities) -- the table a framework without a float8
    bitcast decodes with, so both frameworks put the same bytes on the wire."""
    values = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if byte & 0x7F == 0x7F:
            values.append(float("nan"))
        elif exponent == 0:
            values.append(sign * mantissa * 2.0 ** -9)
        else:
            values.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


def _align_up(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class PayloadSizeMismatch(RuntimeError):
    """Ranks sent payloads of different sizes for one tensor: they disagree on its shape or configuration."""


@dataclass(frozen=True)
class PayloadLayout:
    """Byte offsets of the parts of a k-entry payload with values of ``value_itemsize`` bytes.

    ``index_bits`` 16 (with ``numel``, the tensor's size) selects segmented 16-bit indices; ``scaled`` a float32
    scale in front (float8 values). The defaults are the plain layout. Immutable, so its offsets are computed
    once per layout (they are read for every member of every bucket on every step).
    """

    k: int
    value_itemsize: int
    numel: int = 0
    index_bits: int = 32
    scaled: bool = False

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"a payload needs k >= 1, got {self.k}")
        if self.value_itemsize not in (1, 2, 4, 8):
            raise ValueError(f"value_itemsize must be 1, 2, 4 or 8 bytes, got {self.value_itemsize}")
        if self.index_bits not in (16, 32):
            raise ValueError(f"index_bits must be 16 or 32, got {self.index_bits}")
        if self.index_bits == 16 and self.numel < self.k:
            raise ValueError(f"16-bit indices need the tensor's size (numel={self.numel}) to be at least k={self.k}")

    @cached_property
    def scale_nbytes(self) -> int:
        """The float32 scale of float8 values, padded to 8 bytes; 0 without."""
        return ALIGNMENT if self.scaled else 0

    @cached_property
    def segments(self) -> int:
        """How many 65536-entry segments carry a count (16-bit indices); 0 for int32 indices."""
        return -(-self.numel // (1 << SEGMENT_BITS)) if self.index_bits == 16 else 0

    @cached_property
    def counts_offset(self) -> int:
        return self.scale_nbytes

    @cached_property
    def index_itemsize(self) -> int:
        return self.index_bits // 8

    @cached_property
    def indices_offset(self) -> int:
        return self.counts_offset + 4 * self.segments

    @cached_property
    def indices_end(self) -> int:
        return self.indices_offset + self.k * self.index_itemsize

    @cached_property
    def indices_nbytes(self) -> int:
        return self.k * self.index_itemsize

    @cached_property
    def compact(self) -> bool:
        """Whether this is not the plain [int32 indices | values] layout."""
        return self.index_bits != 32 or self.scaled

    @cached_property
    def values_offset(self) -> int:
        return _align_up(self.indices_end, max(self.value_itemsize, self.index_itemsize))

    @cached_property
    def values_nbytes(self) -> int:
        return self.k * self.value_itemsize

    @cached_property
    def values_end(self) -> int:
        return self.values_offset + self.values_nbytes

    @cached_property
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
            f"{self.index_bits}-bit indices, {self.value_itemsize}-byte values). Check that every rank uses the same TopKEF configuration and "
            f"the same model."
        )


@lru_cache(maxsize=4096)
def payload_layout(k: int, numel: int, value_itemsize: int, index_bits: int = 32, scaled: bool = False) -> PayloadLayout:
    """The layout of a k-entry payload of an N-element tensor under the given options (see the module docstring).
    Remembered per arguments (layouts are immutable): every compressed tensor asks for its own on every step, and a
    new object would compute its offsets again each time."""
    return PayloadLayout(k, value_itemsize, numel if index_bits == 16 else 0, index_bits, scaled)
