"""Error-feedback Top-K for a whole group of float32 tensors at once, in a handful of Triton kernels.

Why a second device path: device_select does one tensor with ~170 small torch ops. Measured on an H100
(benchmarks/bench_compress.py --device cuda, torch 2.11): ResNet-50's 55 weight tensors take 62.5 ms to compress
that way, 13x *slower* than ``torch.topk`` over the same tensors (4.9 ms), because the host spends ~7 us
launching each of ~9,000 small kernels; even one 25M tensor takes 3.2 ms. What costs on a GPU is the number of
launches and of passes over memory, so this path does the same exact selection for all the tensors of a group in
~10 launches, whatever their number, and reads each element about five times:

1. ``_compensate_kernel``: residual += gradient at the finite entries (the non-finite rule), counts non-finite
   entries per tensor, and the histogram of the top 8 magnitude bits (the exponent) per tensor (one pass,
   residual written).
2. ``_choose_kernel`` per tensor: the bucket that holds the k-th largest magnitude, from the histogram counted
   from the top; the prefix (the magnitude bits found so far) and the rank still wanted stay on the device.
3. ``_histogram_kernel`` three times more (8, 8 and 7 bits) among the entries that share the prefix, each
   followed by ``_choose_kernel``: after four rounds the prefix *is* the k-th largest magnitude's bits, exactly,
   and the rank left is how many entries equal to it are wanted (ties: the lowest indices, as device_select).
4. ``_count_kernel``: per block of entries, how many are above the k-th and how many equal it; an exclusive scan
   of those counts (torch, over the ~n/4096 blocks) gives each block where its entries go.
5. ``_write_kernel``: every selected entry is written straight to its place in its tensor's payload (ascending
   indices, as the other paths send them), its value rounded to the wire dtype, and that rounding left in the
   residual. A tensor whose gradient had NaN/Inf instead sends its first k non-finite entries (the first one
   repeated in the slots left: ``_repeat_first_kernel``) and keeps its residual, as ops.compensate_nonfinite.

Blocks never straddle two tensors (a block table built once per group layout, as multi-tensor kernels do), so a
block's tensor is one load. All payloads of a group live in one uint8 buffer, each at an 8-byte aligned offset,
in the same plain layout as ``ops.pack``: every tensor's payload is a view of it. Nothing here waits for the
device: every size is fixed by the layout, and the counts stay on the device.

``accumulate`` is the decompression for the same group: the P gathered payload buffers are added rank after rank
(one launch per rank, no atomics), so every rank sums in the same order and gets the same bits (an atomic
``index_add_`` on a GPU adds in whatever order the threads arrive).

The same kernels run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``): that is how CI checks them
bit for bit against device_select and the reference, and scripts/gpu_check.sh checks them again on a GPU.
Limits (the caller falls back to device_select, tensor by tensor): float32 residuals (gradients in float32,
float16 or bfloat16), the plain payload layout (32-bit indices, no scale), no DGC momentum buffer, tensors below
2**31 elements.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ..core.payload import ALIGNMENT, PayloadLayout

__all__ = ["GroupLayout", "compensate_and_select", "accumulate", "supports", "WIRE_DTYPES"]

# Tuning, measured on an H100 over ResNet-50's 55 weight tensors at ratio 0.01 (benchmarks/bench_triton_kernels.py,
# the kernels alone): placing selected entries costs a scan per program, 0.30 ms with 4096 entries per program,
# 0.16 ms with 1024, 0.13 ms with 512 (but counting them then costs more); in the later histogram rounds, atomics
# for blocks with at most 256 entries in the prefix's bucket took the three rounds from 0.31 to 0.20 ms, while
# allowing 1024 took 0.97 ms (contention). Whole compress: 1.05 ms before, 0.74 ms with these values.
BLOCK = 4096  # entries per program in the histogram passes
SCAN_BLOCK = 1024  # entries per program where selected entries are counted and placed
FEW = 256  # later rounds: a block with at most this many entries in the prefix's bucket uses atomics
WARPS = {"compensate": 8, "histogram": 4, "count": 8, "write": 8}  # warps per program, per kernel
_BINS = 256  # 8 bits per round
_CHUNK = 1024
_ROUNDS = ((23, 8), (15, 8), (7, 8), (0, 7))  # (lowest bit, width) of the 31 magnitude bits of a float32
WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supports(grad: torch.Tensor, residual: torch.Tensor, layout: PayloadLayout, wire_dtype: torch.dtype,
             momentum_buffer: object) -> bool:
    """Whether this path can do a tensor (else device_select does it)."""
    return (grad.dtype in WIRE_DTYPES and residual.dtype == torch.float32 and not layout.compact
            and wire_dtype in WIRE_DTYPES and momentum_buffer is None and grad.numel() < (1 << 31))


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` to nearest even, as torch's ``.to(dtype)``, NaN as torch writes it.
    bfloat16 is rounded by hand: the GPU's conversion does round to nearest even, Triton's interpreter truncates,
    and the two must agree; NaN bits are set explicitly, since each converter has its own."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        upper = tl.where(x != x, 0x7FC0, upper)  # torch's bfloat16 NaN
        return upper.to(tl.int16).to(tl.bfloat16, bitcast=True)
    if dtype == tl.float16:
        nan = tl.full(x.shape, 0x7FFF, tl.int16).to(tl.float16, bitcast=True)  # torch's float16 NaN
        return tl.where(x != x, nan, x.to(tl.float16))
    return x.to(dtype)


@triton.jit
def _clamp_to(x, dtype: tl.constexpr):
    """float32 ``x`` within ``dtype``'s largest finite magnitude where it is finite (ops.to_wire: a larger value
    would travel as an Inf and leave an Inf in the residual; clamped, the excess stays there)."""
    if dtype == tl.float16:
        return tl.where(x - x == 0, tl.minimum(tl.maximum(x, -65504.0), 65504.0), x)
    if dtype == tl.bfloat16:
        limit = 3.3895313892515355e38
        return tl.where(x - x == 0, tl.minimum(tl.maximum(x, -limit), limit), x)
    return x


@triton.jit
def _block_of(block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, BLOCK: tl.constexpr):
    """(block, its tensor, where the tensor starts in the group, positions within the tensor, which are inside):
    positions are int32 within a tensor, so per-lane address arithmetic stays 32-bit."""
    b = tl.program_id(0)
    seg = tl.load(block_seg_ptr + b)
    local = tl.load(block_start_ptr + b) + tl.arange(0, BLOCK)
    return b, seg, tl.load(seg_start_ptr + seg), local, local < tl.load(seg_numel_ptr + seg)


@triton.jit
def _add_histogram(hist_ptr, seg, bucket, in_bucket, BINS: tl.constexpr):
    """Adds this block's counts of ``bucket`` (where ``in_bucket``) to the tensor's row of the histogram: counted
    in the block first, then one atomic add per non-empty bin. (Why 256 bins and not AIR top-k's 2048: Triton's
    block histogram costs about in proportion to its bins; measured on an H100 over 25M entries, 0.08 ms with 256
    bins, 0.61 ms with 2048, against 0.07 ms for a plain pass, and one atomic per entry instead took 6.4 ms.)"""
    counts = tl.histogram(bucket, BINS, mask=in_bucket)
    bins = tl.arange(0, BINS)
    tl.atomic_add(hist_ptr + seg * BINS + bins, counts, mask=counts > 0)


@triton.jit
def _compensate_kernel(grad_ptr, resid_ptr, block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, hist_ptr,
                       bad_ptr, BLOCK: tl.constexpr, LOW: tl.constexpr, BINS: tl.constexpr):
    b, seg, base, local, inside = _block_of(block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, BLOCK)
    grad_ptr, resid_ptr = grad_ptr + base, resid_ptr + base
    g = tl.load(grad_ptr + local, mask=inside, other=0.0).to(tl.float32)  # half precision: exactly
    r = tl.load(resid_ptr + local, mask=inside, other=0.0)
    finite = (g == g) & (tl.abs(g) != float("inf"))
    r = r + tl.where(finite, g, 0.0)
    tl.store(resid_ptr + local, r, mask=inside)
    bad = tl.sum((inside & ~finite).to(tl.int32), axis=0)
    tl.atomic_add(bad_ptr + seg, bad, mask=bad > 0)
    key = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    _add_histogram(hist_ptr, seg, key >> LOW, inside, BINS)


@triton.jit
def _histogram_kernel(resid_ptr, block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, prefix_ptr, hist_ptr,
                      BLOCK: tl.constexpr, LOW: tl.constexpr, WIDTH: tl.constexpr, BINS: tl.constexpr,
                      FEW: tl.constexpr):
    """A later round: only entries that share the prefix count. A block with at most FEW of them (the usual
    case: the prefix is the k-th largest's bucket) adds them with one atomic each, which costs little for few
    entries; a block with many (ties, runs of equal or zero entries) builds its histogram first, because many
    atomics on one bin serialise."""
    b, seg, base, local, inside = _block_of(block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, BLOCK)
    key = tl.load(resid_ptr + base + local, mask=inside, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    shares_prefix = inside & ((key >> (LOW + WIDTH)) == tl.load(prefix_ptr + seg))
    bucket = (key >> LOW) & ((1 << WIDTH) - 1)
    if tl.sum(shares_prefix.to(tl.int32), axis=0) > FEW:
        _add_histogram(hist_ptr, seg, bucket, shares_prefix, BINS)
    else:
        tl.atomic_add(hist_ptr + seg * BINS + bucket, 1, mask=shares_prefix, sem="relaxed")


@triton.jit
def _choose_kernel(hist_ptr, remaining_ptr, prefix_ptr, WIDTH: tl.constexpr, BINS: tl.constexpr):
    """One program per tensor: the bucket holding the entry of rank ``remaining`` counted from the largest; the
    rank within that bucket replaces ``remaining``, the bucket's bits are appended to ``prefix``, and the
    histogram row is zeroed for the next round."""
    seg = tl.program_id(0)
    j = tl.arange(0, BINS)
    row = hist_ptr + seg * BINS
    from_top = tl.load(row + (BINS - 1 - j))  # bucket BINS-1-j
    at_or_above = tl.cumsum(from_top, axis=0)
    remaining = tl.load(remaining_ptr + seg)
    steps = tl.sum((at_or_above < remaining).to(tl.int32), axis=0)
    above = tl.sum(tl.where(j < steps, from_top, 0), axis=0)
    tl.store(remaining_ptr + seg, remaining - above)
    tl.store(prefix_ptr + seg, (tl.load(prefix_ptr + seg) << WIDTH) | (BINS - 1 - steps))
    tl.store(row + j, tl.zeros_like(from_top))


@triton.jit
def _selected(resid_ptr, grad_ptr, seg, local, inside, kth_ptr, bad_ptr):
    """(first, tie, bad): the entries sent before any tie (above the k-th magnitude; for a tensor with NaN/Inf,
    its non-finite gradient entries), the entries equal to the k-th, and whether the tensor is non-finite."""
    bad = tl.load(bad_ptr + seg) > 0
    key = tl.load(resid_ptr + local, mask=inside, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    kth = tl.load(kth_ptr + seg)
    g = tl.load(grad_ptr + local, mask=inside & bad, other=0.0).to(tl.float32)  # read only for a non-finite tensor
    nonfinite = inside & bad & ~((g == g) & (tl.abs(g) != float("inf")))
    first = tl.where(bad, nonfinite, inside & (key > kth))
    tie = inside & ~bad & (key == kth)
    return first, tie, bad


@triton.jit
def _count_kernel(resid_ptr, grad_ptr, block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, kth_ptr, bad_ptr,
                  counts_ptr, blocks, BLOCK: tl.constexpr):
    b, seg, base, local, inside = _block_of(block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, BLOCK)
    first, tie, bad = _selected(resid_ptr + base, grad_ptr + base, seg, local, inside, kth_ptr, bad_ptr)
    tl.store(counts_ptr + b, tl.sum(first.to(tl.int32), axis=0))
    tl.store(counts_ptr + blocks + b, tl.sum(tie.to(tl.int32), axis=0))


@triton.jit
def _write_kernel(resid_ptr, grad_ptr, block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, kth_ptr,
                  bad_ptr, wanted_ptr, k_ptr, before_ptr, blocks, index_ptr, index_at_ptr, value_ptr, value_at_ptr,
                  BLOCK: tl.constexpr):
    b, seg, base, local, inside = _block_of(block_seg_ptr, block_start_ptr, seg_start_ptr, seg_numel_ptr, BLOCK)
    grad_ptr, resid_ptr = grad_ptr + base, resid_ptr + base
    first, tie, bad = _selected(resid_ptr, grad_ptr, seg, local, inside, kth_ptr, bad_ptr)
    # both ranks from one scan: "first" counts in the low 16 bits, ties in the high ones (a block has < 2**16)
    both = first.to(tl.int32) | (tie.to(tl.int32) << 16)
    before_here = tl.cumsum(both, axis=0) - both
    first_rank = tl.load(before_ptr + b) + (before_here & 0xFFFF)
    tie_rank = tl.load(before_ptr + blocks + b) + (before_here >> 16)
    wanted = tl.load(wanted_ptr + seg)
    # place in the ascending payload: entries before this one that are sent (all "first", the wanted ties)
    place = first_rank + tl.minimum(tie_rank, wanted)
    send = (first & (first_rank < tl.load(k_ptr + seg))) | (tie & (tie_rank < wanted))
    r = tl.load(resid_ptr + local, mask=inside, other=0.0)
    g = tl.load(grad_ptr + local, mask=inside & bad, other=0.0).to(tl.float32)
    wire: tl.constexpr = value_ptr.dtype.element_ty
    value = _round_to(tl.where(bad, g, _clamp_to(r, wire)), wire)
    tl.store(index_ptr + tl.load(index_at_ptr + seg) + place, local, mask=send)
    tl.store(value_ptr + tl.load(value_at_ptr + seg) + place, value, mask=send)
    tl.store(resid_ptr + local, r - value.to(tl.float32), mask=send & ~bad)


@triton.jit
def _repeat_first_kernel(bad_ptr, k_ptr, index_ptr, index_at_ptr, value_ptr, value_at_ptr, CHUNK: tl.constexpr):
    """A non-finite tensor with fewer than k non-finite entries repeats the first one in the slots left (grid:
    tensors x chunks of the largest k)."""
    seg = tl.program_id(0)
    k = tl.load(k_ptr + seg)
    bad = tl.load(bad_ptr + seg)
    slots = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    fill = (bad > 0) & (slots >= bad) & (slots < k)
    index_row = index_ptr + tl.load(index_at_ptr + seg)
    value_row = value_ptr + tl.load(value_at_ptr + seg)
    # copies of slot 0 by loading it in every lane (arithmetic on a NaN would give the GPU's canonical NaN)
    first = tl.zeros_like(slots)
    tl.store(index_row + slots, tl.load(index_row + first, mask=fill), mask=fill)
    tl.store(value_row + slots, tl.load(value_row + first, mask=fill), mask=fill)


@triton.jit
def _accumulate_kernel(index_ptr, value_ptr, index_at_ptr, value_at_ptr, block_seg_ptr, block_start_ptr, k_ptr,
                       seg_start_ptr, out_ptr, scale, BLOCK: tl.constexpr):
    """out[tensor offset + index] += (value * scale rounded to the wire dtype) for one rank's payloads; within one
    rank a tensor's indices are distinct, so no two lanes touch the same element."""
    b = tl.program_id(0)
    seg = tl.load(block_seg_ptr + b)
    slots = tl.load(block_start_ptr + b) + tl.arange(0, BLOCK)
    inside = slots < tl.load(k_ptr + seg)
    index = tl.load(index_ptr + tl.load(index_at_ptr + seg) + slots, mask=inside, other=0)
    value = tl.load(value_ptr + tl.load(value_at_ptr + seg) + slots, mask=inside, other=0.0)
    scaled = _round_to(value.to(tl.float32) * scale, value_ptr.dtype.element_ty).to(tl.float32)
    at = out_ptr + tl.load(seg_start_ptr + seg) + index
    tl.store(at, tl.load(at, mask=inside, other=0.0) + scaled, mask=inside)


def _blocks(
    lengths: Sequence[int], block: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block table: (tensor of each block, first position of each block within its tensor), both int32, and each
    tensor's first block (int64)."""
    seg, start, first = [], [], []
    for s, n in enumerate(lengths):
        count = max(1, math.ceil(n / block))
        first.append(len(seg))
        seg += [s] * count
        start += [i * block for i in range(count)]
    return (torch.tensor(seg, dtype=torch.int32, device=device), torch.tensor(start, dtype=torch.int32, device=device),
            torch.tensor(first, dtype=torch.int64, device=device))


@dataclass(frozen=True)
class GroupLayout:
    """Everything about a group of tensors that stays fixed from step to step: sizes, k's, the block tables and
    where each tensor's payload lies in the group's buffer. Built once per group (it copies a few small tables
    to the device, the only host-to-device traffic of this path)."""

    numels: Tuple[int, ...]
    layouts: Tuple[PayloadLayout, ...]
    device: torch.device

    def __post_init__(self) -> None:
        if len(self.numels) != len(self.layouts) or not self.numels:
            raise ValueError("horovod-topk: a group needs one payload layout per tensor, and at least one tensor")
        itemsizes = {lay.value_itemsize for lay in self.layouts}
        if len(itemsizes) != 1 or any(lay.compact for lay in self.layouts):
            raise ValueError("horovod-topk: a group's payloads must share one plain layout (32-bit indices)")
        for n, lay in zip(self.numels, self.layouts):
            if not 1 <= lay.k <= n:
                raise ValueError(f"horovod-topk: k={lay.k} is outside 1..{n} for a tensor of {n} elements")
        dev = self.device
        starts = [0]
        for n in self.numels:
            starts.append(starts[-1] + n)
        at = [0]
        for lay in self.layouts:
            at.append(at[-1] + lay.nbytes)  # every nbytes is a multiple of ALIGNMENT: all offsets stay aligned
        assert all(a % ALIGNMENT == 0 for a in at)
        put = object.__setattr__
        put(self, "value_itemsize", self.layouts[0].value_itemsize)
        put(self, "numel", starts[-1])
        put(self, "starts", tuple(starts))
        put(self, "payload_at", tuple(at))
        put(self, "nbytes", at[-1])
        put(self, "seg_start", torch.tensor(starts[:-1], dtype=torch.int64, device=dev))
        put(self, "seg_numel", torch.tensor(self.numels, dtype=torch.int32, device=dev))
        put(self, "k", torch.tensor([lay.k for lay in self.layouts], dtype=torch.int64, device=dev))
        put(self, "index_at", torch.tensor([a // 4 for a in at[:-1]], dtype=torch.int64, device=dev))
        value_at = [(a + lay.values_offset) // self.value_itemsize for a, lay in zip(at, self.layouts)]
        put(self, "value_at", torch.tensor(value_at, dtype=torch.int64, device=dev))
        put(self, "blocks", _blocks(self.numels, BLOCK, dev)[:2])
        *scan_blocks, first_scan_block = _blocks(self.numels, SCAN_BLOCK, dev)
        put(self, "scan_blocks", tuple(scan_blocks))
        put(self, "first_scan_block", first_scan_block)
        entry_seg, entry_start, _ = _blocks([lay.k for lay in self.layouts], BLOCK, dev)
        put(self, "entry_block_seg", entry_seg)
        put(self, "entry_block_start", entry_start)

    def payloads(self, buffer: torch.Tensor) -> List[torch.Tensor]:
        """Each tensor's payload: a view of the group's buffer."""
        return [buffer[a:a + lay.nbytes] for a, lay in zip(self.payload_at, self.layouts)]


def _value_view(buffer: torch.Tensor, group: GroupLayout, wire_dtype: torch.dtype) -> torch.Tensor:
    if wire_dtype.itemsize != group.value_itemsize:
        raise ValueError(f"horovod-topk: {wire_dtype} values do not fit payloads of {group.value_itemsize}-byte values")
    return buffer.view(wire_dtype)


#: Triton's interpreter patches triton.language while it runs a kernel: two threads interpreting at once (a DDP hook
#: selecting the next bucket while a collective's callback adds the last one's payloads) break each other. Compiled
#: kernels launch from any thread as usual. Triton reads TRITON_INTERPRET at import, and so does this.
_INTERPRETER_LOCK = threading.Lock() if os.environ.get("TRITON_INTERPRET") == "1" else None


def _one_at_a_time(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as is, or under the interpreter, one thread at a time."""
    if _INTERPRETER_LOCK is None:
        return fn

    @functools.wraps(fn)
    def serialised(*args: Any, **kwargs: Any) -> Any:
        with _INTERPRETER_LOCK:
            return fn(*args, **kwargs)

    return serialised


@_one_at_a_time
def compensate_and_select(
    grad: torch.Tensor, residual: torch.Tensor, group: GroupLayout, wire_dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Error-feedback Top-K for every tensor of ``group`` at once.

    ``grad`` (float32, float16 or bfloat16) and ``residual`` (float32) are the group's tensors end to end (flat,
    ``group.numel`` elements; the residual updated in place). Returns (the group's payload buffer uint8,
    ``group.nbytes``; per tensor 1 if its gradient had NaN/Inf entries else 0, an int64 tensor on the device).
    Per tensor, the same payload bytes and residual as device_select.compensate_and_select + ops.pack.
    """
    if grad.dtype not in WIRE_DTYPES or residual.dtype != torch.float32:
        raise ValueError(f"horovod-topk: this path takes float32/float16/bfloat16 gradients and float32 residuals, "
                         f"not {grad.dtype}/{residual.dtype}")
    if grad.numel() != group.numel or residual.numel() != group.numel:
        raise ValueError(f"horovod-topk: the group holds {group.numel} elements; got a gradient of {grad.numel()} "
                         f"and a residual of {residual.numel()}")
    dev, tensors, blocks = grad.device, len(group.numels), group.blocks[0].numel()
    buffer = torch.zeros(group.nbytes, dtype=torch.uint8, device=dev)  # padding bytes zero, as ops.pack
    values = _value_view(buffer, group, wire_dtype)
    hist = torch.zeros(tensors * _BINS, dtype=torch.int32, device=dev)
    bad = torch.zeros(tensors, dtype=torch.int32, device=dev)
    prefix = torch.zeros(tensors, dtype=torch.int32, device=dev)
    remaining = group.k.to(torch.int32)
    table = (*group.blocks, group.seg_start, group.seg_numel)
    low, width = _ROUNDS[0]
    _compensate_kernel[(blocks,)](grad, residual, *table, hist, bad, BLOCK=BLOCK, LOW=low, BINS=_BINS,
                                  num_warps=WARPS["compensate"])
    _choose_kernel[(tensors,)](hist, remaining, prefix, WIDTH=width, BINS=_BINS)
    for low, width in _ROUNDS[1:]:
        _histogram_kernel[(blocks,)](residual, *table, prefix, hist, BLOCK=BLOCK, LOW=low, WIDTH=width, BINS=_BINS,
                                     FEW=FEW, num_warps=WARPS["histogram"])
        _choose_kernel[(tensors,)](hist, remaining, prefix, WIDTH=width, BINS=_BINS)
    kth, wanted = prefix, remaining  # the k-th largest magnitude's bits; how many entries equal to it are sent
    blocks, table = group.scan_blocks[0].numel(), (*group.scan_blocks, group.seg_start, group.seg_numel)
    counts = torch.empty(2, blocks, dtype=torch.int32, device=dev)  # per block: "first" entries; ties
    _count_kernel[(blocks,)](residual, grad, *table, kth, bad, counts, blocks, BLOCK=SCAN_BLOCK,
                             num_warps=WARPS["count"])
    # where each block's entries start within its tensor: an exclusive scan that restarts at every tensor (along
    # the rows' inner dimension: torch's scan along an outer dimension took 0.55 ms here)
    before = counts.cumsum(1) - counts
    before = (before - before.index_select(1, group.first_scan_block).index_select(1, group.scan_blocks[0]))
    before = before.to(torch.int32)
    indices = buffer.view(torch.int32)
    _write_kernel[(blocks,)](residual, grad, *table, kth, bad, wanted, group.k, before, blocks, indices,
                             group.index_at, values, group.value_at, BLOCK=SCAN_BLOCK, num_warps=WARPS["write"])
    chunks = math.ceil(max(lay.k for lay in group.layouts) / _CHUNK)
    _repeat_first_kernel[(tensors, chunks)](bad, group.k, indices, group.index_at, values, group.value_at,
                                            CHUNK=_CHUNK)
    return buffer, (bad > 0).to(torch.int64)


@_one_at_a_time
def accumulate(gathered: Sequence[torch.Tensor], group: GroupLayout, wire_dtype: torch.dtype, scale: float,
               out: torch.Tensor) -> None:
    """``out`` (flat float32, the group end to end) = the sum over ranks, in rank order, of each rank's payload
    values times ``scale`` (rounded to the wire dtype, as the other paths do) at their indices."""
    if out.dtype != torch.float32 or out.numel() != group.numel:
        raise ValueError(f"horovod-topk: the output must be float32 with {group.numel} elements")
    out.zero_()
    blocks = group.entry_block_seg.numel()
    for buffer in gathered:
        if buffer.numel() != group.nbytes:
            raise ValueError(f"horovod-topk: a gathered payload buffer has {buffer.numel()} bytes, the group's "
                             f"layout {group.nbytes}")
        _accumulate_kernel[(blocks,)](buffer.view(torch.int32), _value_view(buffer, group, wire_dtype),
                                      group.index_at, group.value_at, group.entry_block_seg,
                                      group.entry_block_start, group.k, group.seg_start, out, scale, BLOCK=BLOCK,
                                      enable_fp_fusion=False)  # an FMA would skip the product's rounding
