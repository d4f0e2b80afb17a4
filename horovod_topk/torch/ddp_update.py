"""Update mode under PyTorch DDP: each rank steps its own optimizer, the updates travel (core.update_mode).

    state = TopKEFState(ratio=0.01, target="update", named_parameters=model.named_parameters())
    ddp_model.register_comm_hook(state, topk_ef_hook)
    opt = update_mode_optimizer(torch.optim.AdamW(ddp_model.parameters(), lr=3e-4), state)

A communication hook sees gradients and never the step, so update mode takes two places:

1. the hook (:func:`hold`), per DDP bucket during backward: no gradient collective. The bucket's plan fingerprint
   is checked on its first step under the same collective gradient mode uses, so ranks in different modes raise
   ``RankMismatch`` together instead of waiting on different collectives; one allreduce of the bucket's count of
   non-finite entries, and where any rank has one, every rank's bucket becomes NaN -- AMP's GradScaler then skips
   the step on every rank alike (each rank checks only its own gradients, which in update mode are not averaged:
   without this a rank that overflowed would skip while the others step and wait for it);
2. the optimizer's ``step()`` (:class:`DDPUpdateStep`): one allreduce of the ranks' non-finite counts (a gradient
   changed after the hook is caught too); every rank skips alike if any has one. Otherwise each rank's local update
   under the second moment (torch.local_updates: the calibrated one for Adam/AdamW by default, over one allreduce of
   the sketches), then the updates in buckets of ``bucket_bytes`` (in name order, the same on every rank) through
   the hook's own executor (torch.bucket_step + ddp.launch: one selection and one allgather or sparse allreduce per
   bucket, the small tensors in one allreduce), and every rank subtracts the same averaged update: bit-identical
   parameters. With ``ratio="auto"`` the step begins at the hook's bucket 0 (torch.ddp_auto: a decision due is
   taken there), and the wait for the updates' collectives is what the step waits for.

While ratio="auto" holds dense or fp16 a step takes the gradient route instead (core.update_mode): the hook reduces
each bucket as in gradient mode (its members' residuals in their update records), and ``step()`` makes the ranks'
own state their mean on entering the route (torch.gradient_route), then takes the same update from the averaged
gradient on every rank, with no collective.

Residuals are keyed ``update.<parameter name>`` in the hook's state, apart from gradient residuals, so that
``state.state_dict()`` per rank (with each rank's ``optimizer.state_dict()``: update mode's optimizer states differ
per rank) resumes exactly. This module imports no Horovod.
"""
from __future__ import annotations

import types
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.update_mode import NONFINITE_NAME, resolve_target, update_tensor_name
from .bucket_step import BucketStep
from .gradient_route import GRADIENT_ROUTE, LOCAL_ROUTE, GradientRoute
from .local_updates import LocalUpdates

__all__ = ["reduce_in_update_mode", "hold", "DDPUpdateStep", "update_mode_optimizer"]


def _waited(handle: Tuple[Any, torch.Tensor]) -> torch.Tensor:
    """The tensor of an in-place ``dist.all_reduce`` started by DDPUpdateStep._allreduce_sum_async, once done."""
    work, tensor = handle
    work.wait()
    return tensor


def reduce_in_update_mode(state: Any, bucket: dist.GradBucket, group: Any) -> torch.futures.Future[torch.Tensor]:
    """The hook in update mode. With ratio="auto" a step begins at bucket 0 (torch.ddp_auto: a decision due is
    taken there, before any of the step's collectives), which fixes the step's route (torch.gradient_route): while
    auto holds dense or fp16 the bucket is reduced as in gradient mode, into its members' update records, and the
    optimizer's step takes the update from the averaged gradient; otherwise (and at a fixed ratio) :func:`hold`."""
    step = state.update_step
    clock = state._clock
    if clock is None or step is None:
        return hold(state, bucket, group)
    if bucket.index() == 0:  # a step the optimizer never took (GradScaler skipped it) ends here
        step.route.begin_step(step.entries)
    clock.bucket(state, bucket, group)
    if not state.auto.holds_dense:
        step.route.take(LOCAL_ROUTE, step.entries)
        return hold(state, bucket, group)
    from .ddp import _reduce

    step.route.take(GRADIENT_ROUTE, step.entries)
    return clock.launched(bucket, _reduce(state, bucket, group, update_tensor_name))


def hold(state: Any, bucket: dist.GradBucket, group: Any) -> torch.futures.Future[torch.Tensor]:
    """The hook in update mode: the bucket's gradients stay on this rank (NaN on every rank when any rank's are
    not finite); its agreement check on the first step."""
    from .ddp import _check_agreement

    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    members, _ = state.bucket_members(bucket)
    plan = state.plan([(update_tensor_name(name), numel) for name, numel in members], buffer, world_size)
    if plan.name not in state._verified:
        _check_agreement(state, plan, buffer, group, world_size)
        state._verified.add(plan.name)
    count = torch.isfinite(buffer).logical_not_().sum().reshape(1).to(torch.float32) \
        if buffer.is_floating_point() else torch.zeros(1, device=buffer.device)

    def agree(fut: torch.futures.Future) -> torch.Tensor:
        nonlocal buffer
        agreed, buffer = buffer, None  # nothing left for the collective's thread to free (see ddp.launch)
        if float(fut.value()[0][0]) > 0:
            agreed.fill_(float("nan"))
        return agreed

    return dist.all_reduce(count, group=group, async_op=True).get_future().then(agree)


class DDPUpdateStep:
    """Update mode's ``step()`` for one optimizer under DDP (installed on the instance by update_mode_optimizer).

    Args:
        optimizer: the user's optimizer over the DDP model's parameters.
        state: the hook's TopKEFState (``target="update"``): configuration, residuals, names, process group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: Any) -> None:
        if state.target != "update":
            raise ValueError("horovod-topk: update_mode_optimizer needs TopKEFState(target='update'), or 'auto' "
                             "with an Adam/AdamW optimizer; with target='gradient' the hook averages gradients and "
                             "the optimizer steps as is")
        self.optimizer = optimizer
        self.state = state
        self.group = state.process_group if state.process_group is not None else dist.group.WORLD
        #: The user's optimizer class (its ``step`` is what "local" runs).
        self.user_class = type(optimizer)
        self.local = LocalUpdates(optimizer, self.user_class, state.registry, state.config, "",
                                  self._allreduce_sum, lambda: dist.get_world_size(self.group))
        #: "local", "shared" or "calibrated", resolved for this optimizer.
        self.second_moment = self.local.second_moment
        #: Steps every rank skipped because some rank's gradient held NaN/Inf.
        self.skipped_steps = 0
        #: Which route each step takes (the hook says, at bucket 0), and what entering and leaving the gradient
        #: route do (torch.gradient_route).
        self.route = GradientRoute(self.local, state, "", self._allreduce_sum_async, _waited,
                                   lambda: dist.get_world_size(self.group))
        if state.update_step is not None and state.update_step.optimizer is not optimizer:
            raise ValueError("horovod-topk: update_mode_optimizer was already called with another optimizer on this "
                             "TopKEFState; one state serves one update-mode optimizer (make a TopKEFState per model "
                             "and optimizer)")
        state.update_step = self

    def install(self) -> torch.optim.Optimizer:
        """Replace the optimizer instance's ``step`` (its class stays the user's); returns the optimizer."""
        optimizer = self.optimizer

        def step(_: Any, closure: Optional[Callable[[], Any]] = None) -> Any:
            if closure is not None:
                raise ValueError("horovod-topk: update mode does not take a closure in step(): call "
                                 "loss.backward() before optimizer.step()")
            self.step()
            return None

        optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(step), optimizer)  # type: ignore
        optimizer.topk_update_step = self  # type: ignore[attr-defined]
        return optimizer

    def _allreduce_sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        dist.all_reduce(values, group=self.group)
        return values

    def _allreduce_sum_async(self, values: torch.Tensor, name: str) -> Tuple[Any, torch.Tensor]:
        return dist.all_reduce(values, group=self.group, async_op=True), values

    def entries(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of every parameter the optimizer steps that requires a gradient, in name order: the
        same list on every rank (a parameter without a gradient on this rank contributes a zero one)."""
        entries = [(self.state.name_of(p), p) for group in self.optimizer.param_groups for p in group["params"]
                   if p.requires_grad]
        return sorted(entries, key=lambda entry: entry[0])

    def step(self) -> None:
        entries = self.entries()
        if not entries:
            return
        self.route.apply_deferred()
        if self.route.close_step() == GRADIENT_ROUTE:  # the hook averaged the gradients (torch.gradient_route)
            self.route.share(entries)
            if not self.route.step(entries):  # an averaged gradient is non-finite: on every rank alike
                self.skipped_steps += 1
            return
        self.route.absorb(entries)
        if not self._all_finite(entries):
            self.skipped_steps += 1
            return
        updates = self.local.compute(entries)
        if updates is None:  # the computed second moment's allreduce saw a non-finite gradient somewhere
            self.skipped_steps += 1
            return
        self._exchange_and_apply(entries, updates)

    def _all_finite(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> bool:
        """One allreduce of the ranks' counts of non-finite gradient entries (as the hook's, per step), which carries
        the computed second moment's statistics too (LocalUpdates.reduce_with_statistics)."""
        counts = [(~torch.isfinite(p.grad)).sum() for _, p in entries
                  if p.grad is not None and p.grad.is_floating_point()]
        device = entries[0][1].device
        count = torch.stack(counts).sum().reshape(1).float() if counts else torch.zeros(1, device=device)
        total = self.local.reduce_with_statistics(entries, count, NONFINITE_NAME)  # with the second moment's sums
        return float(total[0]) == 0.0

    def _buckets(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> List[List[int]]:
        """Consecutive entries (positions) in buckets of at most ``bucket_bytes`` float32 update bytes (one entry at
        least), the same on every rank; one bucket for everything where bucket_bytes is 0 or less."""
        cap = self.state.config.bucket_bytes
        buckets: List[List[int]] = [[]]
        size = 0
        for i, (_, p) in enumerate(entries):
            nbytes = 4 * p.numel()
            if buckets[-1] and cap > 0 and size + nbytes > cap:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        return buckets

    def _exchange_and_apply(self, entries: List[Tuple[str, torch.nn.Parameter]],
                            updates: List[torch.Tensor]) -> None:
        """The updates through the hook's bucket executor; every rank subtracts the same averaged update. With
        ratio="auto" the step's wait is the wait for these collectives (its clock began at the hook's bucket 0)."""
        from .ddp import _check_agreement, launch

        clock = self.state._clock
        world_size = dist.get_world_size(self.group)
        launched = []
        for positions in self._buckets(entries):
            buffer = torch.cat([updates[i].reshape(-1) for i in positions])
            members = [(update_tensor_name(entries[i][0]), entries[i][1].numel()) for i in positions]
            shapes = [tuple(entries[i][1].shape) for i in positions]
            plan = self.state.plan(members, buffer, world_size)
            if plan.name not in self.state._verified:
                _check_agreement(self.state, plan, buffer, self.group, world_size)
                self.state._verified.add(plan.name)
            step = BucketStep(self.state, plan, buffer, shapes, world_size)
            launched.append((positions, launch(self.state, step, self.group)))
        if clock is not None:
            clock.ready()
        with torch.no_grad():
            for positions, future in launched:
                averaged = future.wait()
                at = 0
                for i in positions:
                    p = entries[i][1]
                    p.sub_(averaged[at:at + p.numel()].view_as(p).to(p.dtype))
                    at += p.numel()
        if clock is not None:
            clock.done()


def update_mode_optimizer(optimizer: torch.optim.Optimizer, state: Any) -> torch.optim.Optimizer:
    """Make ``optimizer`` (over the DDP model's parameters) take update mode's step with the hook's ``state``
    (registered with ``topk_ef_hook``); returns the same object. With ``TopKEFState(target="update")`` always; with
    ``target="auto"`` (the default) where core.update_mode.resolve_target picks update mode for this optimizer
    (Adam/AdamW) -- otherwise the optimizer is
    returned as it is and the hook keeps averaging gradients. Call it before the first backward (the hook decides
    per bucket what to do with the gradients) and before building a learning-rate scheduler on the optimizer
    (schedulers wrap ``optimizer.step``)."""
    if state.config.target == "auto" and state.target != "update":
        user_class = type(optimizer)
        if resolve_target(state.config, f"{user_class.__module__}.{user_class.__qualname__}") != "update":
            return optimizer
        if any(record.steps for _, record in state.registry):
            raise ValueError("horovod-topk: update_mode_optimizer must wrap the optimizer before the first backward: "
                             "the hook has already averaged gradients (target='auto' picks update mode for "
                             f"{user_class.__name__}); or pass target='gradient' to TopKEFState")
        state.target = "update"
    return DDPUpdateStep(optimizer, state).install()
