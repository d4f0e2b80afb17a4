"""One checkpoint for the error-feedback state of all ranks: gather it to one rank, restore it on any world size.

Residuals differ per rank (each holds what *its* gradients did not send yet), so the model/optimizer habit of
saving rank 0's copy would silently drop P - 1 of them. :func:`gather_state` collects every rank's
``state_dict()`` on one rank (one collective per residual; only the root holds the P copies), and
:func:`restore_state` gives every rank its share back:

* same number of workers: rank j gets exactly what rank j saved, so a resumed run continues bit for bit;
* another number of workers P' (elastic jobs, a smaller allocation): the residuals cannot be matched to ranks, so
  every rank gets the same residual chosen so that **the gradient mass still owed to the model is unchanged**:
  with ``reduction="average"`` (Horovod's default op) the update receives (1/P) * sum of residuals, so each new
  rank gets the mean of the saved residuals; with ``reduction="sum"`` it receives the sum, so each new rank gets
  sum / P'. Momentum buffers (DGC) are averaged; step counters must agree (they do in a consistent checkpoint)
  and are kept; traffic counters are statistics and restart from the saved ranks' mean.

The collectives themselves are framework calls behind :class:`Transport`; this module only decides who gets what.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Generic, List, Mapping, Optional, Protocol, TypeVar

from .policy import residual_world_factor
from .registry import STATE_FORMAT

__all__ = [
    "RANKS_FORMAT",
    "REDUCTIONS",
    "Transport",
    "gather_state",
    "restore_state",
    "sync_after_reset",
    "redistribution_factor",
    "ObjectCollectives",
    "resolve_compressor",
    "rescale_to_world",
    "ElasticCompressorState",
]

#: Format tag of a multi-rank checkpoint, so that a single rank's state_dict is not mistaken for one.
RANKS_FORMAT = "horovod-topk-ranks/1"
REDUCTIONS = ("average", "sum")
_FIELDS = ("residual", "momentum")
_COUNTERS = ("bytes_sent", "bytes_dense", "nonfinite_steps")

T = TypeVar("T")


class Transport(Protocol, Generic[T]):
    """The few collectives the checkpoint helpers need, over one framework's Horovod (all ranks call each)."""

    rank: int
    size: int

    def allgather_object(self, obj: Any) -> List[Any]: ...

    def broadcast_object(self, obj: Any, root: int) -> Any: ...

    def describe(self, value: T) -> Dict[str, Any]:
        """What another rank needs to receive ``value``: {"numel": int, "dtype": str}."""
        ...

    def gather(self, value: T, root: int, key: str) -> Optional[List[T]]:
        """Every rank's ``value`` (flat) on ``root`` in rank order; None on the other ranks."""
        ...

    def scatter(self, values: Optional[List[T]], root: int, key: str, like: Mapping[str, Any]) -> T:
        """``values[j]`` (given on ``root``) arrives on rank j."""
        ...

    def broadcast(self, value: Optional[T], root: int, key: str, like: Mapping[str, Any]) -> T: ...

    def mean(self, values: List[T], factor: float) -> T:
        """factor * elementwise mean of ``values``."""
        ...


class ObjectCollectives:
    """The rank, size and object collectives of a Transport, over a framework's Horovod module (``horovod.torch``
    or ``horovod.tensorflow``: both have the same calls). The framework transports add the tensor ones."""

    def __init__(self, hvd: Any) -> None:
        self.hvd = hvd
        self.rank: int = hvd.rank()
        self.size: int = hvd.size()

    def allgather_object(self, obj: Any) -> List[Any]:
        return self.hvd.allgather_object(obj, name="topk.ckpt.layout")

    def broadcast_object(self, obj: Any, root: int) -> Any:
        # named explicitly: broadcast_object's default name is the object's type, which differs between the root
        # (a dict) and the others (None)
        return self.hvd.broadcast_object(obj, root_rank=root, name="topk.ckpt.summary")


def resolve_compressor(compressor: Any) -> Any:
    """The instance behind ``compression=TopKEF`` (the class itself) or the object."""
    return compressor.default() if isinstance(compressor, type) else compressor


def redistribution_factor(reduction: str, saved_size: int, new_size: int) -> float:
    """The factor on the mean of P saved residuals that each of P' new ranks gets, so that the mass owed to the
    model is unchanged: average -> (1/P') * P' * f * mean == (1/P) * sum  =>  f = 1;
    sum -> P' * f * mean == sum  =>  f = P / P'."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return 1.0 if reduction == "average" else saved_size / new_size


def _layout(state: Mapping[str, Any], transport: Transport[Any]) -> Dict[str, Any]:
    """A state_dict with its tensors replaced by what is needed to receive them."""
    return {
        "config": state.get("config"),
        "tensors": {
            name: {
                **{k: v for k, v in entry.items() if k not in _FIELDS},
                **{f: None if entry.get(f) is None else transport.describe(entry[f]) for f in _FIELDS},
            }
            for name, entry in state["tensors"].items()
        },
    }


def _same_tensors(layouts: List[Dict[str, Any]]) -> None:
    """Raise, identically on every rank, unless all ranks hold the same tensors with the same shapes."""
    first = layouts[0]["tensors"]
    for rank, layout in enumerate(layouts[1:], start=1):
        other = layout["tensors"]
        if set(other) != set(first):
            missing = sorted(set(first) ^ set(other))
            raise ValueError(f"horovod-topk: rank 0 and rank {rank} hold error-feedback state for different tensors "
                             f"(e.g. {missing[:3]}); cannot save one checkpoint of them")
        for name in first:
            for key in ("shape", *_FIELDS):
                a, b = first[name].get(key), other[name].get(key)
                if (a is None) != (b is None) or (key == "shape" and list(a) != list(b)):
                    raise ValueError(f"horovod-topk: tensor {name!r} has {key} {a} on rank 0 but {b} on rank {rank}")


def gather_state(compressor: Any, transport: Transport[Any], root: int = 0) -> Optional[Dict[str, Any]]:
    """Collective: every rank's ``compressor.state_dict()`` in one dict on ``root`` (None on the other ranks)."""
    state = compressor.state_dict()
    layouts = transport.allgather_object(_layout(state, transport))
    _same_tensors(layouts)
    ranks: List[Dict[str, Any]] = [
        {"format": STATE_FORMAT, "config": layout["config"],
         "tensors": {name: {k: v for k, v in entry.items() if k not in _FIELDS} for name, entry in
                     layout["tensors"].items()}}
        for layout in layouts
    ]
    for name in sorted(state["tensors"]):
        for field in _FIELDS:
            value = state["tensors"][name].get(field)
            if value is None:
                for r in ranks:
                    r["tensors"][name][field] = None
                continue
            parts = transport.gather(value, root, f"{field}.{name}")
            if parts is not None:
                for r, part in zip(ranks, parts):
                    r["tensors"][name][field] = part
    if transport.rank != root:
        return None
    return {"format": RANKS_FORMAT, "world_size": transport.size, "ranks": ranks}


def restore_state(
    compressor: Any,
    checkpoint: Optional[Mapping[str, Any]],
    transport: Transport[Any],
    root: int = 0,
    reduction: str = "average",
) -> None:
    """Collective: load into every rank its share of a :func:`gather_state` checkpoint that ``root`` holds (the
    other ranks may pass None). See the module docstring for the policy when the number of workers changed."""
    redistribution_factor(reduction, 1, 1)  # validates ``reduction`` on every rank before any collective
    summary = None
    if transport.rank == root:
        if not isinstance(checkpoint, Mapping) or checkpoint.get("format") != RANKS_FORMAT:
            found = checkpoint.get("format") if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
            summary = {"error": f"horovod-topk: not a checkpoint of gather_state (expected format "
                                f"{RANKS_FORMAT!r}, got {found!r})"}
        else:
            layouts = [_layout(r, transport) for r in checkpoint["ranks"]]
            try:
                _same_tensors(layouts)
                summary = {"world_size": int(checkpoint["world_size"]), "layouts": layouts}
            except ValueError as error:
                summary = {"error": str(error)}
    summary = transport.broadcast_object(summary, root)
    if "error" in summary:
        raise ValueError(summary["error"])
    saved_size, layouts = summary["world_size"], summary["layouts"]
    same = saved_size == transport.size
    factor = redistribution_factor(reduction, saved_size, transport.size)
    mine = layouts[transport.rank] if same else layouts[0]
    state: Dict[str, Any] = {"format": STATE_FORMAT, "config": mine["config"], "tensors": {}}
    for name in sorted(mine["tensors"]):
        entry = {k: v for k, v in mine["tensors"][name].items() if k not in _FIELDS}
        if not same:
            entry["world_size"] = transport.size  # redistributed for this world: no rescale on the next step
            steps = {int(layout["tensors"][name]["steps"]) for layout in layouts}
            if len(steps) > 1:
                raise ValueError(f"horovod-topk: the checkpoint's ranks are at different steps for {name!r} "
                                 f"({sorted(steps)}); it was not saved by gather_state after a common step")
            for counter in _COUNTERS:
                entry[counter] = sum(int(layout["tensors"][name].get(counter, 0)) for layout in layouts) // saved_size
        for field in _FIELDS:
            like = mine["tensors"][name][field]
            if like is None:
                entry[field] = None
                continue
            key = f"{field}.{name}"
            saved = [r["tensors"][name][field] for r in checkpoint["ranks"]] if transport.rank == root else None
            if same:
                entry[field] = transport.scatter(saved, root, key, like)
            else:
                value = None
                if saved is not None:
                    value = transport.mean(saved, factor if field == "residual" else 1.0)
                entry[field] = transport.broadcast(value, root, key, like)
        state["tensors"][name] = entry
    compressor.load_state_dict(state)



def sync_after_reset(compressor: Any, transport: Transport[Any]) -> None:
    """Collective, for Horovod elastic after a reset (workers left or joined): every rank adopts the step counters
    of a rank that has state, so that step-dependent decisions (warm-up) and the cross-rank check agree, and every
    tensor is checked again. Residuals stay where they are: each rank rescales its own on its next step when it
    sees the new world size (policy.residual_world_factor), which keeps the mass it owes the model."""
    compressor._forget_agreements()
    state = compressor.state_dict()
    mine = {name: (list(e["shape"]), int(e["steps"])) for name, e in state["tensors"].items()} or None
    auto = state.get("auto") if mine is not None else None
    gathered = transport.allgather_object((mine, auto))
    source, source_auto = next(((s, a) for s, a in gathered if s is not None), (None, None))
    if compressor.auto is not None:  # the density of a rank with state, measured again at the new world size
        if source_auto is not None:
            compressor.auto.load_state_dict(source_auto)
        compressor.auto.decide_soon()
        compressor.auto.resync_scopes = list(compressor.auto.shared_scopes)  # a joined rank's own state is its own
    if source is None:
        return
    for name, (shape, steps) in source.items():
        record = compressor.registry.record(name, tuple(shape))
        record.steps = steps
    for _, record in compressor.registry:
        record.verified = False
        record.int8_reference = 0.0  # a joined rank has none: every rank's next int8 step goes fp16 and sets it


def rescale_to_world(state: Dict[str, Any], world_size: int, reductions: Mapping[str, str]) -> bool:
    """Rescale, in ``state`` (a ``state_dict()``), every residual accumulated under another number of workers to
    ``world_size``, keeping the mass this rank owes the model (policy.residual_world_factor: P'/P under
    "average", unchanged under "sum"; ``reductions`` maps tensor names to their op, "average" if absent), and
    record the new world size. True if anything changed. Momentum buffers are velocities, not owed mass: kept.

    The PyTorch compressor does this on each tensor's next step; a framework whose step is a traced graph (the
    world size a constant in it) does it here, eagerly, when Horovod elastic resets."""
    changed = False
    for name, entry in state["tensors"].items():
        saved = entry.get("world_size")
        if saved is None or int(saved) == world_size:
            continue
        factor = residual_world_factor(reductions.get(name, "average"), int(saved), world_size)
        if entry.get("residual") is not None and factor != 1.0:
            entry["residual"] = entry["residual"] * factor
        entry["world_size"] = world_size
        changed = True
    return changed


class ElasticCompressorState:
    """One compressor's part of a Horovod elastic state: commit keeps a copy of this rank's state, restore puts
    it back (Horovod rolls model and optimizer back to the same commit), sync -- after every reset -- makes the
    ranks agree on the step counters (sync_after_reset) and, with ``rescale_on_sync``, rescales this rank's
    residuals to the new world size (rescale_to_world).

    Residuals are never broadcast: each rank's holds gradient mass only that rank computed, so rank 0's copy on
    every rank would multiply its mass and drop the others'. A new worker starts with none; a worker that died
    takes its residual with it. ``transport`` is called anew at each sync (rank and size change across resets);
    ``reductions`` gives each tensor's op; ``after_sync`` lets a framework push the adopted counters into its own
    state (TensorFlow variables)."""

    def __init__(
        self,
        compressor: Any,
        transport: Callable[[], Transport[Any]],
        *,
        rescale_on_sync: bool = False,
        reductions: Callable[[], Mapping[str, str]] = lambda: {},
        after_sync: Callable[[], None] = lambda: None,
    ) -> None:
        self.value = compressor
        self._transport = transport
        self._rescale_on_sync = rescale_on_sync
        self._reductions = reductions
        self._after_sync = after_sync
        self._saved: Optional[Dict[str, Any]] = None
        self.save()

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        if self._saved is not None:
            self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        """Collective (every rank, eagerly, after a reset): see the class docstring."""
        transport = self._transport()
        if self._rescale_on_sync:
            state = self.value.state_dict()
            if rescale_to_world(state, transport.size, self._reductions()):
                self.value.load_state_dict(state)
        sync_after_reset(self.value, transport)
        self._after_sync()
        self.save()
