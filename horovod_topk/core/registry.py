"""Per-tensor state that persists across steps: the error-feedback residual and the traffic counters.

Keyed by the tensor's name (never by ``id`` of a gradient or its storage: ``zero_grad(set_to_none=True)`` makes a
new gradient every step). Records are created lazily the first time a name is seen, like PowerSGD's memory. The
residual itself is an opaque framework tensor; this module never looks inside it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, Iterator, Mapping, Optional, Tuple, TypeVar

__all__ = ["TensorRecord", "ErrorFeedbackRegistry", "STATE_FORMAT"]

R = TypeVar("R")

#: Written into every state_dict so that a checkpoint from another layout is refused instead of misread.
STATE_FORMAT = "horovod-topk/1"


@dataclass
class TensorRecord(Generic[R]):
    """What we remember about one named tensor."""

    shape: Tuple[int, ...]
    #: What this rank selected but did not send yet (compensated gradient minus what went on the wire). None for
    #: tensors that travel dense: they have nothing left over.
    residual: Optional[R] = None
    #: DGC momentum-correction buffer u (only with TopKConfig.momentum > 0); masked where entries are sent.
    momentum: Optional[R] = None
    #: How many times the tensor went through a reduction of ours (its step counter).
    steps: int = 0
    #: Bytes this rank handed to collectives for this tensor, in total.
    bytes_sent: int = 0
    #: Bytes a dense allreduce would have been handed for the same steps: the baseline of the compression ratio.
    bytes_dense: int = 0
    #: Steps on which this rank's gradient held NaN/Inf: sent as such, residual left untouched. A framework may
    #: keep it as a 0-dim device tensor (summed without a host sync); readers convert it with int().
    nonfinite_steps: int = 0
    #: The number of workers the residual was accumulated under (None until the first compressed step).
    world_size: Optional[int] = None
    #: Running level of the gradient norm, and how many steps the gradient was capped (TopKConfig.spike_guard).
    gradient_level: float = 0.0
    guarded_steps: int = 0
    #: The int8 route's grid reference (core.exchange.DENSE_INT8): the largest magnitude of this tensor's last
    #: reduced result, the same on every rank; 0 when there is none (the next int8 step goes fp16 and sets it).
    #: Saved, so that a resumed job sends the same words.
    int8_reference: float = 0.0
    #: Seconds of host time spent compressing this tensor (telemetry; not saved). On a GPU this is the time to
    #: launch the work, not to run it: timing it would need a host sync.
    compress_seconds: float = 0.0
    #: The exchange that carried its last compressed step (core.exchange: "allgather" or "sparse_allreduce"; or
    #: "dense_fp16", ratio="auto"'s fp16); "" before any. Telemetry, not saved: it is chosen again each step.
    exchange: str = ""
    #: Whether the ranks' agreement about this tensor was checked (core.consistency) since it was created or
    #: loaded; not saved: a loaded state is checked again.
    verified: bool = False
    #: Update mode's calibrated second moment: the tensor's noise share on its last step (the fraction of its squared
    #: gradient that survived averaging over the ranks; 1/P for pure noise). A 0-dim device tensor read by stats();
    #: telemetry, not saved: it is estimated again each step.
    noise_share: Any = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ErrorFeedbackRegistry(Generic[R]):
    """All TensorRecords of one compressor, by tensor name."""

    records: Dict[str, TensorRecord[R]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Tuple[str, TensorRecord[R]]]:
        return iter(self.records.items())

    def record(self, name: str, shape: Tuple[int, ...]) -> TensorRecord[R]:
        """The record of ``name``, created on first use; refuses a shape that differs from the remembered one.

        A different shape under the same name means the model changed under us (or a checkpoint of another model
        was loaded): adding such a residual would corrupt training silently, so we stop and say which tensor.
        A record without residual or momentum buffer (a tensor that went dense) has nothing to corrupt: it takes
        the new shape, and the ranks' agreement about the tensor is checked again.
        """
        rec = self.records.get(name)
        if rec is None:
            rec = TensorRecord(shape=tuple(shape))
            self.records[name] = rec
        elif tuple(rec.shape) != tuple(shape) and rec.residual is None and rec.momentum is None:
            rec.shape = tuple(shape)
            rec.verified = False
        elif tuple(rec.shape) != tuple(shape):
            raise ValueError(
                f"horovod-topk: tensor {name!r} has shape {tuple(shape)} but its error-feedback state has shape "
                f"{tuple(rec.shape)} (changed model, or a checkpoint of another model?)"
            )
        return rec

    def clear(self) -> None:
        self.records.clear()

    def totals(self) -> Tuple[int, int, int]:
        """(steps, bytes_sent, bytes_dense) over all tensors; steps is the largest per-tensor step count."""
        steps = max((r.steps for r in self.records.values()), default=0)
        return steps, sum(r.bytes_sent for r in self.records.values()), sum(r.bytes_dense for r in self.records.values())

    def state_dict(self, export_residual: Callable[[R], Any]) -> Dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "tensors": {
                name: {
                    "shape": list(rec.shape),
                    "residual": None if rec.residual is None else export_residual(rec.residual),
                    "momentum": None if rec.momentum is None else export_residual(rec.momentum),
                    "steps": rec.steps,
                    "bytes_sent": rec.bytes_sent,
                    "bytes_dense": rec.bytes_dense,
                    "nonfinite_steps": int(rec.nonfinite_steps),  # a 0-dim tensor on the device path
                    "world_size": rec.world_size,
                    "gradient_level": rec.gradient_level,
                    "guarded_steps": rec.guarded_steps,
                    "int8_reference": rec.int8_reference,
                }
                for name, rec in sorted(self.records.items())
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], import_residual: Callable[[str, Any], R]) -> None:
        """Replace all records with those of ``state`` (what :meth:`state_dict` produced)."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"horovod-topk: not a TopKEF state_dict (expected format {STATE_FORMAT!r}, got {found!r})")
        records: Dict[str, TensorRecord[R]] = {}
        for name, entry in state["tensors"].items():
            residual, momentum = entry.get("residual"), entry.get("momentum")
            records[name] = TensorRecord(
                shape=tuple(int(d) for d in entry["shape"]),
                residual=None if residual is None else import_residual(name, residual),
                momentum=None if momentum is None else import_residual(name, momentum),
                steps=int(entry.get("steps", 0)),
                bytes_sent=int(entry.get("bytes_sent", 0)),
                bytes_dense=int(entry.get("bytes_dense", 0)),
                nonfinite_steps=int(entry.get("nonfinite_steps", 0)),
                world_size=None if entry.get("world_size") is None else int(entry["world_size"]),
                gradient_level=float(entry.get("gradient_level", 0.0)),
                guarded_steps=int(entry.get("guarded_steps", 0)),
                int8_reference=float(entry.get("int8_reference", 0.0)),
            )
        self.records = records
