"""Routes tensors marked by ``TopKEF.compress`` to Top-K allgathers inside Horovod's PyTorch optimizer.

``hvd.DistributedOptimizer`` calls three functions that ``horovod/torch/optimizer.py`` imported into its own
namespace: ``allreduce_async_``, ``grouped_allreduce_async_`` and ``synchronize``. We replace those three names *in
that module's namespace, in memory* (nothing on disk changes) with functions that hand every tensor without our
mark straight to Horovod's originals, unchanged. A marked tensor is where the name is finally known, so its
compressed reduction starts there; dense decisions go back to Horovod's own collectives (grouped ones stay grouped).

``hvd.DistributedOptimizer`` itself is wrapped to refuse, at construction, what TopKEF cannot do (Adasum), and
to give each optimizer its own scope in the TopKEF object it is handed (core.scopes): the class or one object
given to several optimizers (a GAN's generator and discriminator, both with a ``weight``) keeps one
error-feedback state per optimizer.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core import PendingReduction, group_member_name, pending_of, refuse_unsupported_op
from ..core.update_mode import NORMALISING_OPTIMIZERS, resolve_target
from .auto_density import install_wait_timer
from .compressor import TopKEF, TopKHandle
from .buckets import BucketMemberHandle
from .sparse_allreduce import SparseAllreduceHandle
from .update_mode import LocalHandle, UpdateStep, adapt_broadcast_optimizer_state

__all__ = ["install", "GroupHandle", "CheckedHandle", "ScopedCompression"]

_INSTALLED_FLAG = "_horovod_topk_routing"


class ScopedCompression:
    """What ``hvd.DistributedOptimizer`` is given in place of a TopKEF class or object: that object's compress and
    decompress, with this optimizer's scope (the prefix of its tensors' names, core.scopes) on every mark."""

    def __init__(self, compressor: TopKEF, scope: str) -> None:
        self.compressor = compressor
        self.scope = scope

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        alias, pending = self.compressor.compress(tensor)
        pending.scope = self.scope
        pending.wrapped = True
        return alias, pending

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.compressor.decompress(tensor, ctx)

    def __getattr__(self, attribute: str) -> Any:  # stats(), state_dict(), config...: the shared object's
        compressor = self.__dict__.get("compressor")  # absent while copy/pickle rebuild the object
        if compressor is None:
            raise AttributeError(attribute)
        return getattr(compressor, attribute)

    def __repr__(self) -> str:
        return f"{self.compressor!r} (scope {self.scope!r})" if self.scope else repr(self.compressor)


def _named_parameters(optimizer: Any, named_parameters: Optional[List[Any]]) -> List[Tuple[str, Any]]:
    """The (name, parameter) pairs Horovod names the gradients after (its own names when none are given)."""
    if named_parameters is not None:
        return [p for p in named_parameters if isinstance(p, tuple) and len(p) == 2]
    return [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(getattr(optimizer, "param_groups", []))
            for j, v in enumerate(group["params"])]


class CheckedHandle:
    """A reduction (TopKHandle or Horovod's own handle) on a tensor's first step: the ranks' agreement about the
    tensor (core.consistency) is waited for and checked first, so that ranks that disagree raise instead of
    waiting on collectives the others never start."""

    def __init__(self, check: Callable[[], None], inner: Any, wait_dense: Callable[[Any], Any]) -> None:
        self._check = check
        self._inner = inner
        self._wait_dense = wait_dense

    def __call__(self) -> Any:
        self._check()
        return self._inner() if callable(self._inner) else self._wait_dense(self._inner)


class GroupHandle:
    """Handle of a Horovod group whose members went partly Top-K, partly dense (one grouped allreduce)."""

    def __init__(
        self,
        size: int,
        topk: Dict[int, TopKHandle],
        dense_positions: List[int],
        dense_handle: Any,
        wait_dense: Callable[[Any], Any],
        checks: Sequence[Callable[[], None]] = (),
    ) -> None:
        self._size = size
        self._checks = list(checks)
        self._topk = topk
        self._dense_positions = dense_positions
        self._dense_handle = dense_handle
        self._wait_dense = wait_dense

    def __call__(self) -> List[torch.Tensor]:
        for check in self._checks:  # every member's agreement first (see CheckedHandle)
            check()
        outputs: List[Optional[torch.Tensor]] = [None] * self._size
        if self._dense_positions:
            for position, output in zip(self._dense_positions, self._wait_dense(self._dense_handle)):
                outputs[position] = output
        for position, handle in self._topk.items():
            outputs[position] = handle()
        return outputs  # type: ignore[return-value]


def _horovod_groups(distributed: Any) -> Optional[List[List[str]]]:
    """The member names of each of Horovod's groups (``groups=``), as its grouped reductions name them; None without
    groups. Horovod forms the groups when the optimizer is built (the parameter order broadcast from rank 0), in
    ``_p_to_group``; a group's reduction is named after its first parameter (core.naming.group_member_name)."""
    by_parameter = getattr(distributed, "_p_to_group", None)
    if not by_parameter:
        return None
    names = distributed._parameter_names
    groups: List[List[str]] = []
    for group in dict.fromkeys(by_parameter.values()):  # each group once, in the order Horovod formed them
        first = names.get(group[0])
        if first is not None:
            groups.append([group_member_name(first, position) for position in range(len(group))])
    return groups


def refuse_unwrapped(pending: PendingReduction) -> None:
    """Raise where TopKEF's mark reaches Horovod's optimizer collectives from an optimizer that Horovod's own
    ``DistributedOptimizer`` built: a reference to it taken before horovod-topk routed Horovod (``from horovod.torch
    import DistributedOptimizer`` first, or ``hvd.DistributedOptimizer`` looked up before ``horovod_topk.torch``
    was imported). Such an optimizer has none of TopKEF's per-optimizer set-up, so it would train in another mode
    (update mode would silently send gradients) instead of the one asked for."""
    if not pending.wrapped:
        raise ValueError(
            "horovod-topk: TopKEF reached an optimizer built by Horovod's own DistributedOptimizer, which "
            "horovod-topk did not wrap: the function was looked up before horovod_topk.torch was imported. Import "
            "horovod_topk.torch (e.g. `from horovod_topk.torch import TopKEF`) before calling "
            "hvd.DistributedOptimizer, and call it as hvd.DistributedOptimizer, not through a reference taken earlier.")


def install() -> None:
    """Install the routing once per process (idempotent). Raises ImportError on an unknown Horovod layout."""
    import horovod.torch as hvd
    import horovod.torch.optimizer as hvd_optimizer
    from horovod.torch.mpi_ops import Adasum, Average, Sum, global_process_set

    if getattr(hvd_optimizer, _INSTALLED_FLAG, False):
        return
    needed = ("allreduce_async_", "grouped_allreduce_async_", "synchronize", "DistributedOptimizer")
    missing = [n for n in needed if not hasattr(hvd_optimizer, n)]
    if missing:
        raise ImportError(
            f"horovod-topk: this Horovod ({getattr(hvd, '__version__', '?')}) has no {', '.join(missing)} in "
            f"horovod.torch.optimizer; horovod-topk supports Horovod 0.28."
        )
    dense_allreduce_async_ = hvd_optimizer.allreduce_async_
    dense_grouped_allreduce_async_ = hvd_optimizer.grouped_allreduce_async_
    horovod_synchronize = hvd_optimizer.synchronize
    horovod_distributed_optimizer = hvd_optimizer.DistributedOptimizer

    def allreduce_async_(
        tensor: torch.Tensor,
        average: Any = None,
        name: Optional[str] = None,
        op: Any = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set: Any = global_process_set,
    ) -> Any:
        pending = pending_of(tensor)
        if pending is not None and name is not None:
            refuse_unwrapped(pending)
            handle = pending.compressor.start_reduction(
                tensor, pending, pending.scope + name, op=op, prescale_factor=prescale_factor,
                postscale_factor=postscale_factor, process_set=process_set,
            )
            if handle is None:
                handle = dense_allreduce_async_(
                    tensor, average=average, name=name, op=op, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor, process_set=process_set,
                )
            return handle if pending.check is None else CheckedHandle(pending.check, handle, horovod_synchronize)
        return dense_allreduce_async_(
            tensor, average=average, name=name, op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=process_set,
        )

    def grouped_allreduce_async_(
        tensors: Sequence[torch.Tensor],
        average: Any = None,
        name: Optional[str] = None,
        op: Any = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set: Any = global_process_set,
    ) -> Any:
        if name is None or all(pending_of(t) is None for t in tensors):
            return dense_grouped_allreduce_async_(
                tensors, average=average, name=name, op=op, prescale_factor=prescale_factor,
                postscale_factor=postscale_factor, process_set=process_set,
            )
        topk: Dict[int, TopKHandle] = {}
        dense_positions: List[int] = []
        checks: List[Callable[[], None]] = []
        for position, tensor in enumerate(tensors):
            pending = pending_of(tensor)
            handle = None
            if pending is not None:
                refuse_unwrapped(pending)
                handle = pending.compressor.start_reduction(
                    tensor, pending, pending.scope + group_member_name(name, position), op=op,
                    prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set,
                )
                if pending.check is not None:
                    checks.append(pending.check)
            if handle is None:
                dense_positions.append(position)
            else:
                topk[position] = handle
        dense_handle = None
        if dense_positions:
            dense_handle = dense_grouped_allreduce_async_(
                [tensors[i] for i in dense_positions], average=average, name=name, op=op,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set,
            )
        return GroupHandle(len(tensors), topk, dense_positions, dense_handle, horovod_synchronize, checks)

    def synchronize(handle: Any) -> Any:
        if isinstance(handle, (TopKHandle, SparseAllreduceHandle, BucketMemberHandle, GroupHandle, CheckedHandle,
                               LocalHandle)):
            return handle()
        return horovod_synchronize(handle)

    signature = inspect.signature(horovod_distributed_optimizer)

    @functools.wraps(horovod_distributed_optimizer)
    def DistributedOptimizer(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # a TypeError for bad arguments, as Horovod's own would raise
        bound.apply_defaults()
        arguments = bound.arguments
        compression = arguments["compression"]
        uses_topk = isinstance(compression, TopKEF) or (
            isinstance(compression, type) and issubclass(compression, TopKEF)
        )
        refuse_unsupported_op(uses_topk, arguments["op"], Average, Sum, Adasum)
        if not uses_topk:
            return horovod_distributed_optimizer(*args, **kwargs)
        compressor = compression if isinstance(compression, TopKEF) else compression.default()
        optimizer = arguments["optimizer"]
        if compressor.config.momentum > 0 and any(
            group.get("momentum", 0) for group in getattr(optimizer, "param_groups", [])
        ):
            raise ValueError(
                "horovod-topk: TopKEF(momentum=...) applies the momentum itself (DGC momentum correction); "
                "set the optimizer's momentum to 0, or leave TopKEF's momentum at 0."
            )
        if arguments["named_parameters"] is not None:  # may be a generator: read it once, hand Horovod the list
            arguments["named_parameters"] = list(arguments["named_parameters"])
        scope = compressor.scope_for(_named_parameters(optimizer, arguments["named_parameters"]))
        arguments["compression"] = ScopedCompression(compressor, scope)
        distributed = horovod_distributed_optimizer(*bound.args, **bound.kwargs)
        user_class = type(optimizer)
        class_name = f"{user_class.__module__}.{user_class.__qualname__}"
        sums = arguments["op"] == Sum and class_name in NORMALISING_OPTIMIZERS  # update mode refuses it: see there
        target = resolve_target(compressor.config, class_name, ["op=hvd.Sum"] if sums else [])
        if target == "gradient":
            groups = _horovod_groups(distributed)
            if groups is not None:  # the user's groups= are the buckets (one grouped call each in Horovod)
                compressor.add_group_buckets(groups, scope)
            else:
                compressor.add_buckets(_named_parameters(optimizer, arguments["named_parameters"]), scope)
        if target == "update":  # the step exchanges updates (torch.update_mode)
            update_step = UpdateStep(distributed, compressor, scope, dense_allreduce_async_, horovod_synchronize)
            update_step.install()
            compressor.update_scopes[scope] = update_step
        elif compressor.auto is not None:  # ratio="auto" measures what the step waits for its gradients
            install_wait_timer(distributed, compressor.auto)
        return distributed

    adapt_broadcast_optimizer_state()
    hvd_optimizer.allreduce_async_ = allreduce_async_
    hvd_optimizer.grouped_allreduce_async_ = grouped_allreduce_async_
    hvd_optimizer.synchronize = synchronize
    hvd_optimizer.DistributedOptimizer = DistributedOptimizer
    if getattr(hvd, "DistributedOptimizer", None) is horovod_distributed_optimizer:
        hvd.DistributedOptimizer = DistributedOptimizer
    setattr(hvd_optimizer, _INSTALLED_FLAG, True)
