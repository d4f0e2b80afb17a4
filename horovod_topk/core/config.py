"""The one validated configuration object shared by the PyTorch and TensorFlow compressors.

Everything that decides *what* goes on the wire lives here, so that both frameworks (and every rank) take the same
decision from the same numbers. Validation happens at construction: a typo in a job's config must fail before
the first collective, not as a hang in the middle of one.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Union

from .buckets import DEFAULT_BUCKET_BYTES
from .exchange import COLLECTIVE_LATENCY_BYTES, EXCHANGES

__all__ = ["TopKConfig", "MAX_COMPRESSED_NUMEL", "SELECTORS", "VALUE_DTYPES", "INDEX_BITS", "TARGETS", "SECOND_MOMENTS",
           "AUTO", "DEFAULT_BUDGET", "DEFAULT_AUTO_EVERY", "DEFAULT_SPARSITY_COST"]

#: "sampled": threshold estimated on a strided sample, one fused pass, exactly k kept (fast, the default);
#: "exact": the framework's top-k over all entries (the reference).
SELECTORS = ("sampled", "exact")
#: What the values of a payload travel as; None keeps the gradient's own dtype. "float8" is e4m3 (3 mantissa bits)
#: with one float32 scale per tensor and step (core.encoding).
VALUE_DTYPES = (None, "float32", "float16", "bfloat16", "float8")
#: How indices travel: 32-bit, or 16-bit offsets within segments of 65536 entries plus a count per segment
#: (core.encoding).
INDEX_BITS = (32, 16)

#: What is compressed and exchanged: each rank's gradient (the optimizer then steps on the average), each rank's
#: own optimizer update (core.update_mode), or "auto": the update for the Adam family, where it trains better at
#: the same bytes, the gradient elsewhere (core.update_mode.resolve_target).
TARGETS = ("gradient", "update", "auto")
#: The default target.
DEFAULT_TARGET = "auto"
#: Update mode's second moment: "local" -- each rank's optimizer as it is; "shared" -- one per block of entries, the
#: same on every rank; "calibrated" -- each rank's own per entry, fed its squared gradient times the tensor's share of
#: it that survives averaging over ranks (both Adam/AdamW computed by horovod-topk from the user's optimizer's
#: hyperparameters; core.update_mode says why).
SECOND_MOMENTS = ("local", "shared", "calibrated", "auto")
#: "auto": "calibrated" where horovod-topk can compute the optimizer's step (torch's Adam/AdamW), "local" elsewhere.
DEFAULT_SECOND_MOMENT = "auto"

#: ratio="auto": the density chosen from the job's own measurements (core.autodensity).
AUTO = "auto"
#: With ratio="auto": the share of the step that communication (and compression) may take beyond what overlaps
#: compute. 10%: a job pays at most a tenth of its step for a density as high as the link allows.
DEFAULT_BUDGET = 0.1
#: With ratio="auto": steps between decisions once the density has settled (a decision that probes the link runs a
#: few small collectives and two allreduces of the model's bytes; after a change the next decision comes after one
#: window, to check the prediction).
DEFAULT_AUTO_EVERY = 200
#: With ratio="auto": density d is taken to need d ** -sparsity_cost times dense's steps to dense's loss, so a
#: density is chosen for the time it saves to the target, not per step. 0.1 (0.01 -> 1.58x dense's steps, 0.1 ->
#: 1.26x): steps to 1.01x dense's loss measured on Adam-trained language models gave exponents 0.10-0.13 in
#: gradient mode (the GRU at 0.1 and 0.025, the transformer at 0.1 and 0.027, converged budgets) and 0.03-0.11 in
#: update mode; the digits CNN under SGD reached dense's accuracy at 0.01 in dense's epochs (exponent ~0).
#: docs/auto-density.md, "Steps to the target".
DEFAULT_SPARSITY_COST = 0.1

#: Entries per shared second-moment value unless the user says otherwise (core.update_mode says why this size).
DEFAULT_SECOND_MOMENT_BLOCK = 256
#: Buckets of the sketch that estimates each tensor's noise share for second_moment="calibrated" (core.update_mode
#: says why this size).
DEFAULT_SECOND_MOMENT_SKETCH = 64

#: Indices travel as int32 (4 bytes instead of 8 per selected entry), so a tensor compressed as one payload must
#: have fewer than 2**31 elements. Larger tensors are refused by name rather than silently wrapped.
MAX_COMPRESSED_NUMEL = 2**31 - 1


@dataclass(frozen=True)
class TopKConfig:
    """How much of each gradient to send.

    Args:
        ratio (float or "auto"): fraction of each compressed tensor's entries sent per step, in (0, 1];
            k = ceil(ratio * N). 0.01 cuts the bytes handed to collectives ~50x (8 bytes per sent entry versus 4
            per dense entry). "auto": dense for the first steps while the job measures its compute and its link,
            then the largest density (dense, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001) whose communication beyond
            compute fits ``budget`` of the step, decided again every ``auto_every`` steps (core.autodensity).
        budget (float): with ratio="auto", the share of the step communication and compression may take beyond
            what overlaps compute, in (0, 1). Default 0.1.
        auto_every (int): with ratio="auto", steps between decisions once settled. Default 200.
        sparsity_cost (float): with ratio="auto", how many more steps a sparser density is taken to need to the
            same loss: density d needs d ** -sparsity_cost times dense's steps, and auto chooses by predicted time
            to the target (step time x steps). In [0, 1]; default 0.1 (measured on Adam-trained language models);
            0 chooses by step time alone (models that train as well sparse, e.g. CNNs under SGD).
        k (int, optional): a fixed number of entries per tensor instead of a ratio (capped at the tensor's size).
            Fixed k keeps every rank's payload the same size, as ``ratio`` does too.
        min_numel (int): tensors with fewer elements go through Horovod's ordinary dense allreduce. Biases and
            norm scales are tiny; for them the latency of an extra collective costs more than the bytes saved,
            and dense tensors stay eligible for Horovod's tensor fusion.
        selector (str): "sampled" (default) or "exact"; see SELECTORS.
        value_dtype (str, optional): send values as "float16"/"bfloat16" (2 bytes) or "float8" (1 byte: e4m3 with
            one float32 scale per tensor and step) instead of the gradient's 4; the rounding error stays in the
            residual, so nothing is lost. None sends the gradient's dtype.
        index_bits (int): 32 (default) sends int32 indices; 16 sends each index as a 16-bit offset within its
            segment of 65536 entries, plus one int32 count per segment (4 bytes per 65536 entries): 2 bytes per
            entry instead of 4. With value_dtype="float8" an entry costs 3 bytes instead of 8, so the same bytes
            carry 2.7x the entries -- what Adam-trained language models need (README, "Convergence"). The compact
            encoding (index_bits=16 or value_dtype="float8") travels by allgather only.
        dense_fallback (bool): send a tensor dense when a ring allreduce (2 (P - 1) / P * N * gradient bytes per
            rank) moves fewer bytes than the chosen sparse exchange (core.exchange's cost model). Default True.
        exchange (str): how the selected entries travel (core.exchange): "allgather" (every rank receives every
            rank's k entries: (P - 1) k per rank), "sparse_allreduce" (an alltoall to region owners who sum and
            keep ceil(k/P) each, then an allgather: ~2.1 k per rank whatever P), or "auto" (default): per tensor,
            whichever costs less at this world size, counting ``collective_latency_bytes`` for each collective.
        collective_latency_bytes (int): what exchange="auto" counts for each collective an exchange launches, in bytes: a collective's fixed time times the link's rate. The sparse allreduce launches two
            per tensor, the others one, so it is taken only where it saves more than this many bytes per rank and
            tensor. Default 131072 (128 KiB: ~1 ms at 1 Gbit/s, ~0.1 ms at 10 Gbit/s; core.exchange says why).
            0 chooses by bytes alone. Every rank must pass the same value (the rank check compares the routes).
        warmup_steps (int): sparsity warm-up (DGC): over the first W steps of each tensor the ratio decays
            exponentially from 1 to ``ratio`` (ratio_t = ratio ** (t / W)); with dense_fallback the first steps
            are therefore dense. 0 (default) disables it.
        momentum (float): DGC momentum correction for SGD with momentum m: the compressor accumulates
            u = m u + g and the residual v += u, sends the top-k of v and zeroes u and v there (momentum-factor
            masking). Use it with the optimizer's own momentum set to 0. Default 0 (off).
        spike_guard (float, optional): cap each tensor's local gradient norm at ``spike_guard`` times its running
            level (an average of its recent, capped norms; after 50 warm-up steps) before it enters the residual.
            A 100x gradient spike otherwise sits in the residual and crowds fresh gradients out of the payloads for
            ~75 steps (benchmarks/fault_study.py spike). Like gradient clipping it departs from what dense training
            would apply on such a step. Costs one read of the gradient per step. None (default): off.
        target (str): what is compressed. "auto" (default): "update" for Adam/AdamW (torch's and Keras's) where the
            wrapper sees the optimizer (Horovod's DistributedOptimizer, the Keras wrappers; under DDP where
            ``update_mode_optimizer`` wraps it), "gradient" for every other optimizer, for gradient tapes and hand
            allreduces, and with momentum or spike_guard (core.update_mode.resolve_target). "gradient": each rank's
            gradient; the user's optimizer steps on the average. "update": no gradient collective runs; each rank steps the optimizer on its own gradient,
            and what travels (error feedback, selection, the same exchanges) is its update, parameters before minus
            after; every rank then applies the average of the applied updates, bit-identical on every rank. For
            Adam-family optimizers, which normalise each coordinate: a coordinate sent once every L steps as a
            gradient moves ~sqrt(L) steps' worth under Adam, as an update L (core.update_mode).
        second_moment (str): with target="update", where each rank's Adam second moment comes from. "auto"
            (default): "calibrated" for torch's Adam/AdamW (without amsgrad, maximize, differentiable) and Keras's
            Adam/AdamW (Keras 2 and 3, without a loss-scale wrapper or gradient accumulation), "local" for every
            other optimizer. "calibrated" -- with Keras, the optimizer's own step with its velocity moved first so
            that it takes in the scaled squared gradient; with torch, Adam/AdamW's step computed by horovod-topk
            from the optimizer's own hyperparameters, schedule and state (Adam's keys, each rank's own), its squared
            gradient scaled by the share of the tensor's gradient that survives averaging over ranks (estimated
            each step from a sketch of ``second_moment_sketch`` floats per tensor, one small allreduce): a rank's
            own second moment otherwise holds its own batch noise, which the averaged gradient does not, and its
            steps come out up to sqrt(P) too short (core.update_mode; docs/update-mode.md has the measurements).
            "local" -- each rank steps its own optimizer, whatever it is (exact for optimizers linear in the
            gradient, SGD with or without momentum). "shared" -- Adam/AdamW's step with one second moment per block
            of ``second_moment_block`` entries, the mean of every rank's squared gradient, the same on every rank:
            less optimizer state, but it trained no better than "local" in the measured screens.
        second_moment_block (int): entries per shared second-moment value (target="update", second_moment="shared");
            the allreduce carries 4 bytes per block. Default 256 (0.4% of a dense float32 allreduce).
        second_moment_sketch (int): buckets of the sketch per tensor (target="update", second_moment="calibrated");
            the allreduce carries 4 * (buckets + 1) bytes per tensor. Default 64.
        bucket_bytes (int): the compressed gradients of an optimizer travel in buckets of up to this many
            gradient bytes, in the order backward produces them: each member is still selected on its own (its own
            k and residual), but the members planned for the allgather share one payload and one collective, which
            leaves as soon as its last member is ready (core.buckets). Default 25 MiB (PyTorch DDP's bucket size);
            0 sends every tensor on its own. Every rank must pass the same value (the rank check compares it).
            In update mode the updates travel in buckets of this size too (all ready at once, after the local
            step). TensorFlow: the gradients of one reduction (Horovod's ``groups=`` when given, each group one
            bucket) in buckets of the allgather at a fixed k; sparse gradients, a warm-up, ratio="auto" and the
            sparse allreduce per tensor (horovod_topk.tensorflow.buckets).
        log_every (int): telemetry (core.telemetry): every N steps, log one line through Python ``logging``
            (bytes sent, compression ratio, residual norm, time spent compressing) and write those scalars to the
            ``summary_writer=`` given to TopKEF, if any. Changes nothing on the wire; each report reads the
            residual norms (one host sync on GPU every N steps). 0 (default): off.
    """

    ratio: Union[float, str] = 0.01
    k: Optional[int] = None
    min_numel: int = 1024
    selector: str = "sampled"
    value_dtype: Optional[str] = None
    index_bits: int = 32
    dense_fallback: bool = True
    warmup_steps: int = 0
    momentum: float = 0.0
    spike_guard: Optional[float] = None
    exchange: str = "auto"
    log_every: int = 0
    collective_latency_bytes: int = COLLECTIVE_LATENCY_BYTES
    target: str = DEFAULT_TARGET
    second_moment: str = DEFAULT_SECOND_MOMENT
    second_moment_block: int = DEFAULT_SECOND_MOMENT_BLOCK
    second_moment_sketch: int = DEFAULT_SECOND_MOMENT_SKETCH
    budget: Optional[float] = None
    auto_every: Optional[int] = None
    sparsity_cost: Optional[float] = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.ratio == AUTO:
            self._validate_auto()
        else:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
                raise ValueError(f"ratio must be a number in (0, 1] or 'auto', got {self.ratio!r}")
            if not (math.isfinite(self.ratio) and 0.0 < self.ratio <= 1.0):
                raise ValueError(f"ratio must be in (0, 1] or 'auto', got {self.ratio!r}")
            if self.budget is not None or self.auto_every is not None or self.sparsity_cost is not None:
                raise ValueError("budget, auto_every and sparsity_cost apply to ratio='auto' only (a fixed ratio "
                                 "sends what it says)")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"k must be a positive integer (or None to use ratio), got {self.k!r}")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative integer, got {self.min_numel!r}")
        if self.selector not in SELECTORS:
            raise ValueError(f"selector must be one of {', '.join(SELECTORS)}, got {self.selector!r}")
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}, got {self.value_dtype!r}")
        if isinstance(self.index_bits, bool) or self.index_bits not in INDEX_BITS:
            raise ValueError(f"index_bits must be one of {INDEX_BITS}, got {self.index_bits!r}")
        if not isinstance(self.dense_fallback, bool):
            raise ValueError(f"dense_fallback must be True or False, got {self.dense_fallback!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)) or not (
            0.0 <= self.momentum < 1.0
        ):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if self.spike_guard is not None and (
            isinstance(self.spike_guard, bool)
            or not isinstance(self.spike_guard, (int, float))
            or not (math.isfinite(self.spike_guard) and self.spike_guard >= 1.0)
        ):
            raise ValueError(f"spike_guard must be None or a number >= 1, got {self.spike_guard!r}")
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every < 0:
            raise ValueError(f"log_every must be a non-negative integer (0: no telemetry), got {self.log_every!r}")

        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be a non-negative integer number of gradient bytes (0: one "
                             f"collective per tensor), got {self.bucket_bytes!r}")
        if (isinstance(self.collective_latency_bytes, bool) or not isinstance(self.collective_latency_bytes, int)
                or self.collective_latency_bytes < 0):
            raise ValueError(f"collective_latency_bytes must be a non-negative integer number of bytes, got "
                             f"{self.collective_latency_bytes!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))}, got {self.target!r}")
        if self.second_moment not in SECOND_MOMENTS:
            raise ValueError(f"second_moment must be one of {', '.join(map(repr, SECOND_MOMENTS))}, got "
                             f"{self.second_moment!r}")
        if (isinstance(self.second_moment_block, bool) or not isinstance(self.second_moment_block, int)
                or self.second_moment_block < 1):
            raise ValueError(f"second_moment_block must be a positive integer, got {self.second_moment_block!r}")
        if (isinstance(self.second_moment_sketch, bool) or not isinstance(self.second_moment_sketch, int)
                or self.second_moment_sketch < 1):
            raise ValueError(f"second_moment_sketch must be a positive integer, got {self.second_moment_sketch!r}")
        if self.target == "gradient" and (self.second_moment != DEFAULT_SECOND_MOMENT
                                          or self.second_moment_block != DEFAULT_SECOND_MOMENT_BLOCK
                                          or self.second_moment_sketch != DEFAULT_SECOND_MOMENT_SKETCH):
            raise ValueError("second_moment, second_moment_block and second_moment_sketch apply to target='update' "
                             "only, or 'auto' (with target='gradient' the optimizer keeps its own moments of the "
                             "averaged gradient)")
        if self.target == "update" and self.momentum > 0:
            raise ValueError("momentum (DGC momentum correction) applies to target='gradient'; with "
                             "target='update' the optimizer's own momentum acts before compression")
        if self.target == "update" and self.spike_guard is not None:
            raise ValueError("spike_guard applies to target='gradient'; with target='update' clip the gradients "
                             "before the step (torch.nn.utils.clip_grad_norm_ after optimizer.synchronize())")
        if self.compact and self.exchange == "sparse_allreduce":
            raise ValueError("exchange='sparse_allreduce' sends plain (int32, value) entries; the compact encoding "
                             "(index_bits=16, value_dtype='float8') travels by allgather: use exchange='allgather' "
                             "or 'auto' with it")

    def _validate_auto(self) -> None:
        """ratio="auto": fill in budget and auto_every, and refuse what would fight the chosen density."""
        budget = DEFAULT_BUDGET if self.budget is None else self.budget
        every = DEFAULT_AUTO_EVERY if self.auto_every is None else self.auto_every
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (
                math.isfinite(budget) and 0.0 < budget < 1.0):
            raise ValueError(f"budget must be a share of the step in (0, 1), got {budget!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"auto_every must be a positive number of steps, got {every!r}")
        cost = DEFAULT_SPARSITY_COST if self.sparsity_cost is None else self.sparsity_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not (
                math.isfinite(cost) and 0.0 <= cost <= 1.0):
            raise ValueError(f"sparsity_cost must be an exponent in [0, 1] (density d takes d ** -sparsity_cost "
                             f"times dense's steps), got {cost!r}")
        if self.k is not None:
            raise ValueError("ratio='auto' chooses the density itself: leave k unset")
        if self.warmup_steps:
            raise ValueError("ratio='auto' runs its first steps dense while it measures: leave warmup_steps at 0")
        object.__setattr__(self, "budget", float(budget))
        object.__setattr__(self, "auto_every", every)
        object.__setattr__(self, "sparsity_cost", float(cost))

    @property
    def auto(self) -> bool:
        """Whether the density is chosen by the job's measurements (ratio="auto", core.autodensity)."""
        return self.ratio == AUTO

    @property
    def compact(self) -> bool:
        """Whether the compact wire encoding (core.payload) is on: it travels by allgather only."""
        return self.index_bits != 32 or self.value_dtype == "float8"

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TopKConfig":
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown TopKConfig option(s): {', '.join(sorted(unknown))}")
        return cls(**dict(values))

    def describe(self) -> str:
        """A short human-readable summary, used in error messages and logs."""
        amount = (f"k={self.k}" if self.k is not None else "ratio='auto'" if self.auto else f"ratio={self.ratio:g}")
        defaults = TopKConfig()
        extras = "".join(
            f", {name}={getattr(self, name)!r}"
            for name in ("selector", "value_dtype", "index_bits", "dense_fallback", "warmup_steps", "momentum",
                         "spike_guard", "exchange", "collective_latency_bytes", "target", "second_moment",
                         "second_moment_block", "budget", "auto_every", "sparsity_cost", "bucket_bytes")
            if getattr(self, name) != getattr(defaults, name)
        )
        return f"TopKConfig({amount}, min_numel={self.min_numel}{extras})"
