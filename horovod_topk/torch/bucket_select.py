"""The members of a bucket that travel by allgather, selected into one payload and added back from the gathered
ones: on a GPU one run of the grouped Triton kernels (triton_select) for all of them, on the CPU one call of the
fused kernel, elsewhere member by member.

Why grouped: on a GPU what costs is the host launching kernels. Selected one by one, each member costs ~20
launches, and a ResNet-50 step spent 24-34 ms of host time in them (an H100, docs/performance.md "GPUs"), where the
same kernels over all 55 weight tensors as one group take ~1 ms. A bucket is such a group: ~10 launches to select
all its members and one per rank to add the payloads back, whatever the number of members.

Nothing about a member changes: its k, payload layout and bytes, residual and non-finite rule are exactly what the
Triton backend gives it alone (the kernels treat each member as its own segment), and the bucket's payload is the
members' payloads back to back, as the member-by-member path concatenates them. Residuals stay keyed by member
name in the registry (checkpoints, another bucket layout in the next job): each member's residual *is* a view of
one flat buffer per group, so the kernels update them in place; a residual that is not (first step, after a load,
after a move between devices, buckets rebuilt) is copied into its place once and replaced by the view.

Where grouping applies (:func:`groupable`): members (one is enough) whose backend is the Triton one, float32 gradients
and residuals, one wire dtype, the plain payload layout, no DGC momentum. On the CPU (:func:`fused_groupable`) the
fused kernel takes the whole bucket in one call too (FusedBackend.compress_group, decompress_group): the same
per-member passes, without the Python around each member's call. Anything else (compact payloads, mixed wire
dtypes) is selected member by member. One member is a group too: a large embedding or classifier alone in its DDP
bucket gains no launches from it, but a group's steps can be kept and replayed (torch.steady_bucket,
torch.bucket_graph), which member-by-member steps cannot.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, List, Optional, Sequence, Tuple

import torch

from ..core import PayloadLayout
from . import group_graphs, selection
from .selection import compress_tensor, decompress_tensor

__all__ = ["BucketSelection", "GroupMember", "GroupSelection", "SelectedGroup", "add_back", "fused_groupable",
           "groupable", "select"]

#: Work on the same step's tensors that runs with a selection or an adding back, and is recorded with it under CUDA
#: graphs: (a key naming every address it reads and writes beyond the group's own, the work). A DDP bucket's dense
#: members ride along this way: gathered and divided with the selection, copied back with the adding back.
Beside = Tuple[Hashable, Callable[[], Optional[torch.Tensor]]]

#: A bound on the groups kept per device path, never reached in practice: a group is dropped when its members are
#: regrouped (buckets rebuilt) or planned under other k's (a warm-up, ratio="auto"), so one is kept per bucket. The
#: bound only keeps a pathological caller from growing the table without end; it is far above a 1B-parameter
#: model's ~160 buckets of 25 MB, since a model with more buckets than it would lose every group every step.
_LAYOUTS_KEPT = 4096


@dataclass
class GroupMember:
    """One compressed member of a bucket, ready to be selected: its gradient (flat), state and payload layout."""

    name: str
    record: Any
    flat: torch.Tensor
    residual: torch.Tensor
    layout: PayloadLayout
    wire_dtype: torch.dtype


def groupable(members: Sequence[GroupMember], backends: Sequence[Any], momentum: Sequence[Any]) -> bool:
    """Whether ``members`` (with their backends and momentum buffers) can be selected as one group."""
    if not members:
        return False
    triton = selection.triton_backend()
    if triton is None or any(b is not triton for b in backends) or any(m is not None for m in momentum):
        return False
    first = members[0]
    return all(m.flat.dtype == torch.float32 and m.flat.device == first.flat.device
               and m.wire_dtype == first.wire_dtype and m.layout.value_itemsize == first.layout.value_itemsize
               and triton.kernels.supports(m.flat, m.residual, m.layout, m.wire_dtype, None) for m in members)


def fused_groupable(members: Sequence[GroupMember], backends: Sequence[Any], momentum: Sequence[Any]) -> bool:
    """Whether ``members`` can be selected by one call of the CPU's fused kernel (FusedBackend.compress_group): all
    of them on its backend, plain payload layouts, one wire dtype, and DGC momentum for all or none."""
    if not members or not all(isinstance(b, selection.FusedBackend) for b in backends):
        return False
    wire = members[0].wire_dtype
    with_momentum = momentum[0] is not None
    return all(not m.layout.compact and m.wire_dtype == wire and (buf is not None) == with_momentum
               for m, buf in zip(members, momentum))


def _span(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat view over ``tensors`` when they lie back to back in one storage (a DDP bucket's members), else
    None."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    at = first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != at:
            return None
        at += t.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (at - first.storage_offset(),))


def select(kernels: Any, grads: torch.Tensor, residuals: torch.Tensor, layout: Any, wire_dtype: torch.dtype,
           counts: torch.Tensor) -> torch.Tensor:
    """A group's selection, device work only (what a CUDA graph may record): compensate ``grads`` (the members
    back to back) with ``residuals``, select each member's k into one payload, keep the rest as the new residuals,
    and add each member's non-finite flag to its element of ``counts`` (one launch per group). Returns the
    payload."""
    payload, nonfinite = kernels.compensate_and_select(grads, residuals, layout, wire_dtype)
    counts.add_(nonfinite)
    return payload


def add_back(kernels: Any, rows: torch.Tensor, layout: Any, wire_dtype: torch.dtype, scale: float,
             span: Optional[torch.Tensor], flats: Sequence[torch.Tensor]) -> None:
    """A group's adding back, device work only: every member's sum of the P ``rows`` (gathered payloads) times
    ``scale``, written straight over ``span`` where the members lie back to back, else through one buffer and
    one batched copy into ``flats`` (a multi-tensor kernel on CUDA, not a launch per member)."""
    out = span if span is not None else torch.empty(layout.numel, dtype=torch.float32, device=rows.device)
    kernels.accumulate(list(rows), layout, wire_dtype, scale, out)
    if span is None:
        torch._foreach_copy_(list(flats), list(out.split(list(layout.numels))))


class SelectedGroup:
    """One group's selection on one step: its payload buffer, and how the gathered buffers become the members'
    averaged gradients."""

    def __init__(self, group: Any, members: Sequence[GroupMember], payload: torch.Tensor,
                 span: Optional[torch.Tensor], key: Tuple = (), found: Optional["_Group"] = None,
                 beside: Optional[torch.Tensor] = None) -> None:
        self.group = group
        #: The GroupSelection's key and entry this selection ran in (a steady bucket runs in them again).
        self.key = key
        self.found = found
        self.members = list(members)
        #: The members' payloads back to back (uint8), this rank's share of the bucket's allgather.
        self.payload = payload
        #: One flat view over the members' gradients when they lie back to back, else None.
        self.span = span
        #: What the selection's ``beside`` work returned, or None.
        self.beside = beside

    def gathered_buffer(self, world_size: int) -> torch.Tensor:
        """Where the allgather of every rank's payload should land (``world_size`` x :attr:`payload` bytes): the
        group's own buffer where adding back is replayed as a CUDA graph (a graph reads fixed addresses), else a
        new one."""
        nbytes = world_size * self.payload.numel()
        device = self.payload.device
        if self.found is not None and group_graphs.enabled(device):
            return self.found.gathered(nbytes, device)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def finish(self, rows: torch.Tensor, scale: float, kernels: Any, beside: Optional[Beside] = None) -> None:
        """Write every member's average over its gradient from ``rows`` (P x this group's payload bytes): one
        launch per rank; straight into the gradients when they lie back to back, else through one buffer; then
        ``beside``'s work. Rows that are the group's own gathered buffer (:meth:`gathered_buffer`) under graphs:
        all of it replayed as one CUDA graph, recorded per (rows, gradients, scale, beside's key) -- at 64 ranks
        one launch where there were 64 and more."""
        def work() -> Tuple[torch.Tensor, ...]:
            add_back(kernels, rows, self.group, self.members[0].wire_dtype, scale, self.span,
                     [m.flat for m in self.members])
            if beside is not None:
                beside[1]()
            return ()

        with selection.on_device(rows.device):
            if self.found is not None and self.found.owns(rows) and group_graphs.enabled(rows.device):
                targets = ((self.span.data_ptr(),) if self.span is not None else
                           tuple(m.flat.data_ptr() for m in self.members))
                self.found.finish_graphs.run((rows.data_ptr(), tuple(rows.shape), scale, targets,
                                              beside[0] if beside is not None else None), work, rows.device)
            else:
                work()


class GroupSelection:
    """Selects groups of members with the grouped kernels; holds each group's residual buffer and layout.

    A front end keeps one per compressor state: the residual buffers belong to the members' records (they are
    the records' residuals), this object only remembers which buffer each group uses."""

    def __init__(self) -> None:
        #: (member names, numels, layouts, device) -> the group's layout, residual buffer and non-finite counts
        self._groups: "OrderedDict[Tuple, _Group]" = OrderedDict()

    def _group(self, members: Sequence[GroupMember], kernels: Any) -> Tuple[Tuple, "_Group"]:
        device = members[0].flat.device
        key = (tuple(m.name for m in members), tuple(m.flat.numel() for m in members),
               tuple(m.layout for m in members), device)
        found = self._groups.get(key)
        if found is not None:
            self._groups.move_to_end(key)
            return key, found
        layout = kernels.GroupLayout(key[1], key[2], device)
        # buckets rebuilt (DDP does after its first iteration): groups holding any of these members under another
        # membership are stale; their members adopt the new buffer below
        names = set(key[0])
        for stale in [k for k in self._groups if k[:2] != key[:2] and names.intersection(k[0])]:
            del self._groups[stale]
        # a buffer of the same members under other k's (a warm-up, ratio="auto") is the same residuals: reuse it,
        # and drop those groups (their layouts, allgather destinations and graphs are not wanted again; should the
        # k's come back, the group is made again from the same residuals)
        buffer = next((g.residuals for k, g in self._groups.items() if k[:2] == key[:2] and k[3] == device), None)
        for stale in [k for k in self._groups if k[:2] == key[:2]]:
            del self._groups[stale]
        if buffer is None:
            buffer = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        group = self._groups[key] = _Group(layout, buffer, torch.zeros(len(members), dtype=torch.int64,
                                                                       device=device))
        while len(self._groups) > _LAYOUTS_KEPT:
            self._groups.popitem(last=False)
        return key, group

    def holds(self, key: Tuple, found: "_Group") -> bool:
        """Whether ``found`` is still this selection's entry for ``key`` (not evicted, not replaced)."""
        return self._groups.get(key) is found

    def replays(self) -> int:
        """How many selections ran as a replayed CUDA graph (group_graphs)."""
        return sum(g.graphs.replays for g in self._groups.values())

    def finish_replays(self) -> int:
        """How many addings back ran as a replayed CUDA graph."""
        return sum(g.finish_graphs.replays for g in self._groups.values())

    def select(self, members: Sequence[GroupMember], state: Any, span: Optional[torch.Tensor] = None) -> SelectedGroup:
        """Compensate and select every member of ``members`` at once (each member's record counts its step's
        non-finite flag and its share of the time, by size). ``span``: one flat view over the members' gradients,
        where the caller knows they lie back to back (a DDP bucket's plan says so), else found here."""
        kernels = selection.triton_backend().kernels
        key, found = self._group(members, kernels)
        return self.select_in(key, found, members, state, span, kernels)

    def select_in(self, key: Tuple, found: "_Group", members: Sequence[GroupMember], state: Any,
                  span: Optional[torch.Tensor], kernels: Any = None, find_span: bool = True,
                  beside: Optional[Beside] = None) -> SelectedGroup:
        """:meth:`select` in the group entry already found for ``members`` (a steady bucket keeps it, and knows
        whether they lie back to back: ``find_span`` False); ``beside``'s work runs (and is recorded) with it, its
        result kept as the selection's :attr:`SelectedGroup.beside`."""
        kernels = kernels if kernels is not None else selection.triton_backend().kernels
        group, residuals = found.layout, found.residuals
        found.adopt_residuals(members)
        found.adopt_counts([m.record for m in members])
        if span is None and find_span:
            span = _span([m.flat for m in members])
        device = members[0].flat.device
        started = time.perf_counter()

        def work() -> Tuple[torch.Tensor, ...]:
            grads = span if span is not None else torch.cat([m.flat for m in members])
            payload = select(kernels, grads, residuals, group, members[0].wire_dtype, found.counts)
            return (payload,) if beside is None or not graphed else (payload, beside[1]())

        graphed = group_graphs.enabled(device)
        with selection.on_device(device):
            if graphed:
                addresses = ((residuals.data_ptr(), span.data_ptr()) if span is not None else
                             (residuals.data_ptr(), *(m.flat.data_ptr() for m in members)))
                outputs = found.graphs.run(addresses + (beside[0] if beside is not None else None,), work, device)
            else:
                outputs = work()
        # the selection's time alone (the auto density reads it); under graphs one replay does both
        state._selected_group([m.record for m in members], group.numels, time.perf_counter() - started)
        if beside is not None and not graphed:
            with selection.on_device(device):
                outputs = (outputs[0], beside[1]())
        return SelectedGroup(group, members, outputs[0], span, key, found, outputs[1] if beside is not None else None)


class _Group:
    """One group's device state: its layout, the residual buffer its members' residuals are views of, and its
    members' non-finite step counts, whose elements the members' records hold (so a step adds every member's flag
    with one launch, and a record read anywhere -- stats(), a checkpoint -- sees its own count)."""

    def __init__(self, layout: Any, residuals: torch.Tensor, counts: torch.Tensor) -> None:
        self.layout = layout
        self.residuals = residuals
        self.counts = counts
        self._views: List[Optional[torch.Tensor]] = [None] * counts.numel()
        self._residual_views: List[Optional[torch.Tensor]] = [None] * counts.numel()
        #: This group's selection recorded as CUDA graphs (torch.group_graphs), one per set of addresses;
        #: they read this group's layout tables, so they live and die with it.
        self.graphs = group_graphs.GroupGraphs()
        #: Its adding back recorded likewise, reading :meth:`gathered`'s buffer.
        self.finish_graphs = group_graphs.GroupGraphs()
        self._gathered: Optional[torch.Tensor] = None

    def gathered(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The group's allgather destination of ``nbytes``, the same buffer every step (so a recorded adding back
        can replay over it). Reusing it is safe in stream order: a step's collective writes it only after the
        previous step's adding back, queued before it on the same stream, has read it (the DDP hook's adding back
        runs inline on the hook's stream: NCCL's futures are complete when launched; ProcessGroupNCCL makes its
        stream wait for that one at each collective)."""
        held = self._gathered
        if held is None or held.numel() != nbytes or held.device != device:
            held = self._gathered = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return held

    def owns(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` lie in :meth:`gathered`'s buffer, from its start."""
        held = self._gathered
        return held is not None and rows.data_ptr() == held.data_ptr() and rows.numel() == held.numel()

    def adopt_residuals(self, members: Sequence[GroupMember]) -> None:
        """Make each member's residual its view of :attr:`residuals`: a residual that is not (first step, after a
        load, a move between devices, buckets rebuilt) is copied into its place once and replaced by the view;
        in steady state this is one identity check per member."""
        residuals, starts = self.residuals, self.layout.starts
        for i, m in enumerate(members):
            if m.residual is self._residual_views[i]:
                continue
            start = starts[i]
            if m.residual.data_ptr() != residuals.data_ptr() + 4 * start:
                view = residuals[start:start + m.flat.numel()]
                view.copy_(m.residual)
                m.record.residual = m.residual = view
            self._residual_views[i] = m.residual

    def adopt_counts(self, records: Sequence[Any]) -> None:
        """Point each record's ``nonfinite_steps`` at its element of :attr:`counts`, carrying the count it held (a
        number, or an element of another group's counts: buckets rebuilt, a load)."""
        for i, record in enumerate(records):
            held = record.nonfinite_steps
            if held is self._views[i]:
                continue
            view = self.counts[i]
            if isinstance(held, torch.Tensor):
                view.copy_(held)
            else:
                view.fill_(int(held))
            record.nonfinite_steps = self._views[i] = view


class BucketSelection:
    """The allgather members of one bucket on one step: selected into one payload (:attr:`payload`, this rank's
    share of the bucket's allgather, counted in each member's bytes sent), then :meth:`finish` writes each
    member's average over its gradient.

    ``items`` are (name, record, tensor, flat gradient, k) in the bucket's order; ``state`` is the front end's
    ``TorchResiduals``. The grouped kernels run where :func:`groupable` allows, else each member's backend."""

    def __init__(self, state: Any, items: Sequence[Tuple[str, Any, torch.Tensor, torch.Tensor, int]],
                 world_size: int, op_name: str, layouts: Optional[Sequence[PayloadLayout]] = None,
                 span: Optional[torch.Tensor] = None) -> None:
        self.world_size = world_size
        self.members: List[GroupMember] = []
        backends, momentum = [], []
        # wire dtype and backend depend on a gradient's dtype and device only: found once per kind in the bucket
        how: dict = {}
        for i, (name, record, tensor, flat, k) in enumerate(items):
            kind = (tensor.dtype, tensor.device)
            if kind not in how:
                how[kind] = (state._wire_dtype(tensor), state._backend(tensor))
            residual, momentum_buffer, layout, wire_dtype, backend = state._prepare(
                name, record, tensor, flat, k, world_size, op_name, layouts[i] if layouts is not None else None,
                how[kind])
            self.members.append(GroupMember(name, record, flat, residual, layout, wire_dtype))
            record.bytes_sent += layout.nbytes
            backends.append(backend)
            momentum.append(momentum_buffer)
        self._group: Optional[SelectedGroup] = None
        self._backends = backends
        #: What a ``beside`` work given to the selection returned (the steady path's dense members), or None.
        self.beside: Optional[torch.Tensor] = None
        #: The CPU's fused kernel when it selected every member in one call (:meth:`finish` adds back likewise).
        self._fused: Optional[selection.FusedBackend] = None
        if groupable(self.members, backends, momentum):
            self._group = state._group_selection().select(self.members, state, span)
            self.payload = self._group.payload
            return
        if fused_groupable(self.members, backends, momentum):
            self._fused = backends[0]
            started = time.perf_counter()
            self.payload, nonfinite = self._fused.compress_group(
                [m.flat for m in self.members], [m.residual for m in self.members],
                momentum if momentum[0] is not None else None, state.config.momentum,
                [m.layout for m in self.members], self.members[0].wire_dtype, [m.record.steps for m in self.members])
            for m, flag in zip(self.members, nonfinite):
                m.record.nonfinite_steps += flag
            state._selected_group([m.record for m in self.members], [m.flat.numel() for m in self.members],
                                  time.perf_counter() - started)
            return
        payloads = []
        for m, backend, buf in zip(self.members, backends, momentum):
            started = time.perf_counter()
            payload, nonfinite = compress_tensor(backend, m.flat, m.residual, buf, state.config.momentum, m.layout,
                                                 m.wire_dtype, m.record.steps)
            state._selected(m.record, nonfinite, time.perf_counter() - started)
            payloads.append(payload)
        self.payload = torch.cat(payloads) if len(payloads) > 1 else payloads[0]

    @property
    def grouped(self) -> bool:
        return self._group is not None

    def steady_part(self, plan: Any) -> "SteadySelection":
        """What a later step of the same bucket (``plan``: core's BucketPlan, whose members these are) needs to run
        this grouped selection again (torch.steady_bucket)."""
        assert self._group is not None
        return SteadySelection(self, plan)

    def gathered_buffer(self, world_size: int) -> torch.Tensor:
        """Where the allgather of every rank's :attr:`payload` should land (SelectedGroup.gathered_buffer)."""
        if self._group is not None:
            return self._group.gathered_buffer(world_size)
        return torch.empty(world_size * self.payload.numel(), dtype=torch.uint8, device=self.payload.device)

    def finish(self, rows: torch.Tensor, scale: float, beside: Optional[Beside] = None) -> None:
        """Each member's sum of the P ranks' entries times ``scale``, written over its gradient; ``rows`` is the
        gathered buffer as P rows of this rank's :attr:`payload` size. Then ``beside``'s work (recorded with the
        adding back where that is a CUDA graph)."""
        if self._group is not None:
            self._group.finish(rows, scale, selection.triton_backend().kernels, beside)
            return
        if self._fused is not None:
            self._fused.decompress_group(rows, [m.layout for m in self.members], self.members[0].wire_dtype, scale,
                                         [m.flat for m in self.members])
            if beside is not None:
                beside[1]()
            return
        start = 0
        for m, backend in zip(self.members, self._backends):
            end = start + m.layout.nbytes
            decompress_tensor(backend, rows[:, start:end].contiguous().view(-1), self.world_size, m.layout,
                              m.wire_dtype, scale, m.flat)
            start = end
        if beside is not None:
            beside[1]()


class SteadySelection:
    """A grouped BucketSelection kept for the next steps of its bucket: its members' records, residual views,
    layouts and places in the bucket's buffer, its group entry, and whether the members lie back to back.
    :meth:`still_valid` checks by identity that none of them was replaced (a load, a move, a regrouping); :meth:`run`
    selects again over this step's buffer without working any of it out again. It keeps no view of the buffer, so
    a buffer DDP replaced is freed at once."""

    def __init__(self, done: BucketSelection, plan: Any) -> None:
        assert done._group is not None
        where = {m.name: (m.offset, m.end) for m in plan.members}
        self.records = [m.record for m in done.members]
        self._members = [(m.name, m.record, where[m.name], m.residual, m.layout, m.wire_dtype) for m in done.members]
        self.world_size = done.world_size
        self._backends = done._backends
        self._key, self._found = done._group.key, done._group.found
        span = done._group.span
        self._span = (where[done.members[0].name][0], where[done.members[-1].name][1]) if span is not None else None

    def still_valid(self, state: Any) -> bool:
        if not state._group_selection().holds(self._key, self._found):
            return False
        return all(record.residual is residual for _, record, _, residual, _, _ in self._members)

    def select_on_device(self, buffer: torch.Tensor) -> torch.Tensor:
        """This step's selection over ``buffer``, device work only (:func:`select`: what a graph of the bucket's
        whole step records); the payload. The host's side -- counters, times -- is the caller's."""
        group = self._found
        return select(selection.triton_backend().kernels, self._grads(buffer), group.residuals, group.layout,
                      self._members[0][5], group.counts)

    def add_back_on_device(self, rows: torch.Tensor, scale: float, buffer: torch.Tensor) -> None:
        """The adding back of ``rows`` (P gathered payloads) over the members' places in ``buffer``, device work
        only (:func:`add_back`)."""
        span = buffer[self._span[0]:self._span[1]] if self._span is not None else None
        add_back(selection.triton_backend().kernels, rows, self._found.layout, self._members[0][5], scale, span,
                 [buffer[a:b] for _, _, (a, b), _, _, _ in self._members])

    def count_time(self, state: Any, seconds: float) -> None:
        """The selection's host time shared among its members' records (and the auto density's clock)."""
        state._selected_group(self.records, self._found.layout.numels, seconds)

    def _grads(self, buffer: torch.Tensor) -> torch.Tensor:
        if self._span is not None:
            return buffer[self._span[0]:self._span[1]]
        return torch.cat([buffer[a:b] for _, _, (a, b), _, _, _ in self._members])

    def run(self, state: Any, buffer: torch.Tensor, beside: Optional[Beside] = None) -> BucketSelection:
        """The selection over this step's ``buffer``, with ``beside``'s work (its result: :attr:`beside`)."""
        done = BucketSelection.__new__(BucketSelection)
        done.world_size, done._backends = self.world_size, self._backends
        done._fused = None
        done.members = [GroupMember(name, record, buffer[a:b], residual, layout, wire)
                        for name, record, (a, b), residual, layout, wire in self._members]
        span = buffer[self._span[0]:self._span[1]] if self._span is not None else None
        done._group = state._group_selection().select_in(self._key, self._found, done.members, state, span,
                                                         find_span=False, beside=beside)
        done.payload = done._group.payload
        done.beside = done._group.beside
        return done
