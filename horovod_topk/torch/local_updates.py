"""Each rank's own optimizer update in update mode (core.update_mode), whatever carries the updates afterwards.

A front end (Horovod's DistributedOptimizer: torch.update_mode; DDP: torch.ddp_update) hands this class the
parameters to step and two seams -- an allreduce-sum of a small float32 buffer and the world size -- and gets back
each parameter's local update, parameters before minus after, in float32; it exchanges and applies them itself.
What is here: the three second moments (``"local"``: the user's optimizer steps and is undone; ``"shared"`` and
``"calibrated"``: Adam/AdamW's step computed from the optimizer's own hyperparameters and state, through
torch.update_rule's pure functions), the optimizer state each keeps, and each rank's first moment in the
compressor's record next to its residual.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..core.update_mode import (
    COMPUTED_SECOND_MOMENTS,
    MOMENTS_NAME,
    NOISE_SHARE_NAME,
    block_count,
    moments_layout,
    resolve_second_moment,
    shared_moment_hyperparameters,
    sketch_layout,
    sketch_salt,
    update_tensor_name,
    with_nonfinite_count,
)
from . import update_rule

__all__ = ["LocalUpdates", "ADAM_KEYS"]

#: What torch.optim.Adam/AdamW keep per parameter (without amsgrad): a state update mode adopts, and the calibrated
#: second moment's own (each rank's, as a local Adam's would be).
ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}
#: The optimizer-state tensors each computed second moment keeps in float32 whatever the parameters' dtype.
_FLOAT32_KEYS = {"shared": ("shared_exp_avg_sq",), "calibrated": ("exp_avg", "exp_avg_sq")}

#: (name, parameter) pairs in the ranks' common order.
Entries = List[Tuple[str, torch.nn.Parameter]]


class LocalUpdates:
    """One optimizer's local updates under update mode's second moment.

    Args:
        optimizer: the user's optimizer object (or the front end's subclass of it).
        user_class: the user's optimizer class, whose ``step`` the ``"local"`` second moment runs.
        registry: the compressor's error-feedback registry (its records hold each update's residual, first moment
            and noise share).
        config: the compressor's TopKConfig (second_moment, its block and sketch).
        scope: the optimizer's name prefix in the registry (core.scopes; "" where there is one optimizer).
        allreduce_sum: ``(float32 tensor, collective name) -> the ranks' sum`` (blocking).
        world_size: ``() -> the number of ranks that average``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, user_class: type, registry: Any, config: Any, scope: str,
                 allreduce_sum: Callable[[torch.Tensor, str], torch.Tensor], world_size: Callable[[], int]) -> None:
        self.optimizer = optimizer
        self.user_class = user_class
        self.registry = registry
        self.config = config
        self.scope = scope
        self._allreduce_sum = allreduce_sum
        self.world_size = world_size
        #: The user's class by module and name (core.update_mode.ADAM_FAMILY is keyed so).
        self.class_name = f"{user_class.__module__}.{user_class.__qualname__}"
        #: "local", "shared" or "calibrated" (TopKConfig.second_moment resolved for this optimizer; refused here,
        #: before training, when a computed one was asked of an optimizer it cannot compute)
        self.second_moment = resolve_second_moment(config.second_moment, self.class_name, optimizer.param_groups)
        #: The statistics reduce_with_statistics reduced, until compute() takes them.
        self._kept: Optional[_Statistics] = None
        self._keep_float32_state_on_load()

    def compute(self, entries: Entries) -> Optional[List[torch.Tensor]]:
        """Each entry's local update (float32, shaped as its parameter); None when the computed second moment's
        allreduce found some rank's gradient non-finite (every rank returns None alike: the step is skipped)."""
        if self.second_moment == "shared":
            return self._shared_moment_updates(entries)
        if self.second_moment == "calibrated":
            return self._calibrated_updates(entries)
        return self._local_updates(entries)

    def compute_averaged(self, entries: Entries) -> Optional[List[torch.Tensor]]:
        """Each entry's update from the *averaged* gradient now in ``p.grad`` (the gradient route: core.update_mode),
        the same on every rank from the same state: Adam/AdamW's update with the second moment fed the square of
        the averaged gradient (per entry, or per block for the shared one), or the user's own step (``"local"``:
        the parameters move here, and the list is empty). No collective. None when an averaged gradient is
        non-finite (on every rank alike: the step is skipped and nothing moves)."""
        gradients = [self._gradient(p) for _, p in entries]
        if gradients and not bool(torch.stack([torch.isfinite(g).all() for g in gradients]).all()):
            return None
        if self.second_moment not in COMPUTED_SECOND_MOMENTS:
            self.user_class.step(self.optimizer)
            return []
        hyper, group_of = self._hyperparameters()
        updates = []
        for (name, p), gradient in zip(entries, gradients):
            lr, beta1, beta2, eps, weight_decay, decoupled = hyper[group_of[id(p)]]
            if weight_decay and not decoupled:  # Adam's L2 penalty is part of the gradient both moments see
                gradient = gradient.add(p.detach(), alpha=weight_decay)
            if self.second_moment == "shared":
                state = self._shared_state(name, p)
                state["step"] += 1
                update_rule.update_second_moment(
                    state["shared_exp_avg_sq"],
                    update_rule.block_mean_squares(gradient, self.config.second_moment_block).to(p.device), beta2)
                updates.append(update_rule.adam_update(
                    p.detach(), gradient, self.first_moment(name, p), state["shared_exp_avg_sq"], int(state["step"]),
                    lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay if decoupled else 0.0,
                    decoupled=decoupled, block=self.config.second_moment_block))
                continue
            state = self._own_state(name, p)
            state["step"] += 1
            update_rule.update_second_moment(state["exp_avg_sq"], gradient.float().square(), beta2)
            updates.append(update_rule.adam_update(
                p.detach(), gradient, state["exp_avg"], state["exp_avg_sq"], int(state["step"]), lr=lr, beta1=beta1,
                beta2=beta2, eps=eps, weight_decay=weight_decay if decoupled else 0.0, decoupled=decoupled))
        return updates

    def own_state(self, name: str, p: torch.nn.Parameter) -> List[torch.Tensor]:
        """The tensors of ``p``'s optimizer state that are this rank's own (they differ between ranks in update
        mode): the first moment, and the calibrated second moment, or every floating-point tensor of a ``"local"``
        optimizer's state. The shared second moment and the step are the same everywhere already."""
        if self.second_moment == "shared":
            self._shared_state(name, p)
            return [self.first_moment(name, p)]
        if self.second_moment == "calibrated":
            state = self._own_state(name, p)
            return [state["exp_avg"], state["exp_avg_sq"]]
        return [value for key, value in sorted(self.optimizer.state[p].items())
                if key != "step" and torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0]

    def initialize_state(self, entries: Entries) -> bool:
        """Give every entry the state its second moment keeps (created, or adopted from an Adam state) before a
        start-up broadcast of the optimizer state; returns whether an Adam state was adopted into the shared
        second moment (its first moments then belong to every rank: the front end broadcasts them)."""
        if self.second_moment == "calibrated":
            for name, p in entries:
                self._own_state(name, p)
            return False
        if self.second_moment != "shared":
            return False
        adopted = False
        for name, p in entries:
            adopted |= set(self.optimizer.state[p]) == ADAM_KEYS
            self._shared_state(name, p)
        return adopted

    @staticmethod
    def _gradient(p: torch.nn.Parameter) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _record(self, key: str, shape: Tuple[int, ...]) -> Any:
        return self.registry.record(key, shape)

    def _count_bytes(self, entries: Entries, nbytes: List[int]) -> None:
        """Put what the second moment's collective carried into the parameters' traffic counters (stats())."""
        for (name, p), n in zip(entries, nbytes):
            self._record(update_tensor_name(self.scope + name), tuple(p.shape)).bytes_sent += n

    def _shared_moment_updates(self, entries: List[Tuple[str, torch.nn.Parameter]]) -> Optional[List[torch.Tensor]]:
        """Each parameter's Adam/AdamW update under the shared block second moment, from this rank's gradient and
        first moment; None when some rank's gradient is non-finite (every rank returns None alike)."""
        statistics = self._reduced_statistics(entries)
        shared = statistics.summed
        assert shared is not None
        if not bool(torch.isfinite(shared).all()):  # a NaN/Inf gradient entry anywhere makes its block non-finite
            return None
        shared /= self.world_size()
        hyper, group_of = statistics.hyper, statistics.group_of
        updates = []
        for (offset, count), (name, p) in zip(statistics.spans, entries):
            lr, beta1, beta2, eps, weight_decay, decoupled = hyper[group_of[id(p)]]
            state = self._shared_state(name, p)
            state["step"] += 1
            update_rule.update_second_moment(state["shared_exp_avg_sq"], shared[offset:offset + count].to(p.device),
                                             beta2)
            updates.append(update_rule.adam_update(
                p.detach(), self._gradient(p), self.first_moment(name, p), state["shared_exp_avg_sq"],
                int(state["step"]), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                decoupled=decoupled, block=self.config.second_moment_block,
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
        statistics = self._reduced_statistics(entries)
        summed = statistics.summed
        assert summed is not None
        if not bool(torch.isfinite(summed).all()):  # a NaN/Inf gradient entry anywhere makes its sketch non-finite
            return None
        width = self.config.second_moment_sketch
        shares = update_rule.noise_shares(summed.view(len(entries), width + 1), self.world_size())
        hyper, group_of = statistics.hyper, statistics.group_of
        updates = []
        for position, ((name, p), gradient) in enumerate(zip(entries, statistics.gradients)):
            lr, beta1, beta2, eps, weight_decay, decoupled = hyper[group_of[id(p)]]
            state = self._own_state(name, p)
            state["step"] += 1
            share = shares[position]
            self._record(update_tensor_name(self.scope + name), tuple(p.shape)).noise_share = share
            squared = gradient.float().square().mul_(share.to(p.device))
            update_rule.update_second_moment(state["exp_avg_sq"], squared, beta2)
            updates.append(update_rule.adam_update(
                p.detach(), gradient, state["exp_avg"], state["exp_avg_sq"], int(state["step"]), lr=lr, beta1=beta1,
                beta2=beta2, eps=eps, weight_decay=weight_decay if decoupled else 0.0, decoupled=decoupled,
            ))
        return updates

    # ---- the second moment's statistics and their one allreduce ------------------------------------------------
    def reduce_with_statistics(self, entries: Entries, extra: torch.Tensor, name: str) -> torch.Tensor:
        """One allreduce (sum) of the front end's ``extra`` (its count of non-finite gradient entries) together with
        this rank's second-moment statistics (the shared moment's block mean squares, the calibrated one's sketches
        and squared norms); returns the ranks' sum of ``extra``. A step then waits for one collective before its
        local update instead of two: on a link where a collective costs a round trip, that is one round trip less
        per step. The statistics' sum is kept for compute(), which uses it only while the gradients (each one the
        same tensor at the same version), the parameters, the weight decay and the step are the ones it was made
        from; a user who clips or unscales between ``synchronize()`` and ``step()`` changes them, and compute()
        reduces the statistics of what it finds instead. With the "local" second moment ``extra`` travels alone."""
        self._kept = None
        if self.second_moment not in COMPUTED_SECOND_MOMENTS or not entries:
            return self._allreduce_sum(extra, name)
        statistics = self._statistics(entries)
        values = statistics.values
        assert values is not None
        summed = self._allreduce_sum(torch.cat([extra.to(device=values.device, dtype=torch.float32), values]),
                                     with_nonfinite_count(statistics.name))
        statistics.summed = summed[extra.numel():]
        self._count_bytes(entries, statistics.nbytes)
        self._kept = statistics
        return summed[:extra.numel()]

    def _reduced_statistics(self, entries: Entries) -> "_Statistics":
        """The statistics of the gradients as they are now, summed over the ranks: the ones reduce_with_statistics
        kept where nothing they were made from has changed since, else this rank's, allreduced here."""
        kept, self._kept = self._kept, None
        statistics = self._statistics(entries, compute=False)
        if kept is not None and kept.made_from_the_same(statistics):
            return kept
        self._fill(statistics, entries)
        statistics.summed = self._allreduce_sum(statistics.values, statistics.name)
        self._count_bytes(entries, statistics.nbytes)
        return statistics

    def _statistics(self, entries: Entries, compute: bool = True) -> "_Statistics":
        """This rank's contribution to the computed second moment's allreduce (``compute=False``: only what it
        would be made from, to compare with kept statistics without computing them again)."""
        hyper, group_of = self._hyperparameters()
        shared = self.second_moment == "shared"
        # The signs' step (calibrated): the optimizer's step about to be taken, the same on every rank and in a
        # checkpoint (broadcast at start, moved alike), so a resumed job draws the signs the uninterrupted one would.
        step = 0 if shared else int(self._own_state(*entries[0])["step"]) + 1
        if shared:
            spans = moments_layout([p.numel() for _, p in entries], self.config.second_moment_block).spans
        else:
            width = sketch_layout(len(entries), self.config.second_moment_sketch).width
            spans = [(i * (width + 1), width + 1) for i in range(len(entries))]
        made_from = [(p, p._version, p.grad, None if p.grad is None else p.grad._version, hyper[group_of[id(p)]][4:])
                     for _, p in entries]
        statistics = _Statistics(MOMENTS_NAME if shared else NOISE_SHARE_NAME, spans, hyper, group_of, step,
                                 made_from)
        if compute:
            self._fill(statistics, entries)
        return statistics

    def _fill(self, statistics: "_Statistics", entries: Entries) -> None:
        """Compute the statistics' values (and the gradients the update uses) from the entries as they are now."""
        device = entries[0][1].device
        shared = statistics.name == MOMENTS_NAME
        end = statistics.spans[-1][0] + statistics.spans[-1][1]
        values = torch.zeros(end, dtype=torch.float32, device=device)
        gradients = []
        for position, ((offset, count), (name, p)) in enumerate(zip(statistics.spans, entries)):
            _, _, _, _, weight_decay, decoupled = statistics.hyper[statistics.group_of[id(p)]]
            gradient = self._gradient(p)
            if weight_decay and not decoupled:  # Adam's L2 penalty is part of the gradient both moments see
                gradient = gradient.add(p.detach(), alpha=weight_decay)
            gradients.append(gradient)
            if shared:
                values[offset:offset + count] = update_rule.block_mean_squares(
                    gradient, self.config.second_moment_block).to(device)
            else:
                update_rule.sketch_into(values[offset:offset + count], gradient.to(device),
                                        sketch_salt(statistics.step, position))
        statistics.values, statistics.gradients = values, gradients

    def _own_state(self, name: str, p: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        """This rank's own Adam state of ``p`` under the calibrated second moment, in Adam's keys (the step as a
        float32 host tensor, the moments in float32 shaped as ``p``): created on first use, or continued from an
        Adam/AdamW state (a gradient-mode or "local" checkpoint: the same quantities), cast to float32."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        elif set(state) != ADAM_KEYS:
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
            if set(state) == ADAM_KEYS:
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
        first_moment = self.first_moment(name, p)
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

    def first_moment(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's own first moment (float32, shaped as ``p``), kept in the compressor's record of the update
        next to its residual: both are this rank's alone, so the compressor's per-rank checkpoints (state_dict,
        gather_state, elastic) carry them, and on another world size each new rank gets the mean of the saved ones
        -- the averaged first moment, which is what the averaged update is made of."""
        record = self._record(update_tensor_name(self.scope + name), tuple(p.shape))
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


class _Statistics:
    """One step's second-moment statistics of this rank (``values``, laid out in ``spans`` per entry), the ranks'
    sum once reduced, and what they were made from: the gradients the update then uses, the hyperparameters, the
    step, and per entry (parameter, its version, gradient, its version, weight decay): the same objects at the same
    versions mean the same values, since every in-place change of a tensor moves its version."""

    def __init__(self, name: str, spans: List[Tuple[int, int]],
                 hyper: Dict[int, Tuple[float, float, float, float, float, bool]], group_of: Dict[int, int],
                 step: int, made_from: List[Tuple[Any, ...]]) -> None:
        self.name = name
        self.spans = spans
        self.values: Optional[torch.Tensor] = None
        self.gradients: List[torch.Tensor] = []
        self.hyper = hyper
        self.group_of = group_of
        self.step = step
        self.made_from = made_from
        self.summed: Optional[torch.Tensor] = None
        #: Bytes each entry's part of the allreduce carries (stats()).
        self.nbytes = [4 * count for _, count in spans]

    def made_from_the_same(self, other: "_Statistics") -> bool:
        """Whether ``other`` was made from the very tensors, versions, hyperparameters and step as these."""
        return (self.name == other.name and self.step == other.step and len(self.made_from) == len(other.made_from)
                and all(a[0] is b[0] and a[1] == b[1] and a[2] is b[2] and a[3] == b[3] and a[4] == b[4]
                        for a, b in zip(self.made_from, other.made_from)))


def _difference(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``before - after`` as a float32 update, subtracted in float32 or the parameters' own wider dtype: half
    precision values are exact in float32, and a float64 model's small steps would round away in float32 before the
    subtraction."""
    wide = torch.promote_types(before.dtype, torch.float32)
    return (before.to(wide) - after.to(wide)).float()
