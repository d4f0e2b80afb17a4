"""TopKEF for PyTorch DistributedDataParallel: a ``torch.distributed`` communication hook.

    from horovod_topk.torch.ddp import TopKEFState, topk_ef_hook
    state = TopKEFState(ratio=0.01)
    ddp_model.register_comm_hook(state, topk_ef_hook)

DDP hands the hook one bucket at a time (its buckets of ~25 MiB of gradients, launched in order while backward
still runs). Per bucket the hook asks core for one plan (core.bucket_plan: which members are compressed, their k
and payload layouts, which go dense), compensates and selects every compressed member into one payload
(torch.bucket_step), sends it with one ``all_gather_single`` (or, for the members whose exchange is the sparse
allreduce, one ``all_to_all_single`` to region owners and one ``all_gather_single`` of their kept sums) and the
dense members with one ``all_reduce``, and returns the Future DDP waits on, with the averaged gradients written
over the bucket. Which exchange a member takes is core's cost model's choice (core.exchange), as under Horovod.

Residuals live in the same registry as Horovod's (core.CompressorState), keyed by *parameter*, never by bucket
index: DDP rebuilds its buckets after the first iteration (in the order gradients became ready), and a checkpoint
may be loaded into a job with other buckets. Parameters are named by ``named_parameters=`` when given, else
``param<i>`` in the order the hook first sees them -- DDP's first iteration always uses the buckets built from the
reverse parameter order, so the names are the same on every rank and in every job of the same model and
``bucket_cap_mb``; pass ``named_parameters`` for names that survive other changes.

This module imports no Horovod: a DDP user needs torch and horovod-topk only.

``ratio="auto"`` chooses the density from the job's own measurements as under Horovod (core.autodensity); the
hook's probes and step clock are torch.ddp_auto's (in update mode the clock is the optimizer's step).
``target="update"`` (each rank steps its own optimizer, the updates travel) takes the hook and the optimizer
together: torch.ddp_update.

The sparse allreduce's alltoall is waited for inside the hook (its owners' sums must be computed before their
allgather starts, and every collective is issued from the hook's thread so that all ranks issue them in one
order); its allgather and the bucket's other collectives complete asynchronously while backward goes on.
"""
# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks the hook's annotations as
# objects (dist.GradBucket, torch.futures.Future[torch.Tensor]), not strings.
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from ..core import CompressorState, RankMismatch, mismatch_message
from ..core import checkpoint as core_checkpoint
from ..core.bucket_plan import BucketPlan, bucket_fingerprint, plan_bucket
from ..core.exchange import DENSE
from . import bucket_graph
from .bucket_step import BucketStep
from .checkpoint import TorchTensors
from .ddp_auto import StepClock
from .dist_collectives import all_gather_single as _all_gather_single
from .selection import dtype_token
from .state import TorchResiduals

__all__ = ["TopKEFState", "topk_ef_hook", "gather_state", "restore_state", "update_mode_optimizer"]

class TopKEFState(TorchResiduals, CompressorState[torch.Tensor]):
    """The state of :func:`topk_ef_hook`: configuration, residuals by parameter, statistics, checkpoints.

    Args:
        ratio (float, optional): fraction of each compressed gradient's entries sent per step. Default 0.01.
        process_group (optional): the group DDP reduces over (the same one given to DDP); None: the default group.
        named_parameters (optional): ``model.named_parameters()`` of the wrapped model: residuals and
            checkpoints are keyed by these names (recommended). Without it, ``param<i>`` in first-seen order.
        config (TopKConfig, optional), summary_writer (optional), **options: as for Horovod's ``TopKEF``
            (core.TopKConfig): k, min_numel, selector, value_dtype, index_bits, dense_fallback, warmup_steps,
            momentum, spike_guard, log_every. ``bucket_bytes`` does not apply: DDP's ``bucket_cap_mb`` decides the
            buckets.

    Every rank must build it with the same options: the first time a bucket is seen (and after every load) the
    ranks compare a fingerprint of its plan and raise :class:`RankMismatch` together instead of hanging.
    """

    def __init__(
        self,
        ratio: Optional[float] = None,
        *,
        process_group: Any = None,
        named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(ratio, **kwargs)
        config = self.config
        #: "update" where the hook holds the gradients for update mode's optimizer (target="update", or "auto" once
        #: update_mode_optimizer resolved it for an Adam optimizer: torch.ddp_update), else "gradient".
        self.target = "update" if config.target == "update" else "gradient"
        #: The process group DDP reduces over (None: the default group). Not part of any checkpoint.
        self.process_group = process_group
        #: id(parameter) -> (weak reference, name): residuals follow parameters, not DDP's bucket indices.
        self._names: Dict[int, Tuple[Any, str]] = {}
        #: Names given by the user (named_parameters=); None: parameters are named param<i> as first seen.
        self._given: Optional[Dict[int, str]] = None
        if named_parameters is not None:
            self._given = {}
            for name, p in named_parameters:
                if not isinstance(p, torch.Tensor):
                    raise ValueError(f"horovod-topk: named_parameters must yield (name, tensor) pairs; {name!r} "
                                     f"is a {type(p).__name__}")
                self._given[id(p)] = name
                self._names[id(p)] = (weakref.ref(p), name)
        #: Bucket index -> (buffer address, size, weak reference to its storage, members, shapes, slot):
        #: bucket_members' reading of each buffer, and the slot where its steps keep what the next reuse.
        self._layouts: Dict[int, Tuple[int, int, Any, List[Tuple[str, int]], List[Tuple[int, ...]],
                                       Dict[str, Any]]] = {}
        #: Member lists (bucket plans' names) whose ranks' agreement was checked since creation or the last load.
        self._verified: set = set()
        #: Buckets reduced, those that carried compressed members, and those whose allgather members were
        #: selected by one run of the grouped kernels (torch.bucket_select; stats()["buckets"]).
        self.buckets_reduced = 0
        self.buckets_compressed = 0
        self.buckets_grouped = 0
        #: With ratio="auto": where each step begins and what it waited for (torch.ddp_auto).
        self._clock = StepClock() if config.auto else None
        #: Update mode's optimizer step (torch.ddp_update.DDPUpdateStep), once update_mode_optimizer made one: the
        #: hook tells it which route each step takes (torch.gradient_route).
        self.update_step: Any = None
        #: (group, its size, this rank in it) as last asked of torch.distributed: a group's size and ranks never
        #: change, and asking costs host time in every bucket.
        self._group_shape: Optional[Tuple[Any, int, int]] = None

    def group_shape(self, group: Any) -> Tuple[int, int]:
        """``group``'s world size and this process's rank in it."""
        known = self.__dict__.get("_group_shape")
        if known is None or known[0] is not group:
            known = self._group_shape = (group, dist.get_world_size(group), dist.get_rank(group))
        return known[1], known[2]

    # ---- parameters and plans ------------------------------------------------------------------------------
    def name_of(self, parameter: torch.Tensor) -> str:
        """The name residuals and checkpoints know ``parameter`` by."""
        entry = self._names.get(id(parameter))
        if entry is not None and entry[0]() is parameter:
            return entry[1]
        if self._given is not None:
            raise ValueError(f"horovod-topk: the DDP bucket holds a parameter of shape {tuple(parameter.shape)} that "
                             f"is not among the named_parameters given to TopKEFState (another model?)")
        name = f"param{len(self._names)}"
        self._names[id(parameter)] = (weakref.ref(parameter), name)
        return name

    def bucket_members(self, bucket: dist.GradBucket) -> Tuple[List[Tuple[str, int]], List[Tuple[int, ...]]]:
        """(name, numel) and shape of every gradient in ``bucket``, in buffer order; checks that the gradients lie
        end to end in the bucket's buffer (how DDP lays them out), since the plan addresses them by offset.

        Read once per bucket buffer: DDP fills a buffer with the same gradients every step and allocates new
        buffers when it rebuilds its buckets. The cache keeps a weak reference to each buffer's storage, so it
        holds no memory, and an entry counts only while that storage lives: a new buffer at a freed one's address
        is read afresh."""
        buffer = bucket.buffer()
        index = bucket.index()
        layouts = self.__dict__.setdefault("_layouts", {})  # (a state unpickled from before the cache existed)
        cached = layouts.get(index)
        if (cached is not None and cached[0] == buffer.data_ptr() and cached[1] == buffer.numel()
                and not cached[2].expired()):
            return cached[3], cached[4]
        members, shapes = self._read_members(bucket, buffer)
        layouts[index] = (buffer.data_ptr(), buffer.numel(), StorageWeakRef(buffer.untyped_storage()), members, shapes,
                          {})
        if bucket.is_last():  # buckets rebuilt into fewer: drop the rest
            for stale in [i for i in layouts if i > index]:
                del layouts[stale]
        return members, shapes

    def bucket_slot(self, bucket: dist.GradBucket) -> Optional[Dict[str, Any]]:
        """Where a bucket buffer's step keeps what its next steps can reuse (torch.steady_bucket); it lives and
        dies with the buffer's entry of :meth:`bucket_members`, which must have been called this step."""
        cached = self.__dict__.get("_layouts", {}).get(bucket.index())
        return cached[5] if cached is not None else None

    def _read_members(self, bucket: dist.GradBucket,
                      buffer: torch.Tensor) -> Tuple[List[Tuple[str, int]], List[Tuple[int, ...]]]:
        members, shapes, offset = [], [], 0
        itemsize = buffer.element_size()
        for parameter, grad in zip(bucket.parameters(), bucket.gradients()):
            if grad.numel() and grad.data_ptr() != buffer.data_ptr() + offset * itemsize:
                raise ValueError("horovod-topk: a DDP bucket's gradients do not lie end to end in its buffer; this "
                                 "torch version lays buckets out in a way the hook does not know")
            members.append((self.name_of(parameter), grad.numel()))
            shapes.append(tuple(parameter.shape))
            offset += grad.numel()
        if offset != buffer.numel():
            raise ValueError(f"horovod-topk: a DDP bucket's gradients cover {offset} of its {buffer.numel()} "
                             f"elements; this torch version lays buckets out in a way the hook does not know")
        return members, shapes

    def plan(self, members: List[Tuple[str, int]], buffer: torch.Tensor, world_size: int) -> BucketPlan:
        """core's plan for a bucket of ``members`` at their current step (every member of a DDP bucket is reduced
        once per synchronised iteration, so they share one step count); with ratio="auto", under the density in
        force (all dense while dense is, all in float16 while fp16 is)."""
        record = self.registry.records.get(members[0][0])
        step = record.steps if record is not None else 0
        value_dtype = self._wire_dtype(buffer) if buffer.is_floating_point() else buffer.dtype
        config = self.auto.effective_config() if self.auto is not None else self.config
        return plan_bucket(members, config, is_floating=buffer.is_floating_point(), world_size=world_size,
                           step=step, value_itemsize=dtype_token(value_dtype).element_size(),
                           grad_itemsize=buffer.element_size(), sparse_available=True,
                           held=self.auto.held_route if self.auto is not None else DENSE)

    # ---- CompressorState hooks ----------------------------------------------------------------------------
    def _forget_agreements(self) -> None:
        self._verified.clear()

    def _after_load(self) -> None:
        self._forget_agreements()
        if self._clock is not None:  # the stamps of a step in progress belong to the state just replaced
            self._clock = StepClock()
        if self.update_step is not None:  # so does the route of a step in progress
            self.update_step.route.forget()

    def _extra_stats(self) -> Dict[str, Any]:
        return {"buckets": {"reduced": self.buckets_reduced, "compressed": self.buckets_compressed,
                            "grouped": self.buckets_grouped}}

    def __getstate__(self) -> Dict[str, Any]:
        """Pickling (e.g. torch.save of the whole state) keeps configuration and residuals, not the process group
        or the parameter identities (they belong to this process); prefer state_dict()."""
        state = dict(self.__dict__)
        state["process_group"] = None
        state["_names"] = {}
        state["_given"] = None
        state["_verified"] = set()
        state["_layouts"] = {}
        state["_group_shape"] = None
        state["update_step"] = None
        # the grouped selection's buffers: the records' residuals are views of them, a sharing plain pickle does not
        # keep; without it the first step copies every residual into a new buffer again (torch.bucket_select)
        state.pop("_grouped_selection", None)
        return state


def _check_agreement(state: TopKEFState, plan: BucketPlan, buffer: torch.Tensor, group: Any, world_size: int) -> None:
    """The first time a bucket is seen (and after a load): every rank allgathers its plan's fingerprint and all
    raise the same RankMismatch if they differ, before any collective whose sizes could disagree."""
    record = state.registry.records.get(plan.members[0].name)
    step = record.steps if record is not None else 0
    row = torch.tensor(bucket_fingerprint(state.config, plan, buffer.dtype, step), dtype=torch.int64,
                       device=buffer.device)
    rows = torch.empty(world_size * row.numel(), dtype=torch.int64, device=buffer.device)
    _all_gather_single(rows, row, group=group)
    message = mismatch_message(plan.name, rows.view(world_size, -1).tolist())
    if message is not None:
        raise RankMismatch(message)


def topk_ef_hook(state: TopKEFState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Top-K with error feedback over one bucket; register it with
    ``ddp_model.register_comm_hook(state, topk_ef_hook)``.

    Every member is compensated with its residual and its k largest entries selected (its own k, as core's
    policy decides per tensor); the bucket's payloads travel as one allgather (or one sparse allreduce, where
    core's cost model prefers it), its dense members (small tensors, warm-up steps, ratio 1) as one allreduce. At ratio 1 every member is dense and the bucket is reduced exactly as
    DDP's default allreduce does it (divide, then sum), bit for bit.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if state.target == "update":  # the gradient stays here (torch.ddp_update), or takes the gradient route
        from .ddp_update import reduce_in_update_mode

        return reduce_in_update_mode(state, bucket, group)
    if state._clock is not None:
        state._clock.bucket(state, bucket, group)
        return state._clock.launched(bucket, _reduce(state, bucket, group))
    return _reduce(state, bucket, group)


def _reduce(state: TopKEFState, bucket: dist.GradBucket, group: Any,
            key: Callable[[str], str] = lambda name: name) -> torch.futures.Future[torch.Tensor]:
    """The bucket's plan executed: its collectives launched, the Future of its averaged gradients returned. ``key``
    names each member's record (update mode's gradient route keeps a parameter's residual in its update's)."""
    world_size, rank = state.group_shape(group)
    buffer = bucket.buffer()
    members, shapes = state.bucket_members(bucket)
    members = [(key(name), numel) for name, numel in members]
    plan = state.plan(members, buffer, world_size)
    if plan.name not in state._verified:
        _check_agreement(state, plan, buffer, group, world_size)
        state._verified.add(plan.name)
    record = state.registry.records.get(plan.members[0].name)
    state._report_if_due(record.steps if record is not None else 0, rank)
    slot = state.bucket_slot(bucket)
    whole = bucket_graph.run(state, plan, buffer, world_size, slot, group)  # a steady bucket as one CUDA graph
    if whole is not None:
        state.buckets_reduced += 1
        state.buckets_compressed += 1
        state.buckets_grouped += 1
        return whole
    return launch(state, BucketStep(state, plan, buffer, shapes, world_size, slot), group)


def launch(state: TopKEFState, step: BucketStep, group: Any) -> torch.futures.Future[torch.Tensor]:
    """A bucket's collectives (one allgather, the sparse allreduce's alltoall and allgather, one allreduce each of
    the dense, the fp16 and the int8 members), launched; the Future of its averaged values written over its buffer."""
    world_size = step.world_size
    buffer = step.buffer
    state.buckets_reduced += 1
    if step.all_dense:
        return (dist.all_reduce(buffer, group=group, async_op=True).get_future()
                .then(lambda fut: fut.value()[0]))
    state.buckets_compressed += bool(step.plan.compressed)  # not a bucket sent whole in float16
    state.buckets_grouped += step.selection is not None and step.selection.grouped
    futures: List[torch.futures.Future] = []
    gathered = None
    if step.payload is not None:
        gathered = step.gathered_buffer()
        futures.append(_all_gather_single(gathered, step.payload, group=group, async_op=True).get_future())
    owners = None
    if step.sparse is not None:
        send = step.sparse.send.view(-1)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # equal splits: every block has the same capacity
        owned = step.sparse.owned(received)
        owners = torch.empty(world_size * owned.numel(), dtype=torch.uint8, device=buffer.device)
        futures.append(_all_gather_single(owners, owned, group=group, async_op=True).get_future())
    if step.dense is not None:
        futures.append(dist.all_reduce(step.dense, group=group, async_op=True).get_future())
    if step.half is not None:  # ratio="auto"'s fp16 (torch.half_route): summed in place
        futures.append(dist.all_reduce(step.half, group=group, async_op=True).get_future())
    if step.int8 is not None:  # ratio="auto"'s int8 (torch.int8_route): the words summed in place
        futures.append(dist.all_reduce(step.int8, group=group, async_op=True).get_future())

    def finish(done: torch.futures.Future) -> torch.Tensor:
        nonlocal step, gathered, owners
        # wait(), not value(): on CUDA it also makes this stream wait for each collective's work (collect_all's
        # own future carries no devices), and raises the collective's error, if any
        try:
            for fut in done.value():
                fut.wait()
            return step.finish(gathered, step.dense, owners, step.half, step.int8)
        finally:
            # The collective's thread releases this function after it returns; whatever the closure still owned
            # would be freed there, taking the GIL once per tensor, and a process that ends meanwhile kills that
            # thread inside C++ (SIGABRT at exit, seen with Gloo). Released here, under the GIL, nothing is left.
            step = gathered = owners = None

    # collect_all even for one collective: its callback runs on the hook's stream, where this step's tensors were
    # made (a collective's own future would run it on a pool stream the step's temporaries are not recorded on)
    return torch.futures.collect_all(futures).then(finish)


# ---- checkpoints of every rank -------------------------------------------------------------------------------
class _DistTransport(TorchTensors):
    """core.checkpoint's collectives over torch.distributed (CPU tensors on Gloo; the device's on NCCL)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = device

    def allgather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, root: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, root) if self.group is not None else root,
                                   group=self.group)
        return box[0]

    def gather(self, value: torch.Tensor, root: int, key: str) -> Optional[List[torch.Tensor]]:
        flat = value.reshape(-1).contiguous().to(self.device)
        out = torch.empty(self.size * flat.numel(), dtype=flat.dtype, device=self.device)
        _all_gather_single(out, flat, group=self.group)
        return [row.cpu().clone() for row in out.view(self.size, -1)] if self.rank == root else None

    def scatter(self, values: Optional[List[torch.Tensor]], root: int, key: str, like: Mapping[str, Any]) -> torch.Tensor:
        dtype = getattr(torch, like["dtype"])
        out = torch.empty(int(like["numel"]), dtype=dtype, device=self.device)
        parts = [v.reshape(-1).to(device=self.device, dtype=dtype) for v in values] if self.rank == root else None
        src = dist.get_global_rank(self.group, root) if self.group is not None else root
        dist.scatter(out, parts, src=src, group=self.group)
        return out.cpu()

    def broadcast(self, value: Optional[torch.Tensor], root: int, key: str, like: Mapping[str, Any]) -> torch.Tensor:
        dtype = getattr(torch, like["dtype"])
        tensor = (value.reshape(-1).to(device=self.device, dtype=dtype) if value is not None
                  else torch.empty(int(like["numel"]), dtype=dtype, device=self.device))
        src = dist.get_global_rank(self.group, root) if self.group is not None else root
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor.cpu()


def _transport(state: TopKEFState) -> _DistTransport:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(state.process_group) == "nccl" \
        else torch.device("cpu")
    return _DistTransport(state.process_group, device)


def gather_state(state: TopKEFState, root_rank: int = 0) -> Optional[Dict[str, Any]]:
    """Collective: every rank's residuals in one dict on ``root_rank`` (None elsewhere), for one checkpoint file
    that :func:`restore_state` loads on the same or another number of ranks (core.checkpoint's policy: exact on
    the same world size; on another, every rank gets the ranks' mean residual, rescaled so the mass owed to the
    model is kept). Per-rank ``state.state_dict()`` / ``load_state_dict`` is the simpler exact alternative."""
    return core_checkpoint.gather_state(state, _transport(state), root_rank)


def restore_state(state: TopKEFState, checkpoint: Optional[Mapping[str, Any]], root_rank: int = 0) -> None:
    """Collective: load a :func:`gather_state` checkpoint held by ``root_rank`` (the other ranks may pass None)."""
    core_checkpoint.restore_state(state, checkpoint, _transport(state), root_rank, "average")


# update mode's optimizer side lives in its own module (it imports this one's launch lazily)
from .ddp_update import update_mode_optimizer  # noqa: E402
