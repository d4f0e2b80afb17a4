"""What every front end shares: configuration, registry, state and statistics (``CompressorState``), and the
Horovod compressor API the PyTorch and TensorFlow ``TopKEF`` classes add on top of it (``TopKEFBase``).

The framework classes add only the tensor math and the collective calls; a front end that is not a Horovod
compressor (the PyTorch DDP communication hook's state) builds on ``CompressorState`` alone. Horovod accepts either a compressor
*class* (``compression=hvd.Compression.fp16``) or an object, so ``compression=TopKEF`` must work as well as
``compression=TopKEF(ratio=0.001)``: the public methods, looked up on the class, act on one shared default instance
of that class.
"""
from __future__ import annotations

import abc
import math
import warnings
from collections import Counter
from typing import Any, Callable, Dict, Generic, Iterable, List, Mapping, Optional, Tuple, TypeVar

from .autodensity import AutoDensity, Measurement
from .config import TopKConfig
from .pending import PendingReduction, mark
from .registry import ErrorFeedbackRegistry
from .scopes import ScopeTable
from .telemetry import Telemetry

__all__ = ["CompressorState", "TopKEFBase", "default_instance_method"]

R = TypeVar("R")

_SHARED_METHODS = ("compress", "decompress", "state_dict", "load_state_dict", "stats", "reset")


class default_instance_method:
    """A method that, looked up on the class, binds to the class's default instance instead of failing."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.__doc__ = func.__doc__
        self.__name__ = getattr(func, "__name__", "method")

    def __get__(self, obj: Any, owner: type) -> Callable[..., Any]:
        target = obj if obj is not None else owner.default()
        return self.func.__get__(target, owner)


class CompressorState(abc.ABC, Generic[R]):
    """What every front end of Top-K with error feedback keeps, whoever calls it (Horovod's compressor API, a
    PyTorch DDP communication hook): the validated configuration, the residuals and counters by tensor name, the
    checkpoint (state_dict / load_state_dict), statistics, telemetry and ratio="auto"'s state.

    Args:
        ratio (float, optional): fraction of entries sent per step, in (0, 1]. Default 0.01.
        config (TopKConfig, optional): a ready configuration; exclusive with the keyword options.
        summary_writer (optional): anything with ``add_scalar(tag, value, step)`` (a TensorBoard SummaryWriter):
            receives the telemetry scalars every ``log_every`` steps (core.telemetry).
        **options: any other field of :class:`TopKConfig` (k, min_numel, selector, value_dtype, dense_fallback,
            warmup_steps, momentum, spike_guard, log_every); an unknown name is a ValueError.
    """

    def __init__(
        self,
        ratio: Optional[float] = None,
        *,
        config: Optional[TopKConfig] = None,
        summary_writer: Any = None,
        **options: Any,
    ) -> None:
        if ratio is not None:
            options["ratio"] = ratio
        if config is not None:
            if options:
                raise ValueError(f"pass either config= or the options {sorted(options)}, not both")
            if not isinstance(config, TopKConfig):
                raise ValueError(f"config must be a TopKConfig, got {type(config).__name__}")
        #: The validated configuration; defaults live in TopKConfig only.
        self.config = config if config is not None else TopKConfig.from_dict(options)
        #: Residuals and counters by tensor name; what a checkpoint must keep (see state_dict).
        self.registry: ErrorFeedbackRegistry[R] = ErrorFeedbackRegistry()
        #: Reports every config.log_every steps (core.telemetry).
        self.telemetry = Telemetry(self.config.log_every, summary_writer)
        #: With ratio="auto": the density in force and the measurements it is chosen from (core.autodensity).
        self.auto: Optional[AutoDensity] = self._new_auto()

    #: Whether this front end sends a tensor dense in float16 (core.exchange.DENSE_HALF), so that ratio="auto" may
    #: choose fp16 (core.autodensity.HALF).
    _sends_half: bool = False
    #: Whether this front end sends a tensor dense in bytes on a shared grid (core.exchange.DENSE_INT8), so that
    #: ratio="auto" may choose int8 (core.autodensity.INT8).
    _sends_int8: bool = False

    def _new_auto(self) -> Optional[AutoDensity]:
        """A fresh ratio="auto" state (None under a fixed ratio)."""
        if not self.config.auto:
            return None
        return AutoDensity(self.config, half=self._sends_half, int8=self._sends_int8)

    def _report_if_due(self, completed_steps: int, rank: Optional[int] = None) -> None:
        """Called before a tensor starts step ``completed_steps + 1``: the telemetry report of the steps so far,
        when one is due (TopKConfig.log_every)."""
        if self.telemetry.due(completed_steps):
            self.telemetry.report(completed_steps, self.stats(), rank)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.describe()[len('TopKConfig('):-1]})"

    def _auto_tensors(self) -> List[Tuple[str, int]]:
        """(name, entries) of every tensor this compressor reduces: what ratio="auto" predicts the step of."""
        return [(name, record.numel) for name, record in sorted(self.registry.records.items())]

    def _auto_decide(self, measurement: Measurement, rank: Optional[int] = None) -> None:
        """Take ratio="auto"'s decision from ``measurement`` (reduced over ranks: the same everywhere). A new
        density is logged once. After every decision, changed or not, every tensor's rank agreement is checked
        again: a decision is where ranks could part (a rank that alone changed its density would otherwise meet
        ranks that do not check). The price is one small collective per tensor (per bucket in the DDP hook) on the
        decision's step, once every ``auto_every`` steps once settled; that step is outside the measurement window
        (core.autodensity.SETTLE_STEPS)."""
        assert self.auto is not None
        before, first = self.auto.ratio, self.auto.decisions == 0
        choice = self.auto.decide(self._auto_tensors(), measurement)
        for _, record in self.registry:
            record.verified = False
        self._forget_agreements()
        if (choice.ratio != before or first) and rank in (None, 0):
            self.telemetry.logger.info(self.auto.summary_line())

    # ---- framework hooks -------------------------------------------------------------------------------------
    def _refresh_counters(self) -> None:
        """Bring the registry's counters up to date (TensorFlow keeps them in variables updated in-graph)."""

    def _after_load(self) -> None:
        """Push freshly loaded records into framework state that already exists (TensorFlow variables), and drop
        reductions still in flight: a loaded state ends any step in progress (Horovod elastic loads the last
        commit after a failure, and the collectives of the abandoned step died with the old Horovod context)."""

    def _forget_agreements(self) -> None:
        """Framework state outside the registry that says a tensor's cross-rank check was done: forget it (after a
        load or an elastic reset every tensor is checked again, as every record is)."""

    @abc.abstractmethod
    def _export_residual(self, residual: R) -> Any:
        """A copy of ``residual`` fit for a checkpoint of this framework."""

    @abc.abstractmethod
    def _import_residual(self, name: str, value: Any) -> R:
        """A residual made from what :meth:`_export_residual` produced."""

    @abc.abstractmethod
    def _residual_squared_norm(self, residual: R) -> float:
        """Sum of squares of ``residual`` as a Python float."""

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals and counters, plus the configuration they were made with.

        Residuals are real training state: they hold gradient mass that was computed but not applied yet.
        Save this next to the model and optimizer state of *each rank* and load it back on restart.
        """
        self._refresh_counters()
        state = self.registry.state_dict(self._export_residual)
        state["config"] = self.config.to_dict()
        if self.auto is not None:
            state["auto"] = self.auto.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Shapes are checked when each tensor is next reduced."""
        self.registry.load_state_dict(state, self._import_residual)
        if self.auto is not None:
            if state.get("auto") is not None:
                self.auto.load_state_dict(state["auto"])
            else:  # a checkpoint of a fixed ratio: measure and decide afresh
                self.auto = self._new_auto()
        self.telemetry.restart()
        self._after_load()

    def reset(self) -> None:
        """Forget all residuals and counters (for a new training run with the same compressor object)."""
        self.registry.clear()
        self.telemetry.restart()
        self.auto = self._new_auto()

    def stats(self) -> Dict[str, Any]:
        """Traffic and residual statistics of this rank.

        ``bytes_sent`` is what this rank handed to collectives (payloads of compressed tensors, full size of the
        dense ones); ``bytes_dense`` what plain Horovod would have handed over for the same tensors and steps;
        ``compression_ratio`` = bytes_dense / bytes_sent; ``residual_norm`` the L2 norm over all residuals;
        ``nonfinite_steps`` how many (tensor, step) pairs had a NaN/Inf gradient here (sent as such, residual kept);
        ``guarded_steps`` how many had their gradient capped by TopKConfig.spike_guard; ``compress_seconds`` the
        host time spent compressing (since start or load; on a GPU, launching); ``exchanges`` how many tensors
        each exchange carried on their last compressed step (what ``exchange="auto"`` chose); with update mode's
        calibrated second moment, ``noise_share``: the tensors' last noise shares (their mean weighted by size, min
        and max: near 1/P the gradients are mostly noise at this scale, and each rank's own second moment would
        have made its steps up to sqrt(P) too short; near 1 they agree).
        Combined over every optimizer this object (or the class) was given to (core.scopes).
        """
        self._refresh_counters()
        steps, sent, dense = self.registry.totals()
        squared = sum(self._residual_squared_norm(r.residual) for _, r in self.registry if r.residual is not None)
        compressed = sum(1 for _, r in self.registry if r.residual is not None)
        return {
            "steps": steps,
            "bytes_sent": sent,
            "bytes_dense": dense,
            "compression_ratio": (dense / sent) if sent else 1.0,
            "residual_norm": math.sqrt(squared),
            "tensors_compressed": compressed,
            "tensors_dense": len(self.registry) - compressed,
            "nonfinite_steps": sum(int(r.nonfinite_steps) for _, r in self.registry),
            "guarded_steps": sum(r.guarded_steps for _, r in self.registry),
            "compress_seconds": sum(r.compress_seconds for _, r in self.registry),
            "exchanges": dict(Counter(r.exchange for _, r in self.registry if r.exchange)),
            **({"auto": self.auto.stats()} if self.auto is not None else {}),
            **noise_share_summary([(float(r.noise_share), r.numel) for _, r in self.registry
                                   if r.noise_share is not None]),
            **self._extra_stats(),
        }

    def _extra_stats(self) -> Dict[str, Any]:
        """What a framework's exchanges add to stats() (PyTorch: its buckets)."""
        return {}


def noise_share_summary(shares: List[Tuple[float, int]]) -> Dict[str, Any]:
    """stats()'s ``noise_share`` entry from (share, numel) per tensor: nothing when no tensor has one."""
    if not shares:
        return {}
    total = sum(numel for _, numel in shares)
    mean = sum(share * numel for share, numel in shares) / total if total else 0.0
    return {"noise_share": {"mean": mean, "min": min(s for s, _ in shares), "max": max(s for s, _ in shares)}}


class TopKEFBase(CompressorState[R]):
    """Top-K with error feedback behind Horovod's compressor API (``compress(tensor) -> (tensor, ctx)``,
    ``decompress(tensor, ctx)``): what the PyTorch and TensorFlow ``TopKEF`` classes share.

    Horovod accepts either a compressor *class* or an object, so the public methods looked up on the class act
    on one shared default instance of it (see the module docstring). Arguments as :class:`CompressorState`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for method in _SHARED_METHODS:
            if method in cls.__dict__ and not isinstance(cls.__dict__[method], default_instance_method):
                setattr(cls, method, default_instance_method(cls.__dict__[method]))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Warn once per compressor, not per step, when a tensor reached us with nothing to route it.
        self._warned_unrouted = False
        #: The name prefix of each distributed optimizer given this object (core.scopes).
        self.scopes = ScopeTable()

    @classmethod
    def default(cls) -> "TopKEFBase[R]":
        """The instance used when the class itself is passed as ``compression=`` (created on first use)."""
        inst = cls.__dict__.get("_default_instance")
        if inst is None:
            inst = cls()
            setattr(cls, "_default_instance", inst)
        return inst

    def scope_for(self, parameters: Iterable[Tuple[str, Any]]) -> str:
        """The name prefix for a distributed optimizer of ``parameters`` ((name, parameter) pairs), so that
        several optimizers given this one object keep separate error-feedback state (see core.scopes)."""
        return self.scopes.assign(parameters)

    # ---- Horovod's compressor API --------------------------------------------------------------------------
    @default_instance_method
    def compress(self, tensor: Any) -> Tuple[Any, PendingReduction]:
        """Mark ``tensor`` for the routing; the selection happens where Horovod launches the collective."""
        pending = PendingReduction(self, tensor.dtype, self._static_shape(tensor), self._graph_name(tensor))
        return mark(self._alias(tensor), pending), pending

    @default_instance_method
    def decompress(self, tensor: Any, ctx: Optional[PendingReduction]) -> Any:
        """The reduced tensor: the routing already produced it in the gradient's dtype and shape."""
        if ctx is not None and ctx.route == "unrouted" and not self._warned_unrouted:
            self._warned_unrouted = True
            warnings.warn(
                "horovod-topk: TopKEF was handed a tensor on a path it does not route (it routes the gradients of "
                "hvd.DistributedOptimizer / DistributedGradientTape and named or traced TensorFlow allreduces): "
                "the tensor was reduced dense, without Top-K.",
                stacklevel=2,
            )
        return tensor

    @abc.abstractmethod
    def _alias(self, tensor: Any) -> Any:
        """A new tensor object sharing ``tensor``'s value, to carry the mark without touching the gradient."""

    def _static_shape(self, tensor: Any) -> Tuple[Optional[int], ...]:
        return tuple(tensor.shape)

    def _graph_name(self, tensor: Any) -> Optional[str]:
        return None

    state_dict = default_instance_method(CompressorState.state_dict)
    load_state_dict = default_instance_method(CompressorState.load_state_dict)
    reset = default_instance_method(CompressorState.reset)
    stats = default_instance_method(CompressorState.stats)
