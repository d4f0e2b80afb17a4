"""The arithmetic of one sparse allreduce (core.exchange) over a bucket of tensors, with no collective in it.

Why a module of its own, and why vectorized: the arithmetic around the two collectives (sort this rank's entries
into per-owner blocks; sum what an owner received and keep its largest sums; build the dense result and return
what no owner kept) used to run member by member, some thirty tensor operations per member and step. On a bucket
of a ResNet-50 (55 compressed tensors) that was ~1,650 operations and, on the CPU, ten times the cost of one
elementwise pass over the model; on a GPU every operation is a launch. Here every member of a bucket lives in one
index space (member ``i``'s entry ``j`` is ``base[i] + j``), so each phase is a fixed number of operations per
bucket, plus a few per member where a member's own tensors (its residual, its output) are written. The geometry
(where each member's fields lie in the collectives' rows) depends only on the members' sizes, so it is computed once
per bucket layout and cached.

On the CPU, float32 members run the fused kernels instead (csrc/sparse_rounds.cpp, :class:`_FusedGroup`): one walk
over the entries per phase, the same bytes and results bit for bit (tests/pytorch/test_sparse_rounds.py), ~3x one
elementwise pass over the model per step where these torch operations cost ~8x (benchmarks/bench_sparse_rounds.py).

Each member keeps its own k, per-destination capacity and kept count, so a member's result does not depend on its
bucket-mates: a bucket of one is the per-tensor sparse allreduce. Within an owner's region the largest sums win,
non-finite sums first, ties to the lower index (a stable sort). On an accelerator nothing is filtered by a mask
(positions that must not be written go to a scratch slot, masked values are zeros), so the only host
synchronisations are the few of torch.unique and torch.bincount per bucket (their output sizes depend on the data),
not several per member. (Not yet measured on a GPU.)

Error feedback stays exact: entries over a destination's capacity go back to the sender's residual at once, an
owner keeps the rounding of each kept sum to the wire dtype, and after phase 2 each rank returns to its residual its
own sent entries that no owner kept; non-finite values never enter a residual.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..core import PayloadSizeMismatch
from ..core.exchange import HASH_MULTIPLIER, SparseAllreduceLayouts
from ..core.payload import PayloadLayout
from . import kernels, ops, selection
from .exchange import ExchangeRequest

__all__ = ["SparseRounds", "regions"]


def regions(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """core.exchange.region_of on a tensor of indices (int64 result)."""
    return (((indices.long() * HASH_MULTIPLIER) & 0xFFFFFFFF) * world_size) >> 32


def _take(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` for a 1-D source and int64 index: index_select, several times faster on the CPU than
    advanced indexing (which goes through the general N-d indexing iterator)."""
    return source.index_select(0, index)


def _offsets(sizes: Sequence[int]) -> List[int]:
    """[0, s0, s0 + s1, ...]: where each member starts, and the total last."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


@dataclass(frozen=True)
class _Member:
    """What the geometry of one member depends on (hashable: the cache key)."""

    k: int
    numel: int
    capacity: int
    kept: int
    send_at: int  # byte offset of its block in a row of the alltoall
    send_values: int  # byte offset of its values inside its block
    kept_at: int  # byte offset of its kept payload in a row of the allgather
    kept_values: int


def _field_positions(rows: int, width: int, at: Sequence[int], counts: Sequence[int], itemsize: int,
                     device: torch.device) -> torch.Tensor:
    """Element positions, in a flat view of itemsize-byte elements of (rows, width) bytes, of ``counts[i]`` fields
    starting at byte ``at[i]`` of every row: member-major, then row, then field (int64)."""
    parts = []
    for start, count in zip(at, counts):
        row = torch.arange(rows, dtype=torch.int64, device=device).unsqueeze(1) * (width // itemsize)
        parts.append((row + start // itemsize + torch.arange(count, dtype=torch.int64, device=device)).reshape(-1))
    return torch.cat(parts)


class _Geometry:
    """Where one group's members lie: in the bucket's index space, in the alltoall's rows and in the allgather's
    rows; made once per (members, world size, value size, device)."""

    def __init__(self, members: Tuple[_Member, ...], world_size: int, send_width: int, kept_width: int,
                 itemsize: int, device: torch.device) -> None:
        P = world_size
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        self.members = members
        self.k = [m.k for m in members]
        self.entry_starts = _offsets(self.k)
        self.base_list = _offsets([m.numel for m in members])
        #: The first index of each member in the bucket's index space, and the space's size (also the sentinel
        #: index of unused slots).
        self.base = as_tensor(self.base_list[:-1])
        self.total = self.base_list[-1]
        self.entry_member = torch.repeat_interleave(torch.arange(len(members), device=device), as_tensor(self.k))
        # per entry of this rank's payloads, in the member-major order phase 1 sorts them into: static, since every
        # member has exactly k entries (gathered here once: a gather from a per-member table costs ~1 ms per 250k
        # entries on the CPU, every step)
        self.entry_base = self.base[self.entry_member]
        self.capacity = as_tensor([m.capacity for m in members])
        self.entry_capacity = self.capacity[self.entry_member]
        self.kept = as_tensor([m.kept for m in members])
        self.kept_list = [m.kept for m in members]
        self.kept_bounds = _offsets(self.kept_list)
        #: Each slot of this rank's kept payloads: its member and its rank among the member's kept sums.
        self.own_member = torch.repeat_interleave(torch.arange(len(members), device=device), as_tensor(self.kept_list))
        self.own_rank = torch.cat([torch.arange(q, dtype=torch.int64, device=device) for q in self.kept_list])
        self.own_base = self.base[self.own_member]
        # phase 1: a member's block for owner o starts at element o * width / size + at / size of a row
        self.entry_send_index_at = as_tensor([m.send_at // 4 for m in members])[self.entry_member]
        self.entry_send_value_at = as_tensor([(m.send_at + m.send_values) // itemsize for m in members])[
            self.entry_member]
        # phase 2: every slot of every received block, member-major, then sender, then slot
        self.recv_index = _field_positions(P, send_width, [m.send_at for m in members],
                                           [m.capacity for m in members], 4, device)
        self.recv_value = _field_positions(P, send_width, [m.send_at + m.send_values for m in members],
                                           [m.capacity for m in members], itemsize, device)
        self.recv_member = torch.repeat_interleave(torch.arange(len(members), device=device),
                                                   as_tensor([P * m.capacity for m in members]))
        self.recv_base = self.base[self.recv_member]
        # phase 2's output: this rank's kept payload of every member (one row)
        self.own_index = _field_positions(1, kept_width, [m.kept_at for m in members], self.kept_list, 4, device)
        self.own_value = _field_positions(1, kept_width, [m.kept_at + m.kept_values for m in members],
                                          self.kept_list, itemsize, device)
        # phase 3: every owner's kept payload of every member, member-major, then owner, then slot
        self.gathered_sizes = [P * m.kept for m in members]
        self.gathered_starts = _offsets(self.gathered_sizes)
        self.gathered_index = _field_positions(P, kept_width, [m.kept_at for m in members], self.kept_list, 4,
                                               device)
        self.gathered_value = _field_positions(P, kept_width, [m.kept_at + m.kept_values for m in members],
                                               self.kept_list, itemsize, device)
        self.gathered_member = torch.repeat_interleave(torch.arange(len(members), device=device),
                                                       as_tensor(self.gathered_sizes))
        self.gathered_base = self.base[self.gathered_member]
        self.device = device
        self.itemsize = itemsize
        self._spare_marks: List[torch.Tensor] = []

    def marks(self) -> torch.Tensor:
        """An all-False flag per entry of the index space, plus the sentinel's: for marking which entries some owner
        kept. Give it back with :meth:`release_marks` after clearing what was set. Why kept between steps on the CPU:
        a fresh (total + 1)-byte buffer is page-faulted in every step, ~10 ms per 25M entries, where clearing only
        what was set costs ~1 ms; on an accelerator the caching allocator reuses the memory already. A pool, not one
        buffer: two flights of the same geometry may be in phase 3 at once (DDP's callbacks)."""
        if self._spare_marks:
            try:
                return self._spare_marks.pop()
            except IndexError:  # another thread took the last one
                pass
        return torch.zeros(self.total + 1, dtype=torch.bool, device=self.device)

    def release_marks(self, marks: torch.Tensor, set_at: Optional[torch.Tensor] = None) -> None:
        """Clear ``marks`` where :meth:`marks`' user set them (``set_at``; None: it cleared them itself) and keep
        it for the next step (CPU only)."""
        if self.device.type == "cpu":
            self._spare_marks.append(marks if set_at is None else marks.index_fill_(0, set_at, False))

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """The member table of the fused kernels (csrc/sparse_rounds.cpp, enum Field): per member k, numel,
        capacity, kept, its block's byte offset in an alltoall row and its values' offset in the block, the same
        two in an allgather row, its payload's values offset, its first index in the bucket's index space."""
        return torch.tensor([[m.k, m.numel, m.capacity, m.kept, m.send_at, m.send_values, m.kept_at, m.kept_values,
                              PayloadLayout(m.k, self.itemsize).values_offset, base]
                             for m, base in zip(self.members, self.base_list)], dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def _geometry(members: Tuple[_Member, ...], world_size: int, send_width: int, kept_width: int, itemsize: int,
              device: torch.device) -> _Geometry:
    return _Geometry(members, world_size, send_width, kept_width, itemsize, device)


def _index_template(rows: int, width: int, at: Sequence[int], counts: Sequence[int], device: torch.device
                    ) -> torch.Tensor:
    """(rows * width + 8) zero bytes whose index fields hold -1 (unused slots), with 8 scratch bytes at the end."""
    buf = torch.zeros(rows * width + 8, dtype=torch.uint8, device=device)
    for start, count in zip(at, counts):
        buf[: rows * width].view(rows, width)[:, start: start + 4 * count] = 0xFF
    return buf


def _scatter_into(buf: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor, keep: torch.Tensor,
                  values: torch.Tensor) -> None:
    """buf (flat bytes, 8 scratch bytes last) viewed as ``dtype``: write ``values`` at ``positions`` where ``keep``;
    the others go to the scratch slot (no filtering: no host synchronisation)."""
    view = buf.view(dtype)
    scratch = view.numel() - 1
    view.index_put_((torch.where(keep, positions, torch.full_like(positions, scratch)),), values.to(dtype))


def _add_to_residual(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, take: torch.Tensor) -> None:
    """residual[indices] += values where ``take`` and the value is finite (a non-finite value never enters a
    residual); the others add 0 at index 0."""
    values = values.to(residual.dtype)
    take = take & torch.isfinite(values)
    residual.index_add_(0, torch.where(take, indices, torch.zeros_like(indices)),
                        torch.where(take, values, torch.zeros_like(values)))


def _aligned(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` flat and contiguous, starting on an 8-byte boundary (its views as wider dtypes need that)."""
    buf = buf.reshape(-1).contiguous()
    return buf if buf.storage_offset() % 8 == 0 else buf.clone()


def _rank_within_members(member: torch.Tensor, priority: torch.Tensor, real: torch.Tensor, members: int
                         ) -> torch.Tensor:
    """The order that lists every member's entries together (members ascending) and, within a member, by
    ``priority`` (>= 0) descending, ties to the earlier position; entries not ``real`` last: a stable sort by
    priority, then a stable sort by member."""
    if priority.dtype == torch.float32:  # sorting 32-bit keys is several times faster than 64-bit ones here
        order = torch.argsort(0x7FFFFFFF - priority.view(torch.int32), stable=True)  # bits ascend with priority >= 0
    else:
        order = torch.argsort(priority, descending=True, stable=True)
    member = _take(torch.where(real, member, torch.full_like(member, members)), order)
    return _take(order, torch.argsort(member.to(_small_int(members + 1)), stable=True))


def _small_int(bound: int) -> torch.dtype:
    """The narrowest integer dtype that holds 0 .. ``bound``: sorts of narrow keys are much faster."""
    return torch.int16 if bound < 2**15 else torch.int32 if bound < 2**31 else torch.int64


def _members_where(mask: torch.Tensor, member: torch.Tensor, members: int) -> List[int]:
    """The members that have an entry in ``mask``: read on the CPU (free there), every member on an accelerator
    (reading would synchronise the host; a member without one then adds zeros)."""
    if mask.device.type != "cpu":
        return list(range(members))
    return torch.unique(member[mask]).tolist()


class _Group:
    """Members that share the wire dtype, the accumulation dtype and the device: one vectorized pass each phase."""

    def __init__(self, rounds: "SparseRounds", positions: Sequence[int]) -> None:
        self.positions = list(positions)  # the members' places in the bucket
        self.requests = [rounds.requests[i] for i in self.positions]
        first = self.requests[0]
        self.wire_dtype = first.wire_dtype
        self.acc_dtype = first.residual.dtype
        self.world_size = rounds.world_size
        self.itemsize = itemsize = torch.empty(0, dtype=self.wire_dtype).element_size()
        members = tuple(
            _Member(r.layout.k, r.out.numel(), rounds.layouts[i].send.k, rounds.layouts[i].kept.k,
                    rounds.send_offsets[i], rounds.layouts[i].send.values_offset, rounds.kept_offsets[i],
                    rounds.layouts[i].kept.values_offset)
            for i, r in zip(self.positions, self.requests))
        self.geometry = _geometry(members, rounds.world_size, rounds.send_offsets[-1], rounds.kept_offsets[-1],
                                  itemsize, first.out.device)
        self._gathered: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    # ---- phase 1 -------------------------------------------------------------------------------------------------
    def fill_send(self, buf: torch.Tensor) -> None:
        """Sort this rank's entries of every member into its blocks of ``buf`` (the alltoall's rows, flat, 8 scratch
        bytes last); entries over a block's capacity go back to their residual now."""
        geo, P = self.geometry, self.world_size
        unpacked = [ops.unpack(r.payload, 1, r.layout, r.wire_dtype) for r in self.requests]
        indices = torch.cat([i.reshape(-1) for i, _ in unpacked]).long()
        values = torch.cat([v.reshape(-1) for _, v in unpacked])
        key = geo.entry_member * P + regions(indices, P)  # member-major, then owner
        order = torch.argsort(key.to(_small_int(len(geo.members) * P)), stable=True)  # keeps selection order
        key_sorted = _take(key, order)
        counts = torch.bincount(key, minlength=len(geo.members) * P)
        slot = torch.arange(order.numel(), device=order.device) - _take(torch.cumsum(counts, 0) - counts, key_sorted)
        member, owner = geo.entry_member, key_sorted - geo.entry_member * P  # sorted member-major: member is static
        self.sent_indices, self.sent_values = _take(indices, order), _take(values, order)
        self.fits = slot < geo.entry_capacity
        self.sent_keys = self.sent_indices + geo.entry_base
        width = (buf.numel() - 8) // P  # bytes per row of the alltoall
        _scatter_into(buf, torch.int32, owner * (width // 4) + geo.entry_send_index_at + slot, self.fits,
                      self.sent_indices)
        _scatter_into(buf, self.wire_dtype, owner * (width // self.itemsize) + geo.entry_send_value_at + slot,
                      self.fits, self.sent_values)
        # over a destination's capacity: stays in this rank's residual for later steps
        for j in _members_where(~self.fits, member, len(self.requests)):
            s, e = geo.entry_starts[j], geo.entry_starts[j + 1]
            _add_to_residual(self.requests[j].residual, self.sent_indices[s:e], self.sent_values[s:e],
                             ~self.fits[s:e])

    # ---- phase 2 -------------------------------------------------------------------------------------------------
    def fill_owned(self, received: torch.Tensor, out: torch.Tensor) -> None:
        """From the alltoall's rows (flat uint8), write this rank's kept sums of every member into ``out`` (one
        allgather row, flat, 8 scratch bytes last): per member the ceil(k / P) largest sums of its region,
        non-finite first; the rounding of each kept sum to the wire dtype stays in this rank's residual."""
        geo = self.geometry
        indices = _take(received.view(torch.int32), geo.recv_index).long()
        used = indices >= 0
        keys = torch.where(used, indices + geo.recv_base, torch.full_like(indices, geo.total))
        values = torch.where(used, _take(received.view(self.wire_dtype), geo.recv_value).to(self.acc_dtype),
                             torch.zeros((), dtype=self.acc_dtype, device=indices.device))
        unique, inverse = torch.unique(keys.to(_small_int(geo.total)), return_inverse=True)  # member by member
        unique = unique.long()
        sums = torch.zeros(unique.numel(), dtype=self.acc_dtype, device=keys.device).index_add_(0, inverse, values)
        real = unique < geo.total
        member = torch.zeros_like(unique).scatter_(0, inverse, geo.recv_member)  # every key has one member
        priority = torch.where(torch.isfinite(sums), sums.abs(), torch.full_like(sums, float("inf")))
        ranked = _rank_within_members(member, priority, real, len(geo.members))
        # the k-th kept sum of member j is the k-th of its run in ``ranked``: static positions, fixed sizes
        counts = torch.bincount(torch.where(real, member, len(geo.members)), minlength=len(geo.members) + 1)
        counts = counts[: len(geo.members)]
        valid = geo.own_rank < _take(counts, geo.own_member)
        at = torch.where(valid, _take(torch.cumsum(counts, 0) - counts, geo.own_member) + geo.own_rank,
                         torch.zeros_like(geo.own_rank))
        chosen = _take(ranked, at)
        kept_local = torch.where(valid, _take(unique, chosen) - geo.own_base, torch.full_like(at, -1))
        kept_sums = torch.where(valid, _take(sums, chosen), torch.zeros((), dtype=self.acc_dtype, device=at.device))
        view_index, view_value = out.view(torch.int32), out.view(self.wire_dtype)
        view_index[geo.own_index] = kept_local.to(torch.int32)
        wire_sums = ops.to_wire(kept_sums, self.wire_dtype)  # P ranks' sum may pass float16's range: clamped
        view_value[geo.own_value] = wire_sums
        if self.wire_dtype != self.acc_dtype:  # the owner re-sends its sums rounded: the rounding stays here
            rounding = kept_sums - wire_sums.to(self.acc_dtype)
            for j, request in enumerate(self.requests):
                s, e = geo.kept_bounds[j], geo.kept_bounds[j + 1]
                _add_to_residual(request.residual, kept_local[s:e].clamp(min=0), rounding[s:e], valid[s:e])

    # ---- phase 3 -------------------------------------------------------------------------------------------------
    def _gathered_entries(self, gathered: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices, values, used) of every owner's kept sums of every member, member-major; and this rank's sent
        entries that no owner kept go back to their residual (once)."""
        if self._gathered is None:
            geo = self.geometry
            indices = _take(gathered.view(torch.int32), geo.gathered_index).long()
            used = indices >= 0
            values = _take(gathered.view(self.wire_dtype), geo.gathered_value)
            keys = torch.where(used, indices + geo.gathered_base, torch.full_like(indices, geo.total))
            applied = geo.marks().index_fill_(0, keys, True)
            dropped = self.fits & ~_take(applied, self.sent_keys)
            geo.release_marks(applied, keys)
            for j, request in enumerate(self.requests):
                s, e = geo.entry_starts[j], geo.entry_starts[j + 1]
                _add_to_residual(request.residual, self.sent_indices[s:e], self.sent_values[s:e], dropped[s:e])
            self._gathered = (torch.where(used, indices, torch.zeros_like(indices)), values, used)
        return self._gathered

    def apply(self, j: int, gathered: torch.Tensor) -> torch.Tensor:
        """Member ``j`` of the group: its reduced gradient written over its output, from the allgather's rows."""
        indices, values, used = self._gathered_entries(gathered)
        geo, request = self.geometry, self.requests[j]
        s, e = geo.gathered_starts[j], geo.gathered_starts[j + 1]
        sums = torch.where(used[s:e], values[s:e].to(self.acc_dtype), torch.zeros((), dtype=self.acc_dtype,
                                                                                  device=values.device))
        sums = sums * request.scale
        out = request.out
        if out.dtype == self.acc_dtype:  # in place: no N-sized temporary
            out.zero_().index_add_(0, indices[s:e], sums)
        else:  # half precision: sum in float32, then round once
            out.copy_(ops.scatter_sum(indices[s:e], sums, out.numel(), self.acc_dtype))
        return out.view(request.shape)


class _FusedGroup(_Group):
    """float32 members on the CPU, run by the fused kernels (csrc/sparse_rounds.cpp): the results of
    :class:`_Group`'s torch operations, bit for bit, in one walk over the entries per phase instead of ~20 passes
    (python benchmarks/bench_sparse_rounds.py measures both)."""

    def __init__(self, rounds: "SparseRounds", positions: Sequence[int], module: Any) -> None:
        super().__init__(rounds, positions)
        self._module = module
        self._send_width = rounds.send_offsets[-1]
        self._kept_width = rounds.kept_offsets[-1]
        self._residuals = [r.residual.view(-1) for r in self.requests]
        self._sent_rows: Optional[torch.Tensor] = None
        self._returned = False

    @staticmethod
    def applies_to(requests: Sequence[ExchangeRequest]) -> bool:
        """Whether the kernels cover these members: CPU, float32 on the wire, in the residual and in the output,
        unless ``HOROVOD_TOPK_SELECTION`` forces a non-fused backend (how the device path is tested on the CPU)."""
        forced = os.environ.get(selection.ENV, "").strip().lower()
        return (forced in ("", "fused") and all(
            r.out.device.type == "cpu" and not r.layout.compact and r.wire_dtype == torch.float32
            and r.residual.dtype == torch.float32
            and r.out.dtype == torch.float32 and r.out.is_contiguous() and r.residual.is_contiguous()
            for r in requests))

    def fill_send(self, buf: torch.Tensor) -> None:
        self._module.sparse_fill_send([r.payload for r in self.requests], self._residuals, self.geometry.table, buf,
                                      self.world_size, self._send_width, HASH_MULTIPLIER)
        self._sent_rows = buf

    def fill_owned(self, received: torch.Tensor, out: torch.Tensor) -> None:
        self._module.sparse_fill_owned(received, self._send_width, self.geometry.table, out, self.world_size)

    def apply(self, j: int, gathered: torch.Tensor) -> torch.Tensor:
        geo, request = self.geometry, self.requests[j]
        if not self._returned:  # this rank's sent entries no owner kept go back to their residuals, once
            marks = geo.marks()
            self._module.sparse_return_dropped(gathered, self._kept_width, self._sent_rows, self._send_width,
                                               self._residuals, geo.table, marks, self.world_size)
            geo.release_marks(marks)
            self._returned = True
        self._module.sparse_apply_member(gathered, self._kept_width, geo.table, j, request.out.view(-1),
                                         float(request.scale), self.world_size)
        return request.out.view(request.shape)


def _group(rounds: "SparseRounds", positions: Sequence[int]) -> _Group:
    """The fused group where the kernels cover the members and could be built, the torch one otherwise."""
    requests = [rounds.requests[i] for i in positions]
    module = kernels.load() if _FusedGroup.applies_to(requests) else None
    return _Group(rounds, positions) if module is None else _FusedGroup(rounds, positions, module)


class SparseRounds:
    """The arithmetic of one sparse allreduce over ``requests`` (one tensor, or a bucket's members side by side),
    with no collective in it: the Horovod flight (torch.sparse_allreduce) and the DDP hook (torch.ddp) each issue
    the two collectives their own way and hand what arrived back here.

    1. :attr:`send` -- this rank's blocks, one row per destination (alltoall them, equal splits);
    2. :meth:`owned` -- from the (P, width) rows received, this rank's kept sums of every member (allgather them);
    3. :meth:`apply` -- from every owner's kept sums, member ``i``'s reduced gradient written over its output.

    Wire format, per member (core.exchange.SparseAllreduceLayouts): in row ``o`` of the alltoall, a PayloadLayout of
    ``capacity`` entries for owner ``o``; in an owner's allgather row, a PayloadLayout of its ``kept`` sums; unused
    slots hold index -1 and value 0. A row is every member's field side by side, in bucket order.
    """

    def __init__(self, requests: Sequence[ExchangeRequest]) -> None:
        self.requests = list(requests)
        self.world_size = self.requests[0].world_size
        self.layouts = [SparseAllreduceLayouts(r.layout.k, r.world_size, r.layout.value_itemsize, r.out.numel())
                        for r in self.requests]
        self.send_offsets = _offsets([l.send.nbytes for l in self.layouts])
        self.kept_offsets = _offsets([l.kept.nbytes for l in self.layouts])
        kinds: Dict[tuple, List[int]] = {}
        for i, r in enumerate(self.requests):
            kinds.setdefault((r.wire_dtype, r.residual.dtype, r.out.device), []).append(i)
        self._groups = [_group(self, positions) for positions in kinds.values()]
        #: member -> (its group, its place in the group)
        self._member: Dict[int, Tuple[_Group, int]] = {
            i: (group, j) for group in self._groups for j, i in enumerate(group.positions)}
        device = self.requests[0].out.device
        buf = _index_template(self.world_size, self.send_offsets[-1],
                              self.send_offsets[:-1], [l.send.k for l in self.layouts], device)
        for group in self._groups:
            group.fill_send(buf)
        for request, layouts in zip(self.requests, self.layouts):
            request.record.bytes_sent += layouts.alltoall_nbytes + layouts.kept.nbytes
        #: (P, width) uint8: row r goes to rank r.
        self.send = buf[:-8].view(self.world_size, self.send_offsets[-1])

    def mismatch(self, what: str, received: int, expected: int) -> PayloadSizeMismatch:
        names = ", ".join(r.name for r in self.requests)
        return PayloadSizeMismatch(
            f"horovod-topk: ranks disagree about {names!r}: the sparse allreduce's {what} received {received} "
            f"bytes, this rank expects {expected} (k={', '.join(str(r.layout.k) for r in self.requests)}). Check "
            f"that every rank uses the same TopKEF configuration and the same model."
        )

    def owned(self, received: torch.Tensor) -> torch.Tensor:
        """This rank's kept sums of every member, one row (flat uint8), from the alltoall's ``received`` bytes."""
        width = self.send_offsets[-1]
        if received.numel() != self.world_size * width:
            raise self.mismatch("alltoall", received.numel(), self.world_size * width)
        received = _aligned(received)
        out = _index_template(1, self.kept_offsets[-1], self.kept_offsets[:-1], [l.kept.k for l in self.layouts],
                              received.device)
        for group in self._groups:
            group.fill_owned(received, out)
        return out[:-8]

    def gathered_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """The allgather of every owner's :meth:`owned` row as (P, width), checked."""
        width = self.kept_offsets[-1]
        if gathered.numel() != self.world_size * width:
            if len(self.requests) == 1:
                kept = self.layouts[0].kept
                raise PayloadSizeMismatch(kept.mismatch_message(self.requests[0].name, self.world_size,
                                                                gathered.numel()))
            raise self.mismatch("allgather", gathered.numel(), self.world_size * width)
        return gathered.view(self.world_size, width)

    def apply(self, member: int, rows: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s reduced gradient from :meth:`gathered_rows`; its unkept entries back to its residual."""
        group, j = self._member[member]
        return group.apply(j, _aligned(rows))
