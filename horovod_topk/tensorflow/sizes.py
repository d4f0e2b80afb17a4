"""The sizes one compressed step is built with, as functions of its k: Python ints when k is fixed, int32 scalars
looked up by step when the sparsity warm-up changes k from step to step inside one traced graph, or (the allgather
step's shared bodies, horovod_topk.tensorflow.steps) int32 scalars read from one row, whatever k and the size.

Why: a traced graph has fixed ops. The warm-up used to give each payload size its own ``tf.switch_case`` branch,
each a full copy of the compressed path (selection, packing, collective, decoding): 19x dense's first-step cost on
ResNet-50 (README, "First-step (tracing) cost"). TensorFlow's top_k, fills, reshapes and slices take their sizes
as tensors, and Horovod's allgather and alltoall accept a first dimension that changes between calls, so one copy
of the path serves every k when its sizes are looked up per step. Every rank looks up the same step of the same
table, so all payloads of a collective have the same size.

The sizes stay core's: the PayloadLayout, SparseAllreduceLayouts and sampled-selector geometry of each step's k
are computed in Python and tabulated, never re-derived in TensorFlow ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import tensorflow as tf

from ..core.config import TopKConfig
from ..core.exchange import SPARSE_ALLREDUCE, SparseAllreduceLayouts
from ..core.payload import PayloadLayout
from ..core.policy import sample_size, tensor_payload_layout
from . import ops

__all__ = ["StepLayout", "StepSparseLayouts", "RowLayout", "Sizes", "SizeOptions", "SizePlan", "ROW_FIELDS",
           "sizes_of_row", "fixed_plan", "step_plan"]


def _lookup(values: Sequence[int], step: tf.Tensor) -> tf.Tensor:
    """values[step] as an int32 scalar in the graph."""
    return tf.gather(tf.constant(list(values), tf.int32), step)


def _same(values: Sequence[object], what: str) -> object:
    distinct = set(values)
    if len(distinct) != 1:
        raise AssertionError(f"horovod-topk: {what} changes with k ({sorted(map(str, distinct))})")
    return distinct.pop()


def _warmup_mismatch_message(tensor_name: str, world_size: int, index_bits: int, value_itemsize: int) -> str:
    return (f"horovod-topk: ranks disagree about tensor {tensor_name!r}: the gathered payloads are not "
            f"{world_size} of this warm-up step's size ({index_bits}-bit indices, {value_itemsize}-byte "
            f"values). Check that every rank uses the same TopKEF configuration, the same model, and the same "
            f"step count (a checkpoint restored on some ranks only?).")


class _TensorLayout:
    """The fields of a PayloadLayout that the ops of horovod_topk.tensorflow.ops and .encoding read, where a size
    may be an int32 scalar tensor (StepLayout, RowLayout)."""

    value_itemsize: int
    index_bits: int
    scaled: bool
    scale_nbytes: int
    counts_offset: int
    index_itemsize: int
    compact: bool
    k: ops.Size
    numel: ops.Size
    segments: ops.Size
    indices_offset: ops.Size
    indices_end: ops.Size
    indices_nbytes: ops.Size
    values_offset: ops.Size
    values_nbytes: ops.Size
    values_end: ops.Size
    nbytes: ops.Size


class StepLayout(_TensorLayout):
    """A PayloadLayout whose k-dependent sizes are int32 scalars: the layout of ``layouts[step]``, for the ops
    of horovod_topk.tensorflow.ops and .encoding, which take either. The parts that depend on the tensor and the
    options only (index width, segments, scale) are plain ints, equal in every step's layout."""

    _FIXED = ("value_itemsize", "numel", "index_bits", "scaled", "scale_nbytes", "segments", "counts_offset",
              "index_itemsize", "indices_offset", "compact")
    _PER_STEP = ("k", "indices_end", "indices_nbytes", "values_offset", "values_nbytes", "values_end", "nbytes")

    def __init__(self, layouts: Sequence[PayloadLayout], step: tf.Tensor) -> None:
        for name in self._FIXED:
            setattr(self, name, _same([getattr(layout, name) for layout in layouts], name))
        for name in self._PER_STEP:
            setattr(self, name, _lookup([getattr(layout, name) for layout in layouts], step))

    def mismatch_message(self, tensor_name: str, world_size: int) -> str:
        return _warmup_mismatch_message(tensor_name, world_size, self.index_bits, self.value_itemsize)


class StepSparseLayouts:
    """SparseAllreduceLayouts of ``layouts[step]``: its ``send`` and ``kept`` as StepLayouts, its k and the bytes
    one rank hands to the collectives as int32 scalars."""

    def __init__(self, layouts: Sequence[SparseAllreduceLayouts], step: tf.Tensor) -> None:
        self.k = _lookup([layout.k for layout in layouts], step)
        self.send = StepLayout([layout.send for layout in layouts], step)
        self.kept = StepLayout([layout.kept for layout in layouts], step)
        self.sent_nbytes = _lookup([layout.sent_nbytes for layout in layouts], step)


class RowLayout(_TensorLayout):
    """A PayloadLayout whose sizes are int32 scalars read from a row of ROW_FIELDS (a tensor), and whose options
    are SizeOptions' plain values: the layout inside a body that serves tensors of every size. Unlike
    PayloadLayout's (0 for 32-bit indices), ``numel`` is always the tensor's size: the decoder's dense length."""

    def __init__(self, options: "SizeOptions", row: tf.Tensor) -> None:
        example = options.example
        for name in ("value_itemsize", "index_bits", "scaled", "scale_nbytes", "counts_offset", "index_itemsize",
                     "compact"):
            setattr(self, name, getattr(example, name))
        for position, name in enumerate(ROW_FIELDS):
            if name not in ("stride", "q"):
                setattr(self, name, row[position])


Layout = Union[PayloadLayout, StepLayout, RowLayout]
SparseLayouts = Union[SparseAllreduceLayouts, StepSparseLayouts]


@dataclass(frozen=True)
class Sizes:
    """What the compressed path of one tensor needs to know about k.

    ``k``: entries selected; ``layout``: the allgather payload's layout; ``sampling``: the sampled selector's
    (stride, q), None for the exact top-k; ``sparse``: the sparse allreduce's layouts (None under the allgather).
    """

    k: ops.Size
    layout: Layout
    sampling: ops.Sampling
    sparse: Optional[SparseLayouts]


def _sampling(config: TopKConfig, k: int, numel: int) -> Optional[Tuple[int, int]]:
    samples = sample_size(k, numel) if config.selector == "sampled" else 0
    return ops.sample_geometry(numel, k, samples)


@dataclass(frozen=True)
class SizeOptions:
    """What a plan's sizes do not change: the layout's options and whether the sampled selector is used.
    Hashable: the key of the bodies shared by every tensor and size (horovod_topk.tensorflow.steps)."""

    value_itemsize: int
    index_bits: int
    scaled: bool
    sampled: bool

    @property
    def example(self) -> PayloadLayout:
        """A one-entry PayloadLayout with these options: the source of the parts of a layout k does not change."""
        return PayloadLayout(1, self.value_itemsize, 1, self.index_bits, self.scaled)


#: The sizes of one step as one int32 row (SizePlan.row): k, the sampled selector's geometry, the tensor's size
#: and the layout's size-dependent offsets (int32, like the sizes TensorFlow's ops take).
ROW_FIELDS = ("k", "stride", "q", "numel", "segments", "indices_offset", "indices_end", "indices_nbytes",
              "values_offset", "values_nbytes", "values_end", "nbytes")


def sizes_of_row(options: SizeOptions, row: tf.Tensor) -> Sizes:
    """The Sizes of one row (SizePlan.row): every size an int32 scalar of the row, so that one trace serves any k
    and any tensor size."""
    sampling = (row[1], row[2]) if options.sampled else None
    return Sizes(row[0], RowLayout(options, row), sampling, None)


@dataclass(frozen=True)
class SizePlan:
    """Every size a tensor's compressed path needs, for each step it serves, as plain values.

    Why plain values: the allgather step's shared bodies (horovod_topk.tensorflow.steps) key their one trace on
    :attr:`options` and read everything else from :meth:`row`, an int32 tensor, so one trace serves every size and
    warm-up step; the sparse allreduce builds its ops from :meth:`at`'s Sizes.

    ``ks``: the entries selected at each step (one entry when k is fixed); ``layouts``: the allgather payload's
    PayloadLayout per step; ``sampling``: the sampled selector's (stride, q) per step (None: the exact top-k);
    ``sparse``: the sparse allreduce's layouts per step, None under the allgather.
    """

    ks: Tuple[int, ...]
    layouts: Tuple[PayloadLayout, ...]
    sampling: Tuple[Optional[Tuple[int, int]], ...]
    sparse: Optional[Tuple[SparseAllreduceLayouts, ...]]

    @property
    def per_step(self) -> bool:
        """Whether k changes with the step (a warm-up), i.e. :meth:`at` needs the step."""
        return len(self.ks) > 1

    def at(self, step: Optional[tf.Tensor]) -> Sizes:
        """The sizes of ``step`` (an int32 scalar; None for a plan whose k never changes): Python ints when k is
        fixed, int32 scalars looked up by step otherwise."""
        if not self.per_step:
            sparse = self.sparse[0] if self.sparse is not None else None
            return Sizes(self.ks[0], self.layouts[0], self.sampling[0], sparse)
        assert step is not None, "a plan whose k changes with the step needs the step"
        sampling = None
        if self.sampling[0] is not None:
            sampling = (_lookup([g[0] for g in self.sampling], step),  # type: ignore[index]
                        _lookup([g[1] for g in self.sampling], step))  # type: ignore[index]
        sparse = StepSparseLayouts(self.sparse, step) if self.sparse is not None else None
        return Sizes(_lookup(self.ks, step), StepLayout(self.layouts, step), sampling, sparse)

    @property
    def options(self) -> SizeOptions:
        first = self.layouts[0]
        return SizeOptions(first.value_itemsize, first.index_bits, first.scaled, self.sampling[0] is not None)

    def row(self, step: Optional[tf.Tensor], numel: int) -> tf.Tensor:
        """The int32 row of ROW_FIELDS of ``step`` (a constant when k is fixed; looked up by step otherwise)."""
        def field(name: str, k: int, geometry: Optional[Tuple[int, int]], layout: PayloadLayout) -> int:
            if name in ("stride", "q"):
                return (geometry or (0, 0))[name == "q"]
            return {"k": k, "numel": numel}.get(name, getattr(layout, name))

        rows = [[field(name, *entry) for name in ROW_FIELDS] for entry in zip(self.ks, self.sampling, self.layouts)]
        if not self.per_step:
            return tf.constant(rows[0], tf.int32)
        assert step is not None, "a plan whose k changes with the step needs the step"
        return tf.gather(tf.constant(rows, tf.int32), step)

    def mismatch_message(self, tensor_name: str, world_size: int) -> str:
        """What the payload-size check says when ranks disagree (core.payload's message, or StepLayout's)."""
        if not self.per_step:
            return self.layouts[0].mismatch_message(tensor_name, world_size)
        return _warmup_mismatch_message(tensor_name, world_size, self.layouts[0].index_bits,
                                        self.layouts[0].value_itemsize)


def fixed_plan(config: TopKConfig, k: int, numel: int, value_itemsize: int, world_size: int,
               exchange: str) -> SizePlan:
    """The plan of a tensor whose k never changes: its sizes are Python ints, the graph holds static shapes."""
    sparse = (SparseAllreduceLayouts(k, world_size, value_itemsize, numel),) if exchange == SPARSE_ALLREDUCE else None
    return SizePlan((k,), (tensor_payload_layout(config, k, numel, value_itemsize),), (_sampling(config, k, numel),),
                    sparse)


def step_plan(config: TopKConfig, counts: Sequence[int], numel: int, value_itemsize: int, world_size: int,
              exchange: str) -> SizePlan:
    """The plan of a warm-up in which step t selects ``counts[t]`` entries.

    Steps with count 0 go dense on another branch: their rows hold the last count's sizes, never used. With the
    sampled selector every row samples (a k == numel step too: its threshold is then the smallest sampled
    magnitude, whose candidates, or the exact fallback, are all entries), so the selection is one path."""
    filler = next(k for k in reversed(counts) if k)
    ks = tuple(k or filler for k in counts)
    if config.selector == "sampled":
        sampling: Tuple[Optional[Tuple[int, int]], ...] = tuple(_sampling(config, k, numel) or (1, numel) for k in ks)
    else:
        sampling = tuple(None for _ in ks)
    sparse = None
    if exchange == SPARSE_ALLREDUCE:
        sparse = tuple(SparseAllreduceLayouts(k, world_size, value_itemsize, numel) for k in ks)
    return SizePlan(ks, tuple(tensor_payload_layout(config, k, numel, value_itemsize) for k in ks), sampling, sparse)
