"""Update mode for ``hvd.DistributedOptimizer``: each rank steps on its own gradient, the updates travel (core.update_mode).

What one step does, on every rank:

1. backward: the routing holds each marked gradient locally (no collective; on a tensor's first step only the ranks'
   agreement check starts, under the same name gradient mode would use, so ranks in different modes raise instead
   of hanging);
2. ``synchronize()``: one allreduce of this rank's count of non-finite gradient entries. When any rank has one,
   every rank's gradients are set to NaN, so that AMP's GradScaler skips the step on every rank alike, and a
   ``step()`` without GradScaler skips it too (nothing changes anywhere);
3. ``step()``: with the shared second moment, one allreduce of every tensor's block mean squares (after the user
   clipped or unscaled), then this rank's Adam/AdamW update from the optimizer's own hyperparameters and state;
   with the calibrated one, one allreduce of every tensor's sketch and squared norm, then this rank's Adam/AdamW
   update with its own moments, its squared gradient scaled by the tensor's noise share; with
   ``second_moment="local"`` the user's optimizer steps and the update is parameters before minus after (the
   parameters are put back). Each update goes through the compressor's exchange (error feedback, selection,
   allgather / sparse allreduce / compact encoding, or a dense allreduce for small tensors), and every rank
   subtracts the average of the applied updates from the same parameters: bit-identical on every rank.

After the step ``p.grad`` still holds this rank's own gradient: no averaged gradient exists in update mode.
"""
from __future__ import annotations

import functools
import time
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..core import PendingReduction
from ..core.update_mode import (
    MOMENTS_NAME,
    NOISE_SHARE_NAME,
    NORMALISING_OPTIMIZERS,
    NONFINITE_NAME,
    block_count,
    moments_layout,
    resolve_second_moment,
    shared_moment_hyperparameters,
    sketch_layout,
    sketch_salt,
    update_tensor_name,
)
from . import update_rule

__all__ = ["UpdateStep", "LocalHandle", "adapt_broadcast_optimizer_state"]

#: What torch.optim.Adam/AdamW keep per parameter (without amsgrad): a state update mode adopts, and the calibrated
#: second moment's own (each rank's, as a local Adam's would be).
_ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}
#: The optimizer-state tensors each computed second moment keeps in float32 whatever the parameters' dtype.
_FLOAT32_KEYS = {"shared": ("shared_exp_avg_sq",), "calibrated": ("exp_avg", "exp_avg_sq")}


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
        #: The user's class by module and name (core.update_mode.ADAM_FAMILY is keyed so).
        self.class_name = f"{self.user_class.__module__}.{self.user_class.__qualname__}"
        #: "local", "shared" or "calibrated" (TopKConfig.second_moment resolved for this optimizer; refused here,
        #: before training, when a computed one was asked of an optimizer it cannot compute)
        self.second_moment = resolve_second_moment(self.config.second_moment, self.class_name, optimizer.param_groups)
        from horovod.torch.mpi_ops import Sum

        if getattr(optimizer, "op", None) == Sum and self.class_name in NORMALISING_OPTIMIZERS:
            short = self.class_name.rsplit(".", 1)[-1]
            raise ValueError(f"horovod-topk: TopKEF(target='update') with op=hvd.Sum would apply the sum of P "
                             f"normalised {short} updates (P times the step: its update does not grow with the "
                             f"gradient); use op=hvd.Average")
        self._keep_float32_state_on_load()

    def install(self) -> None:
        """Replace the optimizer instance's ``synchronize`` and ``step`` (its class and Horovod stay as they are)."""
        optimizer = self.optimizer
        horovod_synchronize = optimizer.synchronize  # resolves the held handles and first-step agreement checks

        def synchronize(_: Any) -> None:
            horovod_synchronize()
            if self._process_set().included():
                entries = self._entries()
                self._densify_sparse_gradients(entries)
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
        if self.second_moment == "calibrated":
            for name, p in self._entries():
                self._own_state(name, p)
            return False
        if self.second_moment != "shared":
            return False
        adopted = False
        for name, p in self._entries():
            adopted |= set(self.optimizer.state[p]) == _ADAM_KEYS
            self._shared_state(name, p)
        return adopted

    def broadcast_first_moments(self, root_rank: int) -> None:
        """Every rank's first moments become ``root_rank``'s (after root adopted a gradient-mode Adam state, where
        the first moment is the averaged gradient's and belongs to every rank)."""
        import horovod.torch as hvd

        if not self._process_set().included():  # a rank outside the optimizer's process set holds no first moments
            return
        for name, p in self._entries():
            moment = self._first_moment(name, p)
            hvd.broadcast_(moment, root_rank=root_rank, name="topk.update.first_moment." + self.scope + name,
                           process_set=self._process_set())

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

    def _agree_finite(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> None:
        """Every rank learns whether any rank's gradient holds NaN/Inf; if so every rank's gradients become NaN."""
        sparse = [name for name, p in entries if p.grad is not None and p.grad.is_sparse]
        if sparse:
            raise ValueError(f"horovod-topk: TopKEF(target='update') needs dense gradients; {sparse} are sparse "
                             f"(nn.Embedding(sparse=True)): pass sparse_as_dense=True to hvd.DistributedOptimizer")
        counted = [(name, p) for name, p in entries if p.grad is not None and p.grad.is_floating_point()]
        counts = [(~torch.isfinite(p.grad)).sum() for _, p in counted]
        count = torch.stack(counts).sum().reshape(1).float().cpu() if counts else torch.zeros(1)
        total = float(self._allreduce_sum(count, NONFINITE_NAME)[0])
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
        if self._skip:
            self._skip = False
            self.skipped_steps += 1
            return None
        if self.second_moment in ("shared", "calibrated"):
            compute = self._shared_moment_updates if self.second_moment == "shared" else self._calibrated_updates
            updates = compute(entries)
            if updates is None:  # the gradients changed after synchronize() and some rank's are non-finite now
                self.skipped_steps += 1
                return None
        else:
            updates = self._local_updates(entries)
        self._exchange_and_apply(entries, updates)
        return None

    def _shared_moment_updates(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> Optional[List[torch.Tensor]]:
        """Each parameter's Adam/AdamW update under the shared block second moment, from this rank's gradient and
        first moment; None when some rank's gradient is non-finite (every rank returns None alike)."""
        block = self.config.second_moment_block
        layout = moments_layout([p.numel() for _, p in entries], block)
        hyper, group_of = self._hyperparameters()
        device = entries[0][1].device if entries else torch.device("cpu")
        squares = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        for (offset, count), (_, p) in zip(layout.spans, entries):
            _, _, _, _, weight_decay, decoupled = hyper[group_of[id(p)]]
            gradient = self._gradient(p)
            if weight_decay and not decoupled:  # Adam's L2 penalty is part of the gradient both moments see
                gradient = gradient.add(p.detach(), alpha=weight_decay)
            squares[offset:offset + count] = update_rule.block_mean_squares(gradient, block).to(device)
        world_size = self._process_set().size()
        shared = self._allreduce_sum(squares, MOMENTS_NAME)
        self._count_bytes(entries, [4 * count for _, count in layout.spans])
        if not bool(torch.isfinite(shared).all()):  # a NaN/Inf gradient entry anywhere makes its block non-finite
            return None
        shared /= world_size
        updates = []
        for (offset, count), (name, p) in zip(layout.spans, entries):
            lr, beta1, beta2, eps, weight_decay, decoupled = hyper[group_of[id(p)]]
            state = self._shared_state(name, p)
            state["step"] += 1
            update_rule.update_second_moment(state["shared_exp_avg_sq"], shared[offset:offset + count].to(p.device),
                                             beta2)
            updates.append(update_rule.adam_update(
                p.detach(), self._gradient(p), self._first_moment(name, p), state["shared_exp_avg_sq"],
                int(state["step"]), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                decoupled=decoupled, block=block,
            ))
        return updates

    def _hyperparameters(self) -> Tuple[Dict[int, Tuple[float, float, float, float, float, bool]], Dict[int, int]]:
        """Each parameter group's (lr, beta1, beta2, eps, weight_decay, decoupled), read once per step (no
        per-tensor host reads), and the group of each parameter (by id)."""
        hyper = {id(group): shared_moment_hyperparameters(self.class_name, group, self.second_moment)
                 for group in self.optimizer.param_groups}
        group_of = {id(p): id(group) for group in self.optimizer.param_groups for p in group["params"]}
        return hyper, group_of

    def _calibrated_updates(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> Optional[List[torch.Tensor]]:
        """Each parameter's Adam/AdamW update from this rank's own moments, its second moment fed the squared
        gradient times the tensor's noise share (core.update_mode: one allreduce of every tensor's sketch and
        squared norm); None when some rank's gradient is non-finite (every rank returns None alike)."""
        layout = sketch_layout(len(entries), self.config.second_moment_sketch)
        hyper, group_of = self._hyperparameters()
        device = entries[0][1].device if entries else torch.device("cpu")
        contributions = torch.zeros(layout.tensors, layout.width + 1, dtype=torch.float32, device=device)
        # The signs' step: the optimizer's step about to be taken, the same on every rank and in a checkpoint
        # (broadcast at start, moved alike), so a resumed job draws the signs the uninterrupted one would.
        step = int(self._own_state(*entries[0])["step"]) + 1 if entries else 0
        gradients = []
        for position, (name, p) in enumerate(entries):
            _, _, _, _, weight_decay, decoupled = hyper[group_of[id(p)]]
            gradient = self._gradient(p)
            if weight_decay and not decoupled:  # Adam's L2 penalty is part of the gradient both moments see
                gradient = gradient.add(p.detach(), alpha=weight_decay)
            gradients.append(gradient)
            update_rule.sketch_into(contributions[position], gradient.to(device), sketch_salt(step, position))
        summed = self._allreduce_sum(contributions.view(-1), NOISE_SHARE_NAME)
        self._count_bytes(entries, [4 * (layout.width + 1)] * len(entries))
        if not bool(torch.isfinite(summed).all()):  # a NaN/Inf gradient entry anywhere makes its sketch non-finite
            return None
        shares = update_rule.noise_shares(summed.view(layout.tensors, layout.width + 1), self._process_set().size())
        updates = []
        for position, ((name, p), gradient) in enumerate(zip(entries, gradients)):
            lr, beta1, beta2, eps, weight_decay, decoupled = hyper[group_of[id(p)]]
            state = self._own_state(name, p)
            state["step"] += 1
            share = shares[position]
            self.compressor.registry.record(update_tensor_name(self.scope + name), tuple(p.shape)).noise_share = share
            squared = gradient.float().square().mul_(share.to(p.device))
            update_rule.update_second_moment(state["exp_avg_sq"], squared, beta2)
            updates.append(update_rule.adam_update(
                p.detach(), gradient, state["exp_avg"], state["exp_avg_sq"], int(state["step"]), lr=lr, beta1=beta1,
                beta2=beta2, eps=eps, weight_decay=weight_decay if decoupled else 0.0, decoupled=decoupled,
            ))
        return updates

    def _own_state(self, name: str, p: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        """This rank's own Adam state of ``p`` under the calibrated second moment, in Adam's keys (the step as a
        float32 host tensor, the moments in float32 shaped as ``p``): created on first use, or continued from an
        Adam/AdamW state (a gradient-mode or "local" checkpoint: the same quantities), cast to float32."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        elif set(state) != _ADAM_KEYS:
            raise ValueError(
                f"horovod-topk: the optimizer's state of {name!r} holds {sorted(state)}, not Adam's; the calibrated "
                f"second moment starts from a fresh optimizer state or an Adam/AdamW state (of gradient mode, "
                f"second_moment='local' or its own).")
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            if value.shape != p.shape:
                raise ValueError(f"horovod-topk: the optimizer's {key} of {name!r} is shaped {tuple(value.shape)}, "
                                 f"the parameter {tuple(p.shape)} (a state of another model?)")
            if value.dtype != torch.float32 or value.device != p.device:
                state[key] = value.to(device=p.device, dtype=torch.float32)
        if not torch.is_tensor(state["step"]) or state["step"].device.type != "cpu":  # fused Adam: on the device
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().clone()
        return state

    def _shared_state(self, name: str, p: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        """What every rank holds alike, in the optimizer's state of ``p`` (so the usual rank-0 optimizer checkpoint
        saves it): the step (a float32 tensor on the host, as torch keeps it: read without a device sync) and the
        shared block second moment (float32) -- created on first use, or adopted from Adam's own state."""
        blocks = block_count(p.numel(), self.config.second_moment_block)
        state = self.optimizer.state[p]
        if "shared_exp_avg_sq" not in state:
            if set(state) == _ADAM_KEYS:
                self._adopt_adam_state(name, p, state)
            elif len(state) != 0:
                raise ValueError(
                    f"horovod-topk: the optimizer's state of {name!r} holds {sorted(state)}, neither Adam's nor "
                    f"update mode's; update mode's shared second moment starts from a fresh optimizer state, an "
                    f"Adam/AdamW state, or one it saved itself.")
            else:
                state["step"] = torch.tensor(0.0)
                state["shared_exp_avg_sq"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        elif state["shared_exp_avg_sq"].numel() != blocks:
            raise ValueError(f"horovod-topk: the shared second moment of {name!r} has "
                             f"{state['shared_exp_avg_sq'].numel()} blocks, the parameter needs {blocks} "
                             f"(another second_moment_block or another model?)")
        if state["step"].device.type != "cpu":  # fused/capturable Adam keeps it on the device
            state["step"] = state["step"].cpu()
        return state

    def _adopt_adam_state(self, name: str, p: torch.nn.Parameter, state: Dict[str, torch.Tensor]) -> None:
        """Continue from Adam's own state of ``p`` (a gradient-mode checkpoint): its second moment averaged over
        each block becomes the shared one, its first moment this rank's, its step the step. A gradient-mode Adam
        state is the same on every rank (made from the averaged gradient), so the shared second moment is too;
        loaded on one rank only, broadcast_optimizer_state sends the adopted state to the others
        (adapt_broadcast_optimizer_state)."""
        first_moment = self._first_moment(name, p)
        if not bool(first_moment.any()):  # a record of its own (a checkpoint of update mode) takes precedence
            first_moment.copy_(state["exp_avg"].float())
        state["shared_exp_avg_sq"] = update_rule.block_means(state["exp_avg_sq"], self.config.second_moment_block)
        state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().clone()
        del state["exp_avg"], state["exp_avg_sq"]

    def _keep_float32_state_on_load(self) -> None:
        """torch's Optimizer.load_state_dict casts every state tensor but ``step`` to its parameter's dtype: a
        float16/bfloat16 model would get half-precision moments (in bfloat16 ``v * 0.999 == v``). The load's
        pre-hook keeps the incoming float32 values of the computed second moment's keys, its post-hook puts them
        back."""
        keys = _FLOAT32_KEYS.get(self.second_moment, ())
        kept: Dict[Tuple[int, str], torch.Tensor] = {}

        def keep(optimizer: Any, state_dict: Dict[str, Any]) -> None:
            kept.clear()
            for index, values in state_dict.get("state", {}).items():
                for key in keys:
                    value = values.get(key) if isinstance(values, dict) else None
                    if torch.is_tensor(value):
                        kept[index, key] = value.float().clone()

        def restore(optimizer: Any) -> None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for (index, key), value in kept.items():
                if index < len(params) and key in optimizer.state[params[index]]:
                    optimizer.state[params[index]][key] = value.to(params[index].device)
            kept.clear()

        self.optimizer.register_load_state_dict_pre_hook(keep)
        self.optimizer.register_load_state_dict_post_hook(restore)

    def _first_moment(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's own first moment (float32, shaped as ``p``), kept in the compressor's record of the update
        next to its residual: both are this rank's alone, so the compressor's per-rank checkpoints (state_dict,
        gather_state, elastic) carry them, and on another world size each new rank gets the mean of the saved ones
        -- the averaged first moment, which is what the averaged update is made of."""
        record = self.compressor.registry.record(update_tensor_name(self.scope + name), tuple(p.shape))
        if record.momentum is None:
            record.momentum = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        elif record.momentum.device != p.device or record.momentum.dtype != torch.float32:
            record.momentum = record.momentum.to(device=p.device, dtype=torch.float32)
        if record.momentum.numel() != p.numel():
            raise ValueError(f"horovod-topk: the first moment of {name!r} has {record.momentum.numel()} elements, the "
                             f"parameter {p.numel()} (a state_dict of another model?)")
        return record.momentum.view(p.shape)

    def _local_updates(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> List[torch.Tensor]:
        """The user's optimizer steps on this rank's gradient; each update is parameters before minus after (float32),
        and the parameters are put back to before, where every rank holds the same values."""
        with torch.no_grad():
            before = [p.detach().clone() for _, p in entries]
            self.user_class.step(self.optimizer)
            updates = [_difference(b, p.detach()) for b, (_, p) in zip(before, entries)]
            for b, (_, p) in zip(before, entries):
                p.copy_(b)
        return updates

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


def _difference(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``before - after`` as a float32 update, subtracted in float32 or the parameters' own wider dtype: half
    precision values are exact in float32, and a float64 model's small steps would round away in float32 before the
    subtraction."""
    wide = torch.promote_types(before.dtype, torch.float32)
    return (before.to(wide) - after.to(wide)).float()


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
