"""ratio="auto": the density chosen from what this job measures, so that compression pays on any link.

A fixed ratio is wrong both ways: over a fast link a dense allreduce hides behind backward and Top-K only adds
selection time and collectives; over a slow one ratio 0.01 may compress far more than the link needs, and every
entry not sent costs convergence. So with ``TopKConfig(ratio="auto", budget=b)`` the compressor:

1. runs the first steps dense and measures, on every rank, each step's period, the time it waited for its
   collectives and the time it spent compressing; compute = period - wait - compress;
2. at a decision step (the same step on every rank), probes the link with two synchronous allreduces (a tiny one:
   the latency of one collective; a large one: the rate), and reduces everything over ranks (max of each column,
   rows gathered so every rank computes the same numbers); the check one window after a change takes the link
   as that change probed it (AutoDensity.reusable_probes), and a regular decision takes the last probes again
   when its choice would stand on a link half or twice as fast (AutoDensity.confirmable_probes, link_settles);
   fresh probes within LINK_NOISE of the link the predictions take leave it as it is (AutoDensity.steady_link);
3. predicts the step time of dense, of dense in float16 (HALF, where the front end can send it), of dense in
   bytes on a shared grid (INT8, where the front end can send it) and of every
   density of DENSITIES with core.costmodel's per-tensor routes
   and bytes (the same plan_tensor the compressor executes), and the time to the target: step time x the steps
   density d is taken to need, d ** -sparsity_cost times dense's (a prior from steps-to-target runs: the
   compressor never sees the loss). It takes **the largest density whose communication beyond compute fits the
   budget** (exposed <= budget x step), dense when dense fits, then fp16 (half dense's bytes, dense's steps), then
   int8 (a quarter of dense's bytes, taken to need dense's steps too), or
   the soonest to the target of the denser ones when they are sooner; if none fits, the densest within 5% of the
   soonest; never one predicted later than dense;
4. decides again every ``auto_every`` steps (and soon after every change, to check the prediction against the
   measured step), changing its mind only with hysteresis.

Prediction, per step::

    T(x)    = compute + compress(x) + max(0, comm(x) - hidden) + offset     (dense: no compress, no offset)
    comm    = bytes(x) / rate + collectives(x) x latency      (core.costmodel, the probed link; a sparse
              allreduce's two collectives count a lone collective's time each: they are chained, not fused)
    compute = period - wait of the last dense window (per rank, max over ranks)
    hidden  = comm(dense) - measured exposure of that window: what backward hides (negative when dense's
              collectives ran slower than the probes predict), so that T(dense) is the step measured
    offset  = measured - predicted step of the last sparse window: what compressing costs beyond its selection
              and its bytes (more collectives, their cycles, CPU taken from backward), the same for every density
              (fp16 and int8 have their own, from their own windows: the casts and the residual's pass)

Everything here is a pure function of numbers every rank holds after the reduction, so every rank takes the same
decision at the same step; the compressor re-runs its rank agreement check after each change.
Standard library only, like the rest of core.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .config import TopKConfig
from .costmodel import Link, collectives_per_step, comm_time, route_tensors
from .exchange import COLLECTIVES, DENSE, DENSE_HALF, DENSE_INT8, SPARSE_ALLREDUCE, int8_offered
from .policy import RouteSchedule, TensorPlan, plan_tensor, route_schedule

__all__ = [
    "DENSITIES",
    "HALF",
    "INT8",
    "Density",
    "HYSTERESIS",
    "WINDOW_STEPS",
    "LINK_MARGIN",
    "PROBES_KEPT_DECISIONS",
    "SETTLE_STEPS",
    "FIRST_WINDOW_STEPS",
    "FIRST_DECISION",
    "CHECK_STEPS",
    "LINK_NOISE",
    "Measurement",
    "Choice",
    "link_from_probes",
    "predict_steps",
    "choose_density",
    "steps_factor",
    "to_target",
    "AutoDensity",
    "held_schedule",
    "CHOICES",
    "choice_index",
    "config_at",
    "auto_schedule",
    "dense_plan",
    "half_plan",
    "int8_plan",
]

#: The densities auto chooses among, densest first (dense itself is the candidate None).
DENSITIES = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)
#: Every tensor dense with its values in float16: half dense's bytes at dense's steps. What Horovod's
#: ``Compression.fp16`` sends, with error feedback (core.exchange.DENSE_HALF). Chosen where the front end sends it
#: (AutoDensity.half); it goes between dense and the densities because it sends more of the gradient than any of them.
HALF = "fp16"
#: Every tensor dense with each value one byte on a grid the ranks share (core.exchange.DENSE_INT8): a quarter of
#: dense's bytes. Its rounding goes to the residual as fp16's does; the transformer reached its target at fp16's
#: steps on the test bed, the GRU at 7% more (docs/auto-density.md), so it is priced at dense's steps like fp16.
#: Chosen where the front end sends it (AutoDensity.int8) and core.exchange.int8_offered (up to 4 workers); it
#: goes between fp16 and the densities.
INT8 = "int8"
#: What auto may have in force: None (dense), HALF, INT8, or one of DENSITIES.
Density = Union[None, str, float]
#: Every choice: the position a traced graph (TensorFlow) looks up to take the density in force. INT8 last, so
#: that the others keep their positions.
CHOICES: Tuple[Density, ...] = (None, HALF) + DENSITIES + (INT8,)
#: The dense choices (every tensor dense, in its own dtype, float16 or bytes), densest first.
HELD = (None, HALF, INT8)
#: How many of the last decisions that changed the choice stats()["auto"]["history"] keeps.
HISTORY_KEPT = 64
#: A change needs a 25% margin: the step predicted this much faster, or the budget missed (or met) by this much.
HYSTERESIS = 0.25
#: A denser density (dense included) predicted this much faster than the current one is taken at once: sending
#: more costs no time then, and compressing less helps convergence.
FASTER = 0.05
#: Steps measured before a decision (their median counts, so one slow step does not decide).
WINDOW_STEPS = 10
#: Steps not measured after a start or a decision: the decision step runs the probes, the next one the rank
#: agreement checks and new buffers.
SETTLE_STEPS = 2
#: Steps measured before the first decision: fewer than WINDOW_STEPS because they run dense whatever the link, and
#: over a slow link each costs what compressing would have saved (digits on 4 workers over 100 Mbit/s: ~115 ms a
#: dense step against ~50 ms at ratio 0.01); the first choice is checked one window after it is taken anyway, as
#: every change is. Four steps still give a median (of the middle two) that one slow step does not move.
FIRST_WINDOW_STEPS = 4
#: The step of the first decision (dense until then).
FIRST_DECISION = SETTLE_STEPS + FIRST_WINDOW_STEPS
#: Steps from a change (or a load, or new workers) to the decision that checks it against a fresh window.
CHECK_STEPS = SETTLE_STEPS + WINDOW_STEPS
#: A regular decision after one that kept the choice takes the last probes again, without probing, when the choice
#: in force would be kept with the link they measured and with that link this many times slower or faster
#: (AutoDensity.link_settles): the window's own numbers (compute, the step in force) are fresh either way, and a
#: link that moved less could change nothing. The rates a decision's probes measured on one shaped link of this
#: project's test bed spread by ~1.4x between jobs (100.9-142.6 Mbit/s through 100 Mbit/s). A decision's probes
#: cost ~0.4 s on 4 workers over 100 Mbit/s (3 lone collectives, two of the model's bytes, a burst, the rows).
LINK_MARGIN = 2.0
#: ... and when those probes are at most this many ``auto_every`` old: a sparse step hides a faster link (its few
#: bytes took little time on the slower one), so the link is probed afresh at least this often.
PROBES_KEPT_DECISIONS = 4
#: Fresh probes that read a rate within this factor of the link the predictions take leave that link as it is
#: (AutoDensity.steady_link). The rates a decision's probes read on one shaped link spread by ~1.3x within a job
#: (digits in Keras, 4 workers over 100 Mbit/s: 87.5 Mbit/s at the first decision, 115 at step 224), and pricing dense
#: with each reading moved its prediction a fifth off the step its own window measured (86 ms predicted, 108 ms
#: measured): enough to leave a density for dense and come back one window later. A link that changes by less
#: still reaches the predictions through the measured steps (a dense window's hidden term, a sparse window's
#: offset); one that changes by more is taken as the probes read it.
LINK_NOISE = 1.5
#: Columns of one rank's measurement row (reduced with max over ranks).
COLUMNS = ("period_s", "compute_s", "compress_s", "latency_s", "large_s", "select_s_per_entry", "lone_s")


def window_kind(ratio: Density) -> str:
    """What a window run at ``ratio`` measures: "dense", HALF, INT8, or "sparse" (any density: one offset for
    all)."""
    return "dense" if ratio is None else ratio if ratio in (HALF, INT8) else "sparse"  # type: ignore[return-value]


def choice_index(ratio: Density) -> int:
    """The position of ``ratio`` (None: dense) in CHOICES."""
    if ratio not in CHOICES:
        raise ValueError(f"horovod-topk: {ratio!r} is not one of auto's choices: None (dense), {HALF!r}, {INT8!r} "
                         f"or one of {DENSITIES}")
    return CHOICES.index(ratio)


def config_at(config: TopKConfig, ratio: float) -> TopKConfig:
    """The fixed-ratio configuration a ratio="auto" compressor plans with while ``ratio`` is in force."""
    return replace(config, ratio=ratio, budget=None, auto_every=None, sparsity_cost=None)


@functools.lru_cache(maxsize=4096)  # asked for every tensor of every held step; plans are frozen
def dense_plan(numel: int) -> TensorPlan:
    """A tensor's plan while ratio="auto" holds dense: what every front end plans before the first decision and
    whenever dense is chosen."""
    return TensorPlan(numel, None, "ratio='auto': dense", DENSE)


@functools.lru_cache(maxsize=4096)  # asked for every tensor of every held step; plans are frozen
def half_plan(numel: int, is_floating: bool, grad_itemsize: int) -> TensorPlan:
    """A tensor's plan while ratio="auto" holds fp16: dense in float16, unless float16 saves nothing (a gradient of
    2 bytes or fewer a value already, not floating point, or empty: dense as it is)."""
    if not is_floating or grad_itemsize <= 2 or numel == 0:
        return dense_plan(numel)
    return TensorPlan(numel, None, "ratio='auto': fp16", DENSE_HALF)


@functools.lru_cache(maxsize=4096)  # asked for every tensor of every held step; plans are frozen
def int8_plan(numel: int, is_floating: bool, grad_itemsize: int) -> TensorPlan:
    """A tensor's plan while ratio="auto" holds int8: dense in bytes on a shared grid, unless that saves nothing
    (a gradient of one byte a value already, not floating point, or empty: dense as it is)."""
    if not is_floating or grad_itemsize <= 1 or numel == 0:
        return dense_plan(numel)
    return TensorPlan(numel, None, "ratio='auto': int8", DENSE_INT8)


def auto_schedule(name: str, numel: int, is_floating: bool, config: TopKConfig, *, world_size: int,
                  value_itemsize: int, grad_itemsize: int, sparse_available: bool = False, half: bool = False
                  ) -> Optional[RouteSchedule]:
    """A tensor's route and k under each of CHOICES (position i: CHOICES[i]), for a traced graph that holds one
    branch per route and looks up the choice in force at each step; None when every choice sends it dense (not
    floating, or too small and fp16 not offered). Each position's plan is the one PyTorch executes while that
    choice is in force: plan_tensor's at a density, half_plan's at HALF where ``half`` (the compressor's
    AutoDensity offers fp16: every floating tensor, however small, goes in float16 then), else dense; INT8's is
    dense (a traced graph's front end does not send int8: its grid's reference is read on the host)."""
    held = half_plan(numel, is_floating, grad_itemsize) if half else dense_plan(numel)
    plans = [dense_plan(numel), held] + [
        plan_tensor(name, numel, is_floating, config_at(config, ratio), world_size=world_size,
                    value_itemsize=value_itemsize, grad_itemsize=grad_itemsize, sparse_available=sparse_available)
        for ratio in DENSITIES] + [dense_plan(numel)]
    return route_schedule(plans)


def held_schedule(schedule: RouteSchedule) -> RouteSchedule:
    """``schedule`` (auto_schedule's) as a step of update mode's gradient route takes it: only dense and fp16 are
    ever in force there (core.update_mode), so a traced route holds their branches alone; the densities' positions
    point at dense's branch, never taken. Keeps the tensor scheduled (stamped for auto's measurement) even where
    both are dense."""
    held = [schedule.routes[schedule.phase[i]] for i in range(2)]
    routes = tuple(dict.fromkeys(held))
    phase = tuple(routes.index(held[i]) if i < 2 else routes.index(held[0]) for i in range(len(schedule.phase)))
    return RouteSchedule(routes, phase, tuple(0 for _ in schedule.phase))


@dataclass(frozen=True)
class Measurement:
    """What the job measured, reduced over ranks (max of each column): the slowest rank's compute decides.

    ``large_nbytes`` is what one rank moved in the large probe (a ring allreduce moves 2 (P-1)/P of it).
    """

    period_s: float
    compute_s: float
    compress_s: float
    latency_s: float
    large_s: float
    large_nbytes: float
    select_s_per_entry: float
    world_size: int
    #: One collective alone (it waits for its own turn of Horovod's negotiation cycle): what each collective of a
    #: sparse allreduce costs, whose alltoall first exchanges split counts with a blocking call and is not fused
    #: (``latency_s`` is what one more collective adds among many in flight, as a step's allgathers are).
    lone_s: float = 0.0

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float]], large_nbytes: float, world_size: int) -> "Measurement":
        if not rows or any(len(r) != len(COLUMNS) for r in rows):
            raise ValueError(f"measurement rows must have {len(COLUMNS)} columns ({', '.join(COLUMNS)})")
        top = [max(float(r[i]) for r in rows) for i in range(len(COLUMNS))]
        return cls(*top[:5], large_nbytes=large_nbytes, select_s_per_entry=top[5], world_size=world_size,
                   lone_s=top[6])

    @property
    def exposed_s(self) -> float:
        """What communication cost beyond compute in the measured window (wait + compress)."""
        return max(0.0, self.period_s - self.compute_s)

    def link(self) -> Link:
        """The probed link: latency of one collective, and the rate the large probe got beyond that latency
        (already the effective rate: efficiency 1)."""
        transfer = max(self.large_s - self.latency_s, 1e-9)
        rate_bps = max(self.large_nbytes * 8.0 / transfer, 1e3)
        return Link(bandwidth_bps=rate_bps, efficiency=1.0, latency_s=max(self.latency_s, 0.0))


def link_from_probes(small_s: float, large_s: float, large_nbytes: float) -> Link:
    """The link two probe times describe (see Measurement.link)."""
    m = Measurement(0.0, 0.0, 0.0, small_s, large_s, large_nbytes, 0.0, 2)
    return m.link()


@dataclass(frozen=True)
class Choice:
    """One decision: ``ratio`` (None: dense), why, the predicted step time of every candidate, and its predicted
    time to the target in dense-step units (step time x steps_factor: what the decision compares)."""

    ratio: Density
    reason: str
    predicted_s: Dict[str, float]
    exposed_s: Dict[str, float]
    to_target_s: Dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return label(self.ratio)


def label(ratio: Density) -> str:
    """The name of a choice in predictions and logs: "dense", "fp16", or the density ("0.01")."""
    if ratio is None or isinstance(ratio, str):
        return "dense" if ratio is None else ratio
    return f"{ratio:g}"


def steps_factor(ratio: Density, sparsity_cost: float) -> float:
    """How many times dense's steps density ``ratio`` is taken to need to dense's loss: ratio ** -sparsity_cost
    (1 for dense and fp16, whose losses match dense's). A prior, not a measurement of this job: the compressor
    never sees the loss. Its exponent comes from steps-to-target runs (core.config.DEFAULT_SPARSITY_COST)."""
    if ratio is None or isinstance(ratio, str):
        return 1.0
    return float(ratio) ** -float(sparsity_cost)


def to_target(steps: Mapping[str, float], sparsity_cost: float) -> Dict[str, float]:
    """Predicted time to the target per candidate label, in dense-step units: step time x steps_factor."""
    factors = {label(r): steps_factor(r, sparsity_cost) for r in DENSITIES}
    return {key: seconds * factors.get(key, 1.0) for key, seconds in steps.items()}


def predict_steps(
    tensors: Sequence[Tuple[str, int]],
    config: TopKConfig,
    m: Measurement,
    *,
    compute_s: float,
    hidden_s: float,
    offset_s: float,
    grad_itemsize: int = 4,
    half_offset_s: float = 0.0,
    int8_offset_s: float = 0.0,
) -> Tuple[Dict[str, float], Dict[str, float], Dict[str, int]]:
    """(predicted step time, predicted exposed time, entries compressed) per candidate label ("dense", "fp16",
    "int8", and each density of DENSITIES) from the compute of the last dense window and the probed link (module
    docstring). A negative ``hidden_s`` is dense's communication measured slower than the probes predict;
    ``half_offset_s`` (``int8_offset_s``) is what an fp16 (int8) window measured beyond its prediction."""
    link = m.link()
    world_size = m.world_size
    steps: Dict[str, float] = {}
    exposed: Dict[str, float] = {}
    compressed: Dict[str, int] = {}
    held_offsets = {"dense": 0.0, HALF: half_offset_s, INT8: int8_offset_s}
    for method, held_offset in held_offsets.items():
        routes = route_tensors(method, tensors, world_size, grad_itemsize=grad_itemsize)
        t_comm = comm_time(sum(r.nbytes for r in routes), collectives_per_step(routes, method, world_size,
                                                                                grad_itemsize, link), link)
        exposed[method] = max(0.0, t_comm - hidden_s + held_offset)
        steps[method] = compute_s + exposed[method]
        compressed[method] = 0
    for ratio in DENSITIES:
        cfg = replace(config, ratio=ratio, budget=None, auto_every=None, sparsity_cost=None)
        routes = route_tensors("topk", tensors, world_size, config=cfg, grad_itemsize=grad_itemsize)
        chained = COLLECTIVES[SPARSE_ALLREDUCE] * sum(1 for r in routes if r.route == SPARSE_ALLREDUCE)
        collectives = collectives_per_step(routes, "topk", world_size, grad_itemsize, link) - chained
        t_comm = (comm_time(sum(r.nbytes for r in routes), collectives, link)
                  + chained * max(m.lone_s, link.latency_s))
        entries = sum(r.numel for r in routes if r.route != DENSE)
        t_compress = m.select_s_per_entry * entries
        key = label(ratio)
        exposed[key] = max(0.0, t_compress + max(0.0, t_comm - max(hidden_s, 0.0)) + (offset_s if entries else 0.0))
        steps[key] = compute_s + exposed[key]
        compressed[key] = entries
    return steps, exposed, compressed


def _fits(key: str, steps: Mapping[str, float], exposed: Mapping[str, float], budget: float,
          margin: float = 1.0) -> bool:
    return exposed[key] <= budget * steps[key] * margin + 1e-12


def choose_density(
    tensors: Sequence[Tuple[str, int]],
    config: TopKConfig,
    m: Measurement,
    *,
    current: Optional[float],
    first: bool,
    compute_s: Optional[float] = None,
    hidden_s: float = 0.0,
    offset_s: float = 0.0,
    grad_itemsize: int = 4,
    half: bool = False,
    half_offset_s: float = 0.0,
    int8: bool = False,
    int8_offset_s: float = 0.0,
    unmeasured: Sequence[str] = (),
    abandoned: Sequence[str] = (),
) -> Choice:
    """The density for the next steps (None: dense; HALF: dense in float16, a candidate only where ``half``; INT8:
    dense in bytes, only where ``int8`` and core.exchange.int8_offered at P workers). Pure: every rank computes it
    from the same numbers.

    Time to the target is step time x steps_factor (``config.sparsity_cost``; 0: step time alone). The largest
    density (dense first) whose exposed communication fits ``config.budget`` of the step, unless a denser one is
    predicted to reach the target sooner (then the soonest of those); if none fits, the densest within FASTER of
    the soonest to the target (with sparsity_cost 0: within the budget of the fastest step, the budget standing in
    for what entries not sent cost); never one predicted to reach it later than dense. Against ``current`` (unless
    ``first``, or ``current`` is predicted later than dense): a denser choice is taken if it is predicted FASTER
    sooner or fits the budget with HYSTERESIS to spare, a sparser one only if it is predicted FASTER sooner and
    ``current`` misses the budget by HYSTERESIS or is predicted HYSTERESIS later. The FASTER margin both ways keeps
    two choices whose steps differ by less than a window's noise (dense and fp16 3-6% apart on a compute-bound job)
    from trading places at every decision, each change costing a window at the one that turns out slower: a budget
    missed is no reason to take a choice that is not sooner. ``unmeasured`` (labels): choices no window of this
    job has run, whose predictions lack the offset a window measures (fp16's casts and residual pass, a density's
    costs beyond its selection): replacing ``current`` by one of them on a prediction needs HYSTERESIS instead of
    FASTER (digits on 4 workers over 100 Mbit/s: fp16 predicted 70 ms against ratio 0.01's measured 81 ms, then
    measured 131 ms). ``abandoned`` (labels): choices this job took and left again at the check one window later:
    coming back to one of them needs HYSTERESIS too, or two choices whose windows scatter by more than FASTER trade
    places at every decision (digits in Keras on 4 workers over 100 Mbit/s: fp16 -> 0.03 -> fp16 -> 0.03 at steps
    224, 236 and 248, each on a 7-24% predicted gain).
    """
    budget = float(config.budget if config.budget is not None else 0.0)
    steps, exposed, _ = predict_steps(tensors, config, m, compute_s=m.compute_s if compute_s is None else compute_s,
                                      hidden_s=hidden_s, offset_s=offset_s, grad_itemsize=grad_itemsize,
                                      half_offset_s=half_offset_s, int8_offset_s=int8_offset_s)
    offered = {None: True, HALF: half, INT8: int8 and int8_offered(m.world_size)}
    if not offered[INT8]:  # predicted for no one: kept out of the telemetry too
        for table in (steps, exposed):
            table.pop(INT8, None)
    time = to_target(steps, float(config.sparsity_cost or 0.0))

    def choice(ratio: Density, why: str) -> Choice:
        return Choice(ratio, why, steps, exposed, time)

    if m.world_size <= 1:
        return choice(None, "one worker: nothing travels")
    order: List[Density] = [r for r in HELD if offered[r]] + list(DENSITIES)
    if current not in order:  # fp16 in force where it is no longer a candidate: decide afresh
        current, first = None, True
    fitting = [r for r in order if _fits(label(r), steps, exposed, budget)]
    if fitting:
        best = fitting[0]
        why = (f"{label(best)} fits the budget" if best in HELD else "the largest density that fits the budget")
    else:  # compress no more than the link needs: the densest near the soonest to the target. With sparsity_cost
        # 0 "near" is the budget, a proxy for what entries not sent cost; a positive cost prices that already, so
        # only a FASTER tie goes to the denser one.
        soonest = min(time[label(r)] for r in order)
        near = budget if not config.sparsity_cost else FASTER
        best = next(r for r in order if time[label(r)] <= soonest * (1 + near) + 1e-12)
        why = "nothing fits the budget: the densest near the soonest to the target"
    sooner = [r for r in order[:order.index(best)] if time[label(r)] < time[label(best)]]
    if sooner:  # denser and predicted to reach the target sooner, though its communication misses the budget
        best = min(sooner, key=lambda r: time[label(r)])
        why = "the soonest to the target of the densities denser than the largest that fits the budget"
    if time[label(best)] > time["dense"]:
        best, why = None, "no density is predicted to reach the target sooner than dense"
    if first or best == current:
        return choice(best, why)
    cur = label(current)
    if time[cur] > time["dense"] * (1 + 1e-12):  # hysteresis never keeps a density predicted later than dense
        return choice(best, why + " (the current density is predicted later to the target than dense)")
    position = order.index
    margin = HYSTERESIS if label(best) in unmeasured or label(best) in abandoned else FASTER
    if position(best) < position(current):  # denser than now: with room to spare, or sooner than now
        if time[cur] > time[label(best)] * (1 + margin):
            return choice(best, why + f" (the current density is predicted later to the target than {label(best)})")
        denser = [r for r in order[:position(current)] if _fits(label(r), steps, exposed, budget, 1 / (1 + HYSTERESIS))
                  and time[label(r)] <= time["dense"]]
        if denser:
            return choice(denser[0], "the link has room for a denser payload")
        return choice(current, f"kept (hysteresis: {label(best)} does not fit with {HYSTERESIS:.0%} to spare)")
    misses = not _fits(cur, steps, exposed, budget, 1 + HYSTERESIS)
    later = time[cur] > time[label(best)] * (1 + HYSTERESIS)
    if not time[cur] > time[label(best)] * (1 + margin):  # the margin that brings a denser one back (above)
        return choice(current, f"kept (hysteresis: {label(best)} is not predicted {margin:.0%} sooner)")
    if misses or later:
        return choice(best, why + (" (the current density misses it)" if misses else " (the current one is later)"))
    return choice(current, f"kept (hysteresis: {label(best)} is not {HYSTERESIS:.0%} better)")


@dataclass
class AutoDensity:
    """The state of ratio="auto" on one rank: the density in force, the measurement window, the schedule of
    decisions and what each decided. What persists (state_dict) is what every rank holds alike."""

    config: TopKConfig
    #: Whether this front end sends HALF (dense in float16), so that auto may choose it.
    half: bool = False
    #: Whether this front end sends INT8 (dense in bytes on a shared grid), so that auto may choose it.
    int8: bool = False
    #: The density in force (None: dense; HALF: dense in float16; INT8: in bytes). Dense until the first decision.
    ratio: Density = None
    #: Steps begun since construction or load (the global step of this compressor).
    step: int = -1
    #: The step at which the next decision is taken (the first: FIRST_DECISION, after that many dense steps).
    next_decision: int = FIRST_DECISION
    #: Compute per step (period - wait) and the comm hidden behind it (negative: dense measured slower than the
    #: probes predict), both from the last dense window; and the sparse offset, from the last sparse window.
    #: Compute is not taken from sparse windows: what compression costs beyond its selection shows up there.
    compute_s: float = 0.0
    hidden_s: float = 0.0
    offset_s: float = 0.0
    #: What the last fp16 window measured beyond fp16's prediction (its casts, its residual's pass); the same of
    #: int8 for int8.
    half_offset_s: float = 0.0
    int8_offset_s: float = 0.0
    decisions: int = 0
    changes: int = 0
    last: Dict[str, Any] = field(default_factory=dict)
    #: (step, choice) of the first decision and of every decision that changed the choice since construction or
    #: load, the last HISTORY_KEPT of them: what a run chose when, for stats() and a study's records.
    history: List[Tuple[int, str]] = field(default_factory=list)
    _measure_from: int = SETTLE_STEPS
    _started: Optional[float] = None
    _wait: float = 0.0
    _compress: float = 0.0
    _samples: List[Tuple[float, float, float]] = field(default_factory=list)
    #: The last probes, reduced over ranks (latency, large, selection per entry, lone: Measurement's fields), the
    #: step they ran at, and whether the decision now due may take them again (reusable_probes).
    _probes: Optional[Tuple[float, float, float, float]] = None
    _probed_at: int = -1
    _recheck: bool = False
    #: The link the predictions take (latency, large, lone: the probe fields of a reduced Measurement), and the
    #: rate the latest fresh probes read (steady_link).
    _anchor: Optional[Tuple[float, float, float]] = None
    _probed_bps: float = 0.0
    #: What the last decision did, "kept" or "changed" the choice ("" after a load or decide_soon): a decision after
    #: a kept one may confirm the last probes (confirmable_probes), one after a change is its check (``abandoned``).
    _last_did: str = ""
    #: What windows of this job have run: "dense", HALF, INT8, "sparse" (any density): the others' predictions lack their
    #: measured offset (choose_density's ``unmeasured``).
    measured: List[str] = field(default_factory=list)
    #: Choices (labels) a check left one window after a change took them: coming back to one needs the hysteresis
    #: margin (choose_density's ``abandoned``).
    abandoned: List[str] = field(default_factory=list)
    #: Update-mode optimizers (their scopes, core.scopes) whose last step ran as gradient mode because this state
    #: held dense or fp16 (:attr:`holds_dense`): their ranks' own optimizer state is the same on every rank and
    #: their residuals hold gradients, not updates. Saved, so that a resumed job neither averages what is equal
    #: nor mistakes what its residuals hold (the front end's update step keeps it: torch.update_mode).
    shared_scopes: List[str] = field(default_factory=list)
    #: Of those, the ones whose ranks' own state may differ again: Horovod elastic reset the job, and a worker that
    #: joined holds its own (update mode's first moments kept beside its residuals start at zero there). The
    #: next step on the gradient route averages that state again, its residuals untouched (they hold gradient).
    #: Not saved: a reset is not a resume.
    resync_scopes: List[str] = field(default_factory=list)

    # ---- per step --------------------------------------------------------------------------------------------
    def begin(self, step: int, now: float) -> bool:
        """A tensor of global step ``step`` arrived at ``now``; True when it is the first of a new step and a
        decision is due before it is planned."""
        if step <= self.step:
            return False
        if self._started is not None and self.step >= self._measure_from:
            period = now - self._started
            self._samples.append((period, self._wait, self._compress))
        self.step, self._started, self._wait, self._compress = step, now, 0.0, 0.0
        return step >= self.next_decision

    def waited(self, seconds: float) -> None:
        """Time this rank spent waiting for collectives in the current step."""
        self._wait += seconds

    def compressed(self, seconds: float) -> None:
        """Time this rank spent compressing in the current step."""
        self._compress += seconds

    def local_row(self, latency_s: float, large_s: float, select_s_per_entry: float, lone_s: float = 0.0
                  ) -> List[float]:
        """This rank's row of COLUMNS: medians over the window, and the probes just run."""
        samples = self._samples[-max(WINDOW_STEPS, 1):] or [(0.0, 0.0, 0.0)]
        period = statistics.median(s[0] for s in samples)
        compress = statistics.median(s[2] for s in samples)
        compute = statistics.median(max(0.0, s[0] - s[1] - s[2]) for s in samples)
        return [period, compute, compress, latency_s, large_s, select_s_per_entry, lone_s]

    def wait_counts(self) -> bool:
        """Whether the wait of the step in progress counts toward the next decision (it is among the last
        WINDOW_STEPS measured before it), or is the step just before those. A front end whose wait is costly to
        read (TensorFlow reads stamp variables from the host) reads it only then; the step before the window
        refreshes what it compares the next reading with."""
        return self.step >= max(self._measure_from, self.next_decision - WINDOW_STEPS) - 1

    def reusable_probes(self) -> Optional[Tuple[float, float, float, float]]:
        """The last probes' values when the decision now due is the check of a change made one window ago, which
        probed the link itself: that check measures the new choice's step, and the link is taken as it was a
        window before (re-probing it cost ~0.4 s per change on 4 workers over 100 Mbit/s, of a digits job whose
        steps take ~15 s in all). None otherwise: the first decision, a check whose own decision reused probes, and
        every decision after a load or a change of workers probe afresh; a regular one may confirm the last probes
        (confirmable_probes). The same on every rank: it depends only on decisions, which every rank takes alike."""
        return self._probes if self._recheck else None

    def confirmable_probes(self) -> Optional[Tuple[float, float, float, float]]:
        """The last probes' values when the decision now due may take them again if they settle it
        (link_settles): a regular decision after one that kept the choice, with probes at most
        PROBES_KEPT_DECISIONS x auto_every steps old. None otherwise (then the link is probed). The same on every
        rank: it depends only on decisions."""
        if self._recheck or self._last_did != "kept" or self._probes is None:
            return None
        if self.step - self._probed_at > PROBES_KEPT_DECISIONS * int(self.config.auto_every or 0):
            return None
        return self._probes

    def remember_probes(self, m: Measurement, reused: bool) -> None:
        """Keep ``m``'s probe fields (reduced over ranks) for the check after a change (reusable_probes); a
        measurement that reused them leaves them as they are."""
        if not reused:
            self._probes = (m.latency_s, m.large_s, m.select_s_per_entry, m.lone_s)
            self._probed_at = self.step

    def steady_link(self, m: Measurement) -> Measurement:
        """``m`` (fresh probes, reduced over ranks) with the link the predictions take: the anchor's probe fields
        while ``m``'s rate is within LINK_NOISE of the anchor's, else ``m``'s own, which become the anchor. The
        same on every rank: ``m`` is."""
        self._probed_bps = m.link().bandwidth_bps
        if self._anchor is not None:
            latency, large, lone = self._anchor
            anchored = replace(m, latency_s=latency, large_s=large, lone_s=lone)
            if 1.0 / LINK_NOISE <= self._probed_bps / anchored.link().bandwidth_bps <= LINK_NOISE:
                return anchored
        self._anchor = (m.latency_s, m.large_s, m.lone_s)
        return m

    def window_was_dense(self) -> bool:
        return self.ratio is None

    # ---- decisions -------------------------------------------------------------------------------------------
    def _weigh(self, tensors: Sequence[Tuple[str, int]], m: Measurement, grad_itemsize: int
               ) -> Tuple[Measurement, Dict[str, float], Choice]:
        """What the window of ``m`` says and what it chooses, without changing any state: ``m`` (a sparse window's
        with its measured selection cost), the terms the window measures (a dense window: compute and hidden; an
        fp16 window: fp16's offset; a sparse one: the offset), and the choice."""
        terms = {"compute_s": self.compute_s, "hidden_s": self.hidden_s, "offset_s": self.offset_s,
                 "half_offset_s": self.half_offset_s, "int8_offset_s": self.int8_offset_s}
        if self.ratio is None:  # a dense window: compute, and what backward hid of dense's communication
            raw, _, _ = predict_steps(tensors, self.config, m, compute_s=0.0, hidden_s=0.0, offset_s=0.0,
                                      grad_itemsize=grad_itemsize)
            terms.update(compute_s=m.compute_s, hidden_s=raw["dense"] - m.exposed_s)
        elif self.ratio in (HALF, INT8):  # an fp16 / int8 window: what it costs beyond its bytes on this machine
            before, _, _ = predict_steps(tensors, self.config, m, compute_s=self.compute_s, hidden_s=self.hidden_s,
                                         offset_s=0.0, grad_itemsize=grad_itemsize)
            terms["half_offset_s" if self.ratio == HALF else "int8_offset_s"] = m.period_s - before[str(self.ratio)]
        else:  # a sparse window: the selection's measured cost, and what the model missed at this density
            _, _, entries = predict_steps(tensors, self.config, m, compute_s=0.0, hidden_s=0.0, offset_s=0.0,
                                          grad_itemsize=grad_itemsize)
            if entries[label(self.ratio)] and m.compress_s > 0:
                m = replace(m, select_s_per_entry=m.compress_s / entries[label(self.ratio)])
            before, _, _ = predict_steps(tensors, self.config, m, compute_s=self.compute_s, hidden_s=self.hidden_s,
                                         offset_s=0.0, grad_itemsize=grad_itemsize)
            terms["offset_s"] = m.period_s - before[label(self.ratio)]
        measured = set(self.measured) | {window_kind(self.ratio)}
        unmeasured = [kind for kind in (HALF, INT8) if kind not in measured] + (
            [label(r) for r in DENSITIES] if "sparse" not in measured else [])
        choice = choose_density(tensors, self.config, m, current=self.ratio, first=self.decisions == 0,
                                grad_itemsize=grad_itemsize, half=self.half, int8=self.int8, unmeasured=unmeasured,
                                abandoned=self.abandoned, **terms)
        return m, terms, choice

    def link_settles(self, tensors: Sequence[Tuple[str, int]], m: Measurement, grad_itemsize: int = 4) -> bool:
        """Whether the decision due keeps the choice in force with the link of ``m`` (the last probes) and with
        that link LINK_MARGIN times slower or faster: then probing it again could change nothing short of a
        larger change of the link, and the probes are skipped (confirmable_probes). Pure: the same on every rank."""
        for factor in (1.0, LINK_MARGIN, 1.0 / LINK_MARGIN):
            scaled = replace(m, latency_s=m.latency_s * factor, large_s=m.large_s * factor, lone_s=m.lone_s * factor)
            if self._weigh(tensors, scaled, grad_itemsize)[2].ratio != self.ratio:
                return False
        return True

    def decide(self, tensors: Sequence[Tuple[str, int]], m: Measurement, grad_itemsize: int = 4) -> Choice:
        """Take the decision due at this step from the reduced measurement ``m`` (the same on every rank)."""
        first = self.decisions == 0
        window_ratio = self.ratio
        m, terms, choice = self._weigh(tensors, m, grad_itemsize)
        self.compute_s, self.hidden_s = terms["compute_s"], terms["hidden_s"]
        self.offset_s, self.half_offset_s = terms["offset_s"], terms["half_offset_s"]
        self.int8_offset_s = terms["int8_offset_s"]
        self.measured = sorted(set(self.measured) | {window_kind(window_ratio)})
        changed = first or choice.ratio != self.ratio
        if self._last_did == "changed" and choice.ratio != window_ratio:  # the check of a change left the choice it took
            self.abandoned = sorted(set(self.abandoned) | {label(window_ratio)})
        if changed:
            self.history = (self.history + [(self.step, label(choice.ratio))])[-HISTORY_KEPT:]
        self.decisions += 1
        self.changes += int(choice.ratio != self.ratio)
        self.ratio = choice.ratio
        link = m.link()
        self.last = {
            "step": self.step,
            "ratio": self.ratio,
            "reason": choice.reason,
            "measured_step_s": m.period_s,
            #: the density in force over the measured window, and its compute (step less wait and compression);
            #: ``compute_s`` is what the prediction uses: the last dense window's (a sparse window's compute holds
            #: compression costs beyond selection, so it is not taken as compute)
            "window_ratio": window_ratio,
            "window_compute_s": m.compute_s,
            "compute_s": self.compute_s,
            "bandwidth_bps": link.bandwidth_bps,
            #: what the latest fresh probes read (steady_link keeps ``bandwidth_bps`` within LINK_NOISE of it)
            "probed_bps": self._probed_bps,
            "latency_s": link.latency_s,
            "hidden_s": self.hidden_s,
            "offset_s": self.offset_s,
            "half_offset_s": self.half_offset_s,
            "int8_offset_s": self.int8_offset_s,
            "predicted_s": dict(choice.predicted_s),
            "to_target_s": dict(choice.to_target_s),
            "world_size": m.world_size,
            #: the step whose probes gave the link above (earlier than ``step`` at the check after a change)
            "probed_at": self._probed_at,
        }
        # the check of a change may take this decision's probes, unless this decision took an earlier one's
        self._recheck = changed and self._probed_at == self.step
        self._last_did = "changed" if changed else "kept"
        self.next_decision = self.step + (CHECK_STEPS if changed else self.config.auto_every)
        self.restart_window()
        return choice

    def restart_window(self) -> None:
        self._samples.clear()
        self._measure_from = self.step + SETTLE_STEPS
        self._started = None

    def withdraw_int8(self) -> None:
        """Stop offering INT8: the front end's gradients live where its grid's reference would be read on the host
        once per tensor and step (a GPU). An INT8 in force (a checkpoint's) goes dense until a decision after a
        fresh window."""
        self.int8 = False
        if self.ratio == INT8:
            self.ratio = None
            self.decide_soon()

    def decide_soon(self) -> None:
        """Measure again and decide after a fresh window (a load, or workers joined or left)."""
        self._recheck, self._last_did = False, ""  # the link (and who is on it) is probed afresh
        self._anchor = None
        self.next_decision = self.step + 1 + CHECK_STEPS
        self._samples.clear()
        self._measure_from = self.step + 1 + SETTLE_STEPS
        self._started = None

    def effective_config(self) -> Optional[TopKConfig]:
        """The configuration the compressor plans with now; None while dense, fp16 or int8 (see :meth:`held_plan`)."""
        if self.ratio in HELD:
            return None
        return config_at(self.config, float(self.ratio))  # type: ignore[arg-type]

    @property
    def holds_dense(self) -> bool:
        """Whether the choice in force sends every tensor dense (dense, fp16 or int8): then an update-mode optimizer
        runs the step as gradient mode (core.update_mode, "The gradient route")."""
        return self.ratio in HELD

    @property
    def held_route(self) -> str:
        """How a tensor goes while :meth:`effective_config` is None: DENSE_HALF while fp16 is in force, DENSE_INT8
        while int8 is, else DENSE."""
        return DENSE_HALF if self.ratio == HALF else DENSE_INT8 if self.ratio == INT8 else DENSE

    def held_plan(self, numel: int, is_floating: bool, grad_itemsize: int) -> Optional[TensorPlan]:
        """A tensor's plan while the choice in force sends every tensor dense (dense, fp16 or int8); None while a
        density is in force (then plan_tensor under :meth:`effective_config`)."""
        if self.ratio is None:
            return dense_plan(numel)
        if self.ratio == HALF:
            return half_plan(numel, is_floating, grad_itemsize)
        if self.ratio == INT8:
            return int8_plan(numel, is_floating, grad_itemsize)
        return None

    def summary_line(self) -> str:
        """The one log line of a decision that changed the density."""
        last = self.last
        predicted = last.get("predicted_s", {})
        target = last.get("to_target_s", {})
        # dense, fp16, the choice, and the density soonest to the target (what a dense choice turned down)
        sparse = [label(r) for r in DENSITIES if label(r) in target]
        soonest = min(sparse, key=lambda key: target[key]) if sparse else label(self.ratio)
        shown = ", ".join(
            f"{key} {predicted[key] * 1e3:.0f} ms" + (f" (x{target[key] / predicted[key]:.2f} steps)"
                                                     if key in target and predicted[key] and target[key] != predicted[key]
                                                     else "")
            for key in dict.fromkeys(("dense", HALF, INT8, label(self.ratio), soonest)) if key in predicted
            and (key != INT8 or self.int8))
        rate, probed = last.get("bandwidth_bps", 0.0), last.get("probed_bps", 0.0)
        read = f" (probed {probed / 1e6:.1f})" if probed and abs(probed - rate) > 0.01 * rate else ""
        return (f"horovod-topk auto: step {last.get('step')}: link {rate / 1e6:.1f} Mbit/s{read}, "
                f"latency {last.get('latency_s', 0) * 1e3:.2f} ms, compute {last.get('compute_s', 0) * 1e3:.0f} ms, "
                f"measured step {last.get('measured_step_s', 0) * 1e3:.0f} ms; predicted {shown}; "
                f"-> {label(self.ratio) if self.ratio in HELD else f'ratio {self.ratio:g}'} "
                f"({last.get('reason')}; budget "
                f"{self.config.budget:.0%}, sparsity_cost {self.config.sparsity_cost:g})")

    # ---- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"ratio": self.ratio, "step": self.step, "next_decision": self.next_decision,
                "compute_s": self.compute_s, "hidden_s": self.hidden_s, "offset_s": self.offset_s,
                "half_offset_s": self.half_offset_s, "int8_offset_s": self.int8_offset_s,
                "decisions": self.decisions, "changes": self.changes,
                "measured": list(self.measured), "abandoned": list(self.abandoned),
                "shared_scopes": list(self.shared_scopes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ratio = state.get("ratio")
        if ratio not in HELD and ratio not in DENSITIES:
            raise ValueError(f"horovod-topk: the saved auto density {ratio!r} is not one of {DENSITIES} (or "
                             f"{HALF!r}, {INT8!r}, or None: dense)")
        # fp16 or int8 saved where this front end does not send it (another framework's checkpoint): dense, and
        # decide again after a fresh window (below), as every load does when workers change
        fresh = (ratio == HALF and not self.half) or (ratio == INT8 and not self.int8)
        self.ratio = None if fresh else ratio
        self._probes, self._probed_at, self._recheck, self._last_did = None, -1, False, ""  # a job probes its own link
        self._anchor = None
        self.measured = sorted(str(k) for k in state.get("measured", []) if k in ("dense", HALF, INT8, "sparse"))
        self.abandoned = sorted(str(k) for k in state.get("abandoned", []) if k in {label(c) for c in CHOICES})
        self.shared_scopes = sorted(str(scope) for scope in state.get("shared_scopes", []))
        self.step = int(state.get("step", -1))
        self.next_decision = int(state.get("next_decision", self.step + 1))
        self.compute_s = float(state.get("compute_s", 0.0))
        self.hidden_s = float(state.get("hidden_s", 0.0))
        self.offset_s = float(state.get("offset_s", 0.0))
        self.half_offset_s = float(state.get("half_offset_s", 0.0))
        self.int8_offset_s = float(state.get("int8_offset_s", 0.0))
        self.decisions = int(state.get("decisions", 0))
        self.changes = int(state.get("changes", 0))
        self.restart_window()
        self._measure_from = self.step + 1 + SETTLE_STEPS
        if fresh:
            self.decide_soon()

    def stats(self) -> Dict[str, Any]:
        return {"ratio": self.ratio, "decisions": self.decisions, "changes": self.changes,
                "next_decision": self.next_decision, "last": dict(self.last),
                "history": [list(entry) for entry in self.history], "abandoned": list(self.abandoned)}
