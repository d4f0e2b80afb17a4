"""Update mode for ``hvd.DistributedOptimizer``: each rank steps on its own gradient, the updates travel (core.update_mode).

What one step does, on every rank:

1. backward: the routing holds each marked gradient locally (no collective; on a tensor's first step only the ranks'
   agreement check starts, under the same name gradient mode would use, so ranks in different modes raise instead
   of hanging);
2. ``synchronize()``: one allreduce of this rank's count of non-finite gradient entries, which carries the
   computed second moment's statistics too (below). When any rank has one, every rank's gradients are set to NaN,
   so that AMP's GradScaler skips the step on every rank alike, and a ``step()`` without GradScaler skips it too
   (nothing changes anywhere);
3. ``step()``: with the shared second moment, every tensor's block mean squares summed over the ranks, then this
   rank's Adam/AdamW update from the optimizer's own hyperparameters and state; with the calibrated one, every
   tensor's sketch and squared norm summed over the ranks, then this rank's Adam/AdamW update with its own moments,
   its squared gradient scaled by the tensor's noise share. Those sums came with synchronize()'s allreduce; where
   the user changed a gradient in between (clipped, unscaled), ``step()`` reduces the changed ones again; with
   ``second_moment="local"`` the user's optimizer steps and the update is parameters before minus after (the
   parameters are put back). Each update goes through the compressor's exchange (error feedback, selection,
   allgather / sparse allreduce / compact encoding, or a dense allreduce for small tensors), and every rank
   subtracts the average of the applied updates from the same parameters: bit-identical on every rank. The
   updates travel in buckets of ``bucket_bytes`` (one allgather, or one sparse allreduce, for each bucket's
   compressed members: core.buckets), which sends what the per-tensor exchange sends, bit for bit.

After the step ``p.grad`` still holds this rank's own gradient: no averaged gradient exists in update mode.

While ratio="auto" holds dense or fp16 a step runs the gradient route instead (core.update_mode): the compressor
starts each gradient's dense or fp16 allreduce from backward, ``synchronize()`` waits for them as Horovod does
(the first such step then makes every rank's own optimizer state their mean and applies the mean of the update
residuals, which the step's first gradient took out of the records), and ``step()`` takes the update from the
averaged gradient on every rank alike, with no collective. ``p.grad`` then holds the averaged gradient.
"""
from __future__ import annotations

import functools
import time
import types
import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..core import PendingReduction
from ..core.update_mode import NONFINITE_NAME, NORMALISING_OPTIMIZERS, update_tensor_name
from .gradient_route import GRADIENT_ROUTE, GradientRoute
from .local_updates import LocalUpdates

__all__ = ["UpdateStep", "LocalHandle", "adapt_broadcast_optimizer_state"]



class LocalHandle:
    """A gradient held on its rank in update mode: waiting returns it unchanged."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __call__(self) -> torch.Tensor:
        return self._tensor


class UpdateStep:
    """Update mode's ``synchronize`` and ``step`` for one ``hvd.DistributedOptimizer`` (installed on the instance).

    Args:
        optimizer: the object ``hvd.DistributedOptimizer`` returned (a subclass of the user's optimizer class).
        compressor: the TopKEF whose configuration says ``target="update"``; it holds the residuals.
        scope: this optimizer's name prefix in the compressor (core.scopes).
        dense_allreduce_async_, wait: Horovod's own allreduce and synchronize (the routing's originals).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        compressor: Any,
        scope: str,
        dense_allreduce_async_: Callable[..., Any],
        wait: Callable[[Any], torch.Tensor],
    ) -> None:
        self.optimizer = optimizer
        self.compressor = compressor
        self.config = compressor.config
        self.scope = scope
        self._dense_allreduce_async_ = dense_allreduce_async_
        self._wait = wait
        #: The user's optimizer class: Horovod builds a subclass of it per DistributedOptimizer call.
        self.user_class = type(optimizer).__mro__[1]
        #: Whether this step was found non-finite on some rank (set by synchronize, read by step).
        self._skip = False
        #: Steps every rank skipped because some rank's gradient held NaN/Inf.
        self.skipped_steps = 0
        #: Whether the updates' buckets are in the compressor's table (on the first step).
        self._bucketed = False
        #: Each rank's local update under the second moment (torch.local_updates), over Horovod's collectives.
        self.local = LocalUpdates(optimizer, self.user_class, compressor.registry, self.config, scope,
                                  self._allreduce_sum, lambda: self._process_set().size())
        #: "local", "shared" or "calibrated" (resolved for this optimizer; refused before training where a computed
        #: one was asked of an optimizer it cannot compute)
        self.second_moment = self.local.second_moment
        self.class_name = self.local.class_name
        #: Which route each step takes, and what entering and leaving the gradient route do (torch.gradient_route).
        self.route = GradientRoute(self.local, compressor, scope, self._allreduce_sum_async, self._wait,
                                   lambda: self._process_set().size(), self._averages)
        #: Whether dense and fp16 steps may take the gradient route: not with Horovod's ``groups=`` (its grouped
        #: reductions are named after groups, not parameters, where the route keys each gradient by its update's
        #: record); such an optimizer exchanges updates at every density.
        self.gradient_route_allowed = not getattr(optimizer, "_p_to_group", None)
        from horovod.torch.mpi_ops import Sum

        if getattr(optimizer, "op", None) == Sum and self.class_name in NORMALISING_OPTIMIZERS:
            short = self.class_name.rsplit(".", 1)[-1]
            raise ValueError(f"horovod-topk: TopKEF(target='update') with op=hvd.Sum would apply the sum of P "
                             f"normalised {short} updates (P times the step: its update does not grow with the "
                             f"gradient); use op=hvd.Average")

    def install(self) -> None:
        """Replace the optimizer instance's ``synchronize`` and ``step`` (its class and Horovod stay as they are)."""
        optimizer = self.optimizer
        horovod_synchronize = optimizer.synchronize  # resolves the held handles and first-step agreement checks

        def synchronize(_: Any) -> None:
            waiting = time.perf_counter()
            horovod_synchronize()
            route = self.route.close_step()
            if route == GRADIENT_ROUTE and self.compressor.auto is not None:  # what the step waits, as in gradient mode
                self.compressor.auto.waited(time.perf_counter() - waiting)
            if self._process_set().included():
                entries = self._entries()
                self._densify_sparse_gradients(entries)
                if route == GRADIENT_ROUTE:
                    self._refuse_sparse(entries)
                    self.route.share(entries)
                    return
                self.route.absorb(entries)
                self._agree_finite(entries)

        def step(_: Any, closure: Optional[Callable[[], Any]] = None) -> Any:
            if closure is not None:
                raise ValueError("horovod-topk: TopKEF(target='update') does not take a closure in step(): "
                                 "call loss.backward() before optimizer.step()")
            if optimizer._should_synchronize:
                if optimizer._synchronized:
                    warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                                  "optimizer.synchronize(): the gradients are checked twice.", stacklevel=2)
                optimizer.synchronize()
            optimizer._synchronized = False
            if not self._process_set().included():  # as Horovod: a rank outside the set steps on its own
                return self.user_class.step(optimizer)
            return self.step()

        # bound methods (LR schedulers wrap optimizer.step.__func__), through torch's own step hooks and profiling
        optimizer.synchronize = types.MethodType(synchronize, optimizer)  # type: ignore[method-assign]
        optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(step), optimizer)  # type: ignore
        optimizer.topk_update_step = self  # what the optimizer runs, for a user's (or a test's) inspection

    def initialize_state(self) -> bool:
        """Give every trainable parameter update mode's state -- created (step 0, a zero second moment) or adopted
        from an Adam state -- so that Horovod's broadcast_optimizer_state finds the same keys on every rank instead
        of initialising Adam's own with a step on zero gradients (a joining elastic worker would then hold other
        keys than the others, and the broadcast of mismatched keys would wait forever). Returns whether this rank
        adopted an Adam state (its first moments then go to the others too: adapt_broadcast_optimizer_state). The
        calibrated second moment keeps Adam's own keys, each rank's (an Adam state is its own already: nothing to
        adopt beyond float32 copies)."""
        return self.local.initialize_state(self._entries())

    def broadcast_first_moments(self, root_rank: int) -> None:
        """Every rank's first moments become ``root_rank``'s (after root adopted a gradient-mode Adam state, where
        the first moment is the averaged gradient's and belongs to every rank)."""
        import horovod.torch as hvd

        if not self._process_set().included():  # a rank outside the optimizer's process set holds no first moments
            return
        for name, p in self._entries():
            moment = self.local.first_moment(name, p)
            hvd.broadcast_(moment, root_rank=root_rank, name="topk.update.first_moment." + self.scope + name,
                           process_set=self._process_set())

    # ---- the gradient route (core.update_mode) ----------------------------------------------------------------
    def take_route(self, route: str) -> None:
        """The compressor's word on how this step's gradients go (torch.gradient_route.GradientRoute.take)."""
        self.route.take(route, self._entries)

    def forget_step(self) -> None:
        """Drop what the step in progress noted (a loaded state replaced the records it took residuals from)."""
        self.route.forget()

    # ---- the collectives ------------------------------------------------------------------------------------
    def _entries(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of every parameter Horovod reduces, in name order: the same list on every rank,
        whichever parameters this rank's backward reached (a parameter without a gradient here contributes a zero
        one). Horovod fixed that set when the optimizer was wrapped (``_requires_update``, the parameters that
        required gradients then) and gives each of them a gradient in ``synchronize()``, so the user's optimizer
        steps each of them: one frozen later still moves by its rank's own momentum, and its update must travel
        like every other, or the ranks' copies of it part."""
        names = self.optimizer._parameter_names
        reduced = self.optimizer._requires_update
        entries = [(names[p], p) for group in self.optimizer.param_groups for p in group["params"] if p in reduced]
        return sorted(entries, key=lambda entry: entry[0])

    @staticmethod
    def _gradient(p: torch.nn.Parameter) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _process_set(self) -> Any:
        from horovod.torch.mpi_ops import global_process_set

        return getattr(self.optimizer, "process_set", global_process_set)

    def _averages(self) -> bool:
        from horovod.torch.mpi_ops import Sum

        return getattr(self.optimizer, "op", None) != Sum

    def _allreduce_sum_async(self, values: torch.Tensor, name: str) -> Any:
        from horovod.torch.mpi_ops import Sum

        return self._dense_allreduce_async_(values, name=name, op=Sum, process_set=self._process_set())

    def _allreduce_sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        from horovod.torch.mpi_ops import Sum

        handle = self._dense_allreduce_async_(values, name=name, op=Sum, process_set=self._process_set())
        return self._wait(handle)

    def _densify_sparse_gradients(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> None:
        """With ``sparse_as_dense=True`` Horovod hands a sparse gradient back sparse after its (here: local)
        reduction; update mode steps the user's optimizer on it and exchanges the update, so it is made dense, as
        the option asks."""
        if getattr(self.optimizer, "sparse_as_dense", False):
            for _, p in entries:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()

    @staticmethod
    def _refuse_sparse(entries: List[Tuple[str, torch.nn.Parameter]]) -> None:
        sparse = [name for name, p in entries if p.grad is not None and p.grad.is_sparse]
        if sparse:
            raise ValueError(f"horovod-topk: TopKEF(target='update') needs dense gradients; {sparse} are sparse "
                             f"(nn.Embedding(sparse=True)): pass sparse_as_dense=True to hvd.DistributedOptimizer")

    def _agree_finite(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> None:
        """Every rank learns whether any rank's gradient holds NaN/Inf; if so every rank's gradients become NaN."""
        self._refuse_sparse(entries)
        counted = [(name, p) for name, p in entries if p.grad is not None and p.grad.is_floating_point()]
        counts = [(~torch.isfinite(p.grad)).sum() for _, p in counted]
        count = torch.stack(counts).sum().reshape(1).float().cpu() if counts else torch.zeros(1)
        # with a computed second moment, in one allreduce with its statistics (LocalUpdates.reduce_with_statistics)
        total = float(self.local.reduce_with_statistics(entries, count, NONFINITE_NAME)[0])
        self._count_bytes(entries[:1], [count.numel() * count.element_size()])
        self._skip = total > 0
        if self._skip:
            for (name, p), own in zip(counted, counts):
                if int(own) > 0:  # stats()["nonfinite_steps"]: this rank's tensors that were non-finite
                    self.compressor.registry.record(update_tensor_name(self.scope + name),
                                                    tuple(p.shape)).nonfinite_steps += 1
                p.grad.fill_(float("nan"))

    def _count_bytes(self, entries: List[Tuple[str, torch.nn.Parameter]], nbytes: List[int]) -> None:
        """Put what update mode's own collectives carried into the parameters' traffic counters (stats())."""
        for (name, p), n in zip(entries, nbytes):
            self.compressor.registry.record(update_tensor_name(self.scope + name), tuple(p.shape)).bytes_sent += n

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> None:
        entries = self._entries()
        self._bucket_updates(entries)
        if self.route.last == GRADIENT_ROUTE:
            self._skip = False
            if not self.route.step(entries):  # an averaged gradient is non-finite: on every rank alike
                self.skipped_steps += 1
            return None
        if self._skip:
            self._skip = False
            self.skipped_steps += 1
            return None
        updates = self.local.compute(entries)
        if updates is None:  # the gradients changed after synchronize() and some rank's are non-finite now
            self.skipped_steps += 1
            return None
        self._exchange_and_apply(entries, updates)
        return None

    def _bucket_updates(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> None:
        """Put the updates in buckets of TopKConfig.bucket_bytes (core.buckets), once. Every update is ready at the
        same time, after the local step, so a bucket waits for nothing that would have travelled earlier; on a GPU
        one run of the grouped kernels selects a bucket's members instead of ~20 launches each (why buckets are the
        default here too); on a CPU the bucket's copy into one payload measured ~4% of the step more than per
        tensor (docs/update-mode.md), where ``bucket_bytes=0`` is the faster choice. The members are the entries in
        name order, the same on every rank; names already bucketed are kept where they are. Horovod's ``groups=``
        concern gradient reductions, which update mode does not run."""
        if self._bucketed:
            return
        self._bucketed = True
        self.compressor.bucket_table.add(
            [(update_tensor_name(self.scope + name), p.numel() * p.element_size()) for name, p in entries],
            self.config.bucket_bytes)

    def _exchange_and_apply(self, entries: List[Tuple[str, torch.nn.Parameter]], updates: List[torch.Tensor]) -> None:
        """Every update through the compressor's exchange (dense allreduce where core's plan says dense); then
        ``p -= average`` with the same values on every rank. Waited in start order."""
        from horovod.torch.mpi_ops import Average

        optimizer = self.optimizer
        op = optimizer.op
        predivide = getattr(optimizer, "gradient_predivide_factor", 1.0)
        prescale, postscale = (1.0 / predivide, predivide) if op == Average else (1.0, 1.0)
        process_set = self._process_set()
        started = []
        for (name, p), update in zip(entries, updates):
            key = update_tensor_name(self.scope + name)
            pending = PendingReduction(self.compressor, update.dtype, tuple(update.shape), scope=self.scope)
            handle = self.compressor.start_exchange(
                update, pending, key, op=op, prescale_factor=prescale, postscale_factor=postscale,
                process_set=process_set)
            if handle is None:
                handle = self._dense_allreduce_async_(
                    update, name=key, op=op, prescale_factor=prescale, postscale_factor=postscale,
                    process_set=process_set)
            if p.element_size() < update.element_size():  # plain Horovod would send the gradient in p's dtype
                record = self.compressor.registry.record(key, tuple(update.shape))
                record.bytes_dense -= update.numel() * (update.element_size() - p.element_size())
            started.append((p, pending, handle))
        waiting = time.perf_counter()
        with torch.no_grad():
            for p, pending, handle in started:
                if pending.check is not None:
                    pending.check()
                applied = handle() if callable(handle) else self._wait(handle)
                p.sub_(applied.view_as(p).to(p.dtype))
        if self.compressor.auto is not None:  # ratio="auto" measures what the step waits for the updates
            self.compressor.auto.waited(time.perf_counter() - waiting)


def adapt_broadcast_optimizer_state() -> None:
    """Make Horovod's ``broadcast_optimizer_state`` (called by users at start-up and by elastic's sync) create update
    mode's state first (UpdateStep.initialize_state) on an optimizer in update mode. Replaced in memory in every
    module that imported it; idempotent."""
    import horovod.torch as hvd
    import horovod.torch.functions as functions
    from horovod.torch.elastic import state as elastic_state

    original = functions.broadcast_optimizer_state
    if getattr(original, "_horovod_topk", False):
        return

    @functools.wraps(original)
    def broadcast_optimizer_state(optimizer: Any, root_rank: int, *args: Any, **kwargs: Any) -> Any:
        update_step = getattr(optimizer, "topk_update_step", None)
        if update_step is None:
            return original(optimizer, root_rank, *args, **kwargs)
        adopted = update_step.initialize_state()
        result = original(optimizer, root_rank, *args, **kwargs)
        if hvd.broadcast_object(adopted, root_rank=root_rank, name="topk.update.adopted"):
            update_step.broadcast_first_moments(root_rank)  # root's adopted Adam first moment is everyone's
        return result

    setattr(broadcast_optimizer_state, "_horovod_topk", True)
    for module in (functions, hvd, elastic_state):
        if getattr(module, "broadcast_optimizer_state", None) is original:
            setattr(module, "broadcast_optimizer_state", broadcast_optimizer_state)
