"""Update mode's gradient route in PyTorch (core.update_mode, "The gradient route"): while ratio="auto" holds dense
or fp16, a step of update mode runs as gradient mode, and what changes hands at the route's edges.

A front end's update step keeps one :class:`GradientRoute`. The compressor tells it, at each gradient, which route
the step takes (:meth:`GradientRoute.take`: fixed at the step's first gradient, where a decision due is taken);
once the step's collectives are done the front end closes the step (:meth:`GradientRoute.close_step`) and, on the
gradient route, calls :meth:`GradientRoute.share` (a no-op unless the step enters the route), otherwise
:meth:`GradientRoute.absorb` (a no-op unless the step leaves it). Entering: every rank's own optimizer state
becomes the ranks' mean and the mean of the update residuals is applied to the parameters; the residuals were
taken out of their records at the step's first gradient, before the gradients' exchange (which keeps its own
residual in the same record) could add them to a gradient. Leaving: what fp16 left in the records is gradient, and
joins each rank's own gradient. Which optimizers' last step ran the gradient route is ratio="auto"'s state
(AutoDensity.shared_scopes), saved with it.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ..core.update_mode import share_name, update_tensor_name
from .local_updates import LocalUpdates

__all__ = ["GRADIENT_ROUTE", "LOCAL_ROUTE", "GradientRoute"]

#: How a step of update mode reduces: the gradients held on their ranks and the updates exchanged, or the gradients
#: exchanged as in gradient mode.
LOCAL_ROUTE = "local"
GRADIENT_ROUTE = "gradient"

#: (name, parameter) pairs in the ranks' common order.
Entries = List[Tuple[str, torch.nn.Parameter]]


class GradientRoute:
    """The route of one update-mode optimizer's steps.

    Args:
        local: the optimizer's LocalUpdates (which state tensors are each rank's own).
        compressor: the compressor whose records hold the update residuals and whose ``auto`` holds the choice.
        scope: the optimizer's name prefix in the compressor (core.scopes).
        allreduce_sum_async: ``(tensor, collective name) -> handle`` of an in-place sum over the ranks.
        wait: ``handle -> the summed tensor``.
        world_size: ``() -> the number of ranks that average``.
        averages: ``() -> whether the optimizer's reduction averages`` (else it sums, ``op=hvd.Sum``: what the
            ranks' updates applied, and what they owe, is then the sum of theirs, and so is the common state).
    """

    def __init__(self, local: LocalUpdates, compressor: Any, scope: str,
                 allreduce_sum_async: Callable[[torch.Tensor, str], Any], wait: Callable[[Any], torch.Tensor],
                 world_size: Callable[[], int], averages: Callable[[], bool] = lambda: True) -> None:
        self.local = local
        self.compressor = compressor
        self.scope = scope
        self._allreduce_sum_async = allreduce_sum_async
        self._wait = wait
        self._world_size = world_size
        self._averages = averages
        #: The mean update residual a share() made during backward (a step the optimizer never took), per
        #: parameter: applied by the next step's update (:meth:`apply_deferred`).
        self._deferred: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
        #: The route this step's gradients take (None until its first gradient), and the last closed step's.
        self._step: Optional[str] = None
        self.last = LOCAL_ROUTE
        #: Update residuals taken out of their records by the first gradient of a step entering the route.
        self._leftovers: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []

    def take(self, route: str, entries: Callable[[], Entries]) -> None:
        """The step's gradients go by ``route`` (the same for every gradient of a step). The first gradient of a
        step entering the gradient route takes the update residuals of ``entries()`` out of their records."""
        if self._step is None:
            self._step = route
            if route == GRADIENT_ROUTE and not self.shared:
                self._take_update_residuals(entries())
        elif self._step != route:
            raise RuntimeError(f"horovod-topk: one step of update mode took both the {self._step!r} and the "
                               f"{route!r} route (ratio='auto' changed its choice within a step)")

    def begin_step(self, entries: Callable[[], Entries]) -> None:
        """A step begins (DDP: bucket 0), before its route is taken. A step whose gradients were reduced but whose
        optimizer step never ran (AMP's GradScaler skipped it: its gradients were not finite) is closed here; if it
        entered the gradient route, its state is shared now, every rank being at the same bucket, and its residuals'
        mean waits for the next optimizer step (the parameters may not change during backward)."""
        if self._step is None:
            return
        if self.close_step() == GRADIENT_ROUTE:
            self.share(entries(), defer=True)

    def apply_deferred(self) -> None:
        """Apply what a share() during backward left for the optimizer step (:meth:`begin_step`)."""
        deferred, self._deferred = self._deferred, []
        with torch.no_grad():
            for p, residual in deferred:
                p.sub_(residual.view_as(p).to(p.dtype))

    def close_step(self) -> str:
        """The route of the step whose collectives are done (the last one's where no gradient reached the
        compressor since: a second synchronize() of one step)."""
        if self._step is not None:
            self.last, self._step = self._step, None
        return self.last

    def forget(self) -> None:
        """Drop the step in progress (a loaded state replaced the records its residuals came from)."""
        self._step, self._leftovers, self._deferred = None, [], []

    @property
    def shared(self) -> bool:
        """Whether this optimizer's last step ran the gradient route (its ranks' own state is the same)."""
        auto = self.compressor.auto
        return auto is not None and self.scope in auto.shared_scopes

    def _mark_shared(self, shared: bool) -> None:
        scopes = self.compressor.auto.shared_scopes
        if shared and self.scope not in scopes:
            scopes.append(self.scope)
        elif not shared and self.scope in scopes:
            scopes.remove(self.scope)

    def _record(self, name: str) -> Any:
        return self.compressor.registry.records.get(update_tensor_name(self.scope + name))

    def _take_update_residuals(self, entries: Entries) -> None:
        for name, p in entries:
            record = self._record(name)
            if record is not None and record.residual is not None:
                self._leftovers.append((p, record.residual))
                record.residual = None

    def share(self, entries: Entries, defer: bool = False) -> None:
        """On the step entering the gradient route: every rank's own optimizer state (LocalUpdates.own_state)
        becomes the ranks' mean (their sum under ``op=hvd.Sum``), and so does the update residual, which is applied
        to the parameters (``defer``: by the next optimizer step), so that the same update from the same averaged
        gradient keeps every rank's parameters equal. Nothing while the route holds, nor after a resume within it."""
        if self.shared:
            self._resync(entries)
            return
        leftovers = {id(p): residual for p, residual in self._leftovers}
        self._leftovers = []
        residuals = []
        for _, p in entries:
            residual = leftovers.get(id(p))  # a loaded residual may be on the host, in another dtype
            residuals.append(torch.zeros(p.numel(), dtype=torch.float32, device=p.device) if residual is None
                             else residual.to(device=p.device, dtype=torch.float32))  # every rank sends one
        self._combine(entries, residuals)
        self._deferred.extend((p, residual) for (_, p), residual in zip(entries, residuals))
        if not defer:
            self.apply_deferred()
        self._mark_shared(True)

    def _resync(self, entries: Entries) -> None:
        """After Horovod elastic reset the job (core.checkpoint.sync_after_reset), the ranks' own state is made
        their mean again, once: a joined worker's first moments are its own. The residuals hold gradient here and
        stay where they are."""
        scopes = self.compressor.auto.resync_scopes
        if self.scope not in scopes:
            return
        scopes.remove(self.scope)
        self._combine(entries)

    def _combine(self, entries: Entries, residuals: Optional[List[torch.Tensor]] = None) -> None:
        """Every entry's own state (and its residual, where given) made, in place, the ranks' mean -- their sum
        under ``op=hvd.Sum`` -- one collective per tensor, named from the parameter, all in flight together."""
        started = []
        for position, (name, p) in enumerate(entries):
            extra = [residuals[position]] if residuals is not None else []
            for index, tensor in enumerate(self.local.own_state(name, p) + extra):
                started.append(self._allreduce_sum_async(tensor, share_name(self.scope + name, index)))
        size = self._world_size() if self._averages() else 1
        for handle in started:
            self._wait(handle).div_(size)

    def step(self, entries: Entries) -> bool:
        """A step on the gradient route: the update from the averaged gradient (LocalUpdates.compute_averaged),
        subtracted on every rank alike; False when an averaged gradient is non-finite (the step is skipped)."""
        updates = self.local.compute_averaged(entries)
        if updates is None:
            return False
        with torch.no_grad():
            for (_, p), update in zip(entries, updates):
                p.sub_(update.view_as(p).to(p.dtype))
        return True

    def absorb(self, entries: Entries) -> None:
        """On the first step back in update mode: what fp16 left in the records is gradient, this rank's own; it
        joins this rank's gradient before the local step (error feedback keeps it). Nothing otherwise."""
        if not self.shared:
            return
        if self.scope in self.compressor.auto.resync_scopes:  # update mode keeps each rank's own state anyway
            self.compressor.auto.resync_scopes.remove(self.scope)
        with torch.no_grad():
            for name, p in entries:
                record = self._record(name)
                if record is None or record.residual is None:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.add_(record.residual.to(device=p.grad.device, dtype=p.grad.dtype).view_as(p.grad))
                record.residual = None
        self._mark_shared(False)
