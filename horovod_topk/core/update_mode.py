"""Update mode (``TopKConfig(target="update")``): what every rank decides the same way, framework-free.

Why compress the update and not the gradient: Adam divides each coordinate by the root of its own running mean
square. A coordinate that Top-K sends once every L steps arrives as a burst of L gradients; Adam moves it by about
sqrt(L) learning rates where dense moves it L, and no rescaling of the burst changes that ratio. Normalising
*before* sparsifying does: each rank steps the optimizer on its own gradient, and the error-feedback residual
collects the *update*, so a coordinate sent once every L steps carries L steps' worth of movement.

The second moment: averaging P updates that were each normalised by their own rank's second moment is not Adam on
the averaged gradient. With one second moment on every rank (``second_moment="shared"``) each rank's update is linear
in its own first moment, and the average of the ranks' updates is Adam's update on the averaged first moment. It is
built from every rank's squared gradient, one value per block of entries, so its collective carries ``numel /
block`` floats (0.4% of a dense float32 allreduce for blocks of 256). Measured (docs/update-mode.md), that
linearity is not what costs: a second moment made of the ranks' *own* squared gradients -- each rank's, or their
mean, per entry or per block -- trains alike, and only one made from the square of the *averaged* gradient (a dense
allreduce) trains better. What does cost is below, and the calibrated second moment that corrects it is the default
for Adam/AdamW, torch's and Keras's (``second_moment="auto"``); every other optimizer steps as each rank's own
(``"local"``).

Why each rank's own second moment makes steps too short, and the calibrated one: a rank's squared gradient holds its
own batch's noise, and averaging over P ranks removes (P - 1)/P of that noise from the gradient but not from the
rank's second moment. Where a tensor's gradient is mostly noise each rank's ``v`` is up to P times what dense Adam's
is, and its step up to sqrt(P) too short (the square-root scaling rule for Adam). ``second_moment="calibrated"``
feeds each rank's own per-entry second moment ``g**2 * share``, where ``share = ||mean_r g_r||**2 / mean_r
||g_r||**2`` is the fraction of the tensor's squared gradient that survives averaging: 1 for pure signal, 1/P for
pure noise. The share is estimated every step from a count sketch that every rank builds alike: entry ``r * M + b``
of the flat gradient goes to bucket ``b`` with the sign of row ``r``. A sketch is linear, so the sum of the ranks'
sketches is the sketch of the summed gradient, and its squared norm estimates the summed gradient's squared norm
without bias; each rank adds its own exact squared norm. One allreduce of ``M + 1`` floats per tensor carries both.
The rows' signs are drawn afresh every step (from the step and the tensor's position, the same on every rank): with
fixed signs a tensor's persistent gradient structure biases every step's estimate alike, and the simulator measured
that it keeps almost none of the gain (docs/update-mode.md). M = 64: the estimate's relative spread is about
sqrt(2 / M) = 18%; 256 buckets measured no better.

A rank whose gradient holds NaN/Inf would poison its own optimizer state (and then every rank's parameters through
the exchange): when any rank has one, every rank skips the step the same way AMP's GradScaler skips one, and
nothing -- parameters, optimizer state, residuals -- changes anywhere. The ranks learn it from one small allreduce
before the step (the framework's synchronize), and again from the shared second moment's own allreduce, whose
blocks turn non-finite with any non-finite entry.

The gradient route: with ``ratio="auto"`` holding dense or fp16 (core.autodensity.AutoDensity.holds_dense) nothing
is sparsified, so exchanging updates buys nothing and costs the overlap: an update exists only after backward, so
its collective waits for all of backward, where a gradient's leaves while backward still runs (measured on 4
workers over 100 Mbit/s: auto holding fp16 took 1.14x Horovod's fp16 time to the GRU's target in update mode, 0.99x
in gradient mode). Such a step therefore runs as gradient mode: each gradient's dense (or fp16, with its error
feedback) allreduce starts from backward, and every rank takes the same update from the averaged gradient and the
same optimizer state, which is Adam on the averaged gradient (the second moment from its square: the variant that
trained best, above) under the same update rule and state keys. The first such step makes the state the same on
every rank: each rank's own first moments (and the calibrated second moments, or a "local" optimizer's state
tensors) become their mean over the ranks, which is what the average of the ranks' updates was made of, and each
rank's update residual goes out -- the mean of the residuals is applied to the parameters. A later step back in
update mode starts from that common state; what fp16 left in the residuals then is gradient, and goes into each
rank's own gradient before its local step. Which optimizers' last step ran so is part of the auto state
(AutoDensity.shared_scopes), so a resumed job continues exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "MOMENTS_NAME",
    "NONFINITE_NAME",
    "with_nonfinite_count",
    "ADAM_FAMILY",
    "COMPUTED_SECOND_MOMENTS",
    "NORMALISING_OPTIMIZERS",
    "MomentsLayout",
    "moments_layout",
    "shared_moment_hyperparameters",
    "resolve_second_moment",
    "TAPE_REFUSAL",
    "TENSORFLOW_REFUSAL",
    "update_tensor_name",
    "share_name",
    "update_tensor_names",
    "RouteStep",
    "route_step",
    "block_count",
    "NOISE_SHARE_NAME",
    "SketchLayout",
    "sketch_layout",
    "sketch_salt",
    "SALT_MULTIPLIERS",
    "SALT_OFFSET",
    "SIGN_HASH_MULTIPLIERS",
    "MASK31",
    "row_sign",
    "KERAS_CALIBRATED",
    "resolve_keras_second_moment",
    "AUTO_UPDATE_OPTIMIZERS",
    "resolve_target",
]

#: The name of the non-finite agreement before the local step (a one-element allreduce of the ranks' counts).
NONFINITE_NAME = "topk.update.nonfinite"
#: The name of the shared second moment's allreduce (every tensor's block mean squares), before the local step.
MOMENTS_NAME = "topk.update.moments"
#: The name of the calibrated second moment's allreduce (every tensor's sketch and squared norm), before the step.
NOISE_SHARE_NAME = "topk.update.noise_share"


def with_nonfinite_count(name: str) -> str:
    """The name of the one allreduce that carries the ranks' non-finite counts together with the statistics
    otherwise reduced under ``name`` (MOMENTS_NAME, NOISE_SHARE_NAME): a step then waits for one collective before
    its local update, not two. Letters, digits, dots and underscores only (TensorFlow's scope names)."""
    return f"{NONFINITE_NAME}_and_{name.rsplit('.', 1)[-1]}"

#: Optimizer classes whose step horovod-topk computes under a shared second moment, by qualified name (module and
#: class: a third-party class called "AdamW" with other options is not torch's) -> whether weight decay is
#: decoupled by default (AdamW) or joins the gradient (Adam's L2 penalty; Adam's ``decoupled_weight_decay=True``
#: group option makes it AdamW).
ADAM_FAMILY: Dict[str, bool] = {"torch.optim.adam.Adam": False, "torch.optim.adamw.AdamW": True}

#: The second moments whose step horovod-topk computes (Adam/AdamW only), as against "local" (the user's optimizer).
COMPUTED_SECOND_MOMENTS = ("shared", "calibrated")

#: torch optimizers whose step is normalised by the gradient's own scale (not linear in it): under ``op=Sum`` the
#: sum of P local updates is P normalised steps, not the step of the summed gradient, so update mode refuses it.
NORMALISING_OPTIMIZERS = frozenset(ADAM_FAMILY) | {
    "torch.optim.adagrad.Adagrad", "torch.optim.rmsprop.RMSprop", "torch.optim.adadelta.Adadelta",
    "torch.optim.adamax.Adamax", "torch.optim.nadam.NAdam", "torch.optim.radam.RAdam",
    "torch.optim.sparse_adam.SparseAdam", "torch.optim.Adafactor",
}

#: Why gradient tapes cannot run update mode, and what to use instead.
TAPE_REFUSAL = (
    "horovod-topk: TopKEF(target='update') compresses the optimizer's update, and a gradient tape only returns "
    "gradients: it never sees the step. Use target='gradient' with the tape, or wrap the optimizer instead "
    "(hvd.DistributedOptimizer for Keras 2, horovod_topk.tensorflow.keras3.DistributedOptimizer for Keras 3)."
)

#: What a TensorFlow path that reduces gradients says to update mode: only the Keras optimizer wrappers see the step
#: (TensorFlow 1's ``tf.compat.v1.train.Optimizer`` under ``hvd.DistributedOptimizer``, or an ``hvd.allreduce`` of a
#: gradient by hand, hand over gradients only); a refusal instead of gradient mode under another name.
TENSORFLOW_REFUSAL = (
    "horovod-topk: TopKEF(target='update') in TensorFlow runs through a Keras optimizer wrapped by "
    "hvd.DistributedOptimizer or horovod.tensorflow.keras.DistributedOptimizer (Keras 2 and 3); this path hands "
    "over gradients only. Use target='gradient' here (the default)."
)


def update_tensor_name(name: str) -> str:
    """The registry key of a parameter's update residual: apart from gradient residuals of the same parameter, so a
    checkpoint of one mode never feeds the other's residual (they hold different quantities)."""
    return "update." + name


def share_name(name: str, index: int) -> str:
    """The collective that averages the ``index``-th of parameter ``name``'s own state tensors (its update residual
    the last) on entering the gradient route: named from the parameter, the same on every rank."""
    return f"topk.update.share.{index}.{name}"


class RouteStep:
    """What one step of an update-mode optimizer does under ratio="auto" (the gradient route, above): the codes a
    traced step branches on (TensorFlow), from :func:`route_step`."""

    #: Gradients held on their ranks, updates exchanged (auto holds a density).
    LOCAL = 0
    #: Gradients exchanged, the same update from the averaged gradient on every rank (auto holds dense or fp16).
    ROUTE = 1
    #: The first step of the route: every rank's own state becomes the ranks' mean, and so does the update
    #: residual, which is applied to the parameters; then as ROUTE.
    ENTER = 2
    #: The first step back in update mode: what fp16 left in the residuals is gradient, and joins each rank's own.
    LEAVE = 3
    #: ROUTE after an elastic reset (core.checkpoint.sync_after_reset): the own state averaged once more.
    RESYNC = 4


def route_step(auto: Any, scope: str) -> int:
    """The RouteStep of optimizer ``scope``'s step under ``auto`` (a core.autodensity.AutoDensity whose choice for
    the step is in force), ``auto``'s shared and resync scopes updated for it. The same on every rank: the choice
    and the scopes are (the scopes are saved with auto's state)."""
    shared = scope in auto.shared_scopes
    resync = scope in auto.resync_scopes
    if resync:
        auto.resync_scopes.remove(scope)
    if auto.holds_dense:
        if not shared:  # entering averages the own state anyway
            auto.shared_scopes.append(scope)
            return RouteStep.ENTER
        return RouteStep.RESYNC if resync else RouteStep.ROUTE
    if shared:  # update mode keeps each rank's own state: nothing to resync
        auto.shared_scopes.remove(scope)
        return RouteStep.LEAVE
    return RouteStep.LOCAL


def update_tensor_names(names: Sequence[str]) -> List[str]:
    """The registry keys of the update residuals of parameters called ``names`` (in the optimizer's order): a
    parameter's name where it is unique, with ``.dup<i>`` (its position among those so named) after a repeated one,
    so that two models' ``dense/kernel`` keep apart and the keys stay the same from run to run. The keys name
    collectives, so they keep to the characters TensorFlow allows in op names."""
    seen: Dict[str, int] = {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
    taken: Dict[str, int] = {}
    keys: List[str] = []
    for name in names:
        if seen[name] == 1:
            keys.append(update_tensor_name(name))
            continue
        position = taken.get(name, 0)
        taken[name] = position + 1
        keys.append(update_tensor_name(f"{name}.dup{position}"))
    return keys


@dataclass(frozen=True)
class MomentsLayout:
    """Where each tensor's block values sit in the flat buffer of the shared second moment's allreduce."""

    #: (offset, count) per tensor, in the order given
    spans: Tuple[Tuple[int, int], ...]
    #: the buffer's length
    numel: int


def block_count(numel: int, block: int) -> int:
    """How many shared second-moment values a tensor of ``numel`` entries has (the last block may be short)."""
    return -(-int(numel) // block)


def moments_layout(numels: Sequence[int], block: int) -> MomentsLayout:
    """The flat buffer of one step's shared second moment: ceil(numel / block) values per tensor, in order. A
    non-finite gradient entry makes its block's value non-finite, so the summed buffer also says whether any rank's
    gradient was."""
    spans: List[Tuple[int, int]] = []
    offset = 0
    for numel in numels:
        count = block_count(numel, block)
        spans.append((offset, count))
        offset += count
    return MomentsLayout(tuple(spans), offset)


def shared_moment_hyperparameters(
    class_name: str, group: Dict[str, object], setting: str = "shared"
) -> Tuple[float, float, float, float, float, bool]:
    """(lr, beta1, beta2, eps, weight_decay, decoupled) of one parameter group of an Adam-family optimizer (class by
    qualified name), read every step (a schedule changes lr); a ValueError names what the second moment ``setting``
    ("shared" or "calibrated": both compute the step) cannot reproduce."""
    if class_name not in ADAM_FAMILY:
        short = class_name.rsplit(".", 1)[-1]
        raise ValueError(
            f"horovod-topk: TopKEF(target='update', second_moment={setting!r}) computes torch.optim.Adam/AdamW's step "
            f"itself and cannot do {class_name}'s; use torch.optim.Adam or AdamW, or second_moment='local' (each "
            f"rank steps its own {short}; averaging their updates costs convergence as the number of ranks grows)."
        )
    short = class_name.rsplit(".", 1)[-1]
    for option in ("amsgrad", "maximize", "differentiable"):
        if bool(group.get(option, False)):
            raise ValueError(f"horovod-topk: {short}({option}=True) is not supported with target='update', "
                             f"second_moment={setting!r}; use second_moment='local' for it")
    lr = group["lr"]
    if not isinstance(lr, (int, float)):  # a tensor lr (capturable/fused setups): read as a number
        lr = float(lr)  # type: ignore[arg-type]
    betas = group["betas"]
    beta1, beta2 = float(betas[0]), float(betas[1])  # type: ignore[index]
    eps = float(group["eps"])  # type: ignore[arg-type]
    weight_decay = float(group.get("weight_decay", 0.0))  # type: ignore[arg-type]
    decoupled = bool(group.get("decoupled_weight_decay", ADAM_FAMILY[class_name]))
    return float(lr), beta1, beta2, eps, weight_decay, decoupled


def resolve_second_moment(setting: str, class_name: str, groups: Sequence[Dict[str, object]]) -> str:
    """TopKConfig.second_moment for the user's optimizer: "local" as it is; "shared" and "calibrated" after checking
    that horovod-topk can compute the optimizer's step (torch's Adam/AdamW without amsgrad, maximize or
    differentiable), refusing by name what it cannot; "auto": "calibrated" where it can, "local" elsewhere (an
    optimizer it cannot compute still trains, with each rank's own second moment)."""
    if setting == "auto":
        try:
            for group in groups:
                shared_moment_hyperparameters(class_name, group, "calibrated")
        except ValueError:
            return "local"
        return "calibrated"
    if setting in COMPUTED_SECOND_MOMENTS:
        for group in groups:
            shared_moment_hyperparameters(class_name, group, setting)
    return setting


@dataclass(frozen=True)
class SketchLayout:
    """The flat buffer of one step's noise-share allreduce (second_moment="calibrated"): per tensor, ``width``
    sketch buckets and then its squared norm, in the order given."""

    #: buckets per tensor
    width: int
    #: the tensors' count
    tensors: int

    @property
    def numel(self) -> int:
        """The buffer's length: ``width + 1`` floats per tensor."""
        return self.tensors * (self.width + 1)

    def rows(self, numel: int) -> int:
        """Rows of ``width`` entries that a tensor of ``numel`` entries spans (the last one padded with zeros)."""
        return max(1, -(-int(numel) // self.width))


def sketch_layout(tensors: int, width: int) -> SketchLayout:
    """The noise-share buffer of ``tensors`` tensors with sketches of ``width`` buckets."""
    if width < 1:
        raise ValueError(f"a sketch needs at least one bucket, got {width}")
    return SketchLayout(width=int(width), tensors=int(tensors))


#: The salt's splitmix64 constants (sketch_salt): every framework computes the same 64-bit arithmetic.
SALT_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
SALT_OFFSET = 0x94D049BB133111EB
#: Odd 31-bit multipliers of the rows' sign hash (row_sign): products with 31-bit values stay inside int64, so every
#: framework's integer tensors compute it exactly.
SIGN_HASH_MULTIPLIERS = (0x5BD1E995 & 0x7FFFFFFF, 0x27D4EB2F, 0x165667B1)
MASK31 = 2**31 - 1
_MASK64 = 2**64 - 1


def sketch_salt(step: int, position: int) -> int:
    """The seed of the rows' signs of the tensor at ``position`` (in the ranks' common order) at ``step``: the same
    on every rank, different for every step and tensor, a non-negative 31-bit integer (exact in every framework's
    integer arithmetic). A splitmix-style mix of the two, so that neighbouring steps share no pattern."""
    first, second, third = SALT_MULTIPLIERS
    x = (int(step) * first + int(position) * second + SALT_OFFSET) & _MASK64
    x = ((x ^ (x >> 30)) * second) & _MASK64
    x = ((x ^ (x >> 27)) * third) & _MASK64
    return (x ^ (x >> 31)) & MASK31


def row_sign(row: int, salt: int) -> int:
    """The sign (+1 or -1) of sketch row ``row`` under ``salt``: the definition each framework vectorises over a
    tensor's rows (torch.update_rule.row_signs, tensorflow.noise_share.row_signs), so the two draw the same signs."""
    first, *rest = SIGN_HASH_MULTIPLIERS
    x = (int(row) * first + (int(salt) & MASK31)) & MASK31
    for multiplier in rest:
        x = ((x ^ (x >> 15)) * multiplier) & MASK31
    x ^= x >> 13
    return 1 if (x >> 7) & 1 else -1


#: Keras optimizer classes (qualified names; Keras 3 and Keras 2's tf_keras) whose second moment horovod-topk can
#: calibrate. It does not compute their step: before it, it adds ``(1 - beta_2) / beta_2 * (share - 1) * g**2`` to
#: their own velocity, which their update ``v = beta_2 * v + (1 - beta_2) * g**2`` (linear in v) turns into
#: ``beta_2 * v + (1 - beta_2) * share * g**2`` -- the calibrated second moment -- whatever else their step does
#: (amsgrad's maximum, AdamW's decay, clipping before it, a learning-rate schedule).
KERAS_CALIBRATED = frozenset({
    "keras.src.optimizers.adam.Adam", "keras.src.optimizers.adamw.AdamW",
    "tf_keras.src.optimizers.adam.Adam", "tf_keras.src.optimizers.adamw.AdamW",
})


def resolve_keras_second_moment(setting: str, class_name: str, beta_2: object, accumulation_steps: object) -> str:
    """TopKConfig.second_moment for a Keras optimizer (class by qualified name): "local" as it is; "calibrated"
    after checking that the class is one of KERAS_CALIBRATED, its ``beta_2`` a number in (0, 1) and it does not
    accumulate gradients over steps (its velocity then moves on another step than the one the share was measured
    on); "auto": "calibrated" where it can, "local" elsewhere. "shared" computes torch's Adam: refused by name."""
    if setting == "shared":
        raise ValueError("horovod-topk: TopKEF(target='update', second_moment='shared') computes torch's Adam and is "
                         "PyTorch's; with Keras use second_moment='calibrated' (Adam/AdamW) or 'local'")
    if setting not in ("calibrated", "auto"):
        return setting
    short = class_name.rsplit(".", 1)[-1]
    if class_name not in KERAS_CALIBRATED:
        reason = (f"calibrates the velocity of Keras's Adam/AdamW and cannot do {class_name}'s (a loss-scale "
                  f"optimizer or a legacy optimizer included)")
    elif not isinstance(beta_2, (int, float)) or not 0.0 < float(beta_2) < 1.0:
        reason = f"needs {short}'s beta_2 as a number in (0, 1), got {beta_2!r}"
    elif accumulation_steps not in (None, 0, 1):
        reason = f"cannot follow {short}(gradient_accumulation_steps={accumulation_steps!r})"
    else:
        return "calibrated"
    if setting == "auto":
        return "local"
    raise ValueError(f"horovod-topk: TopKEF(target='update', second_moment='calibrated') {reason}; use "
                     f"second_moment='local' (each rank steps its own optimizer; averaging their updates costs "
                     f"convergence as the number of ranks grows)")


#: The optimizers (qualified class names, torch and Keras) for which ``target="auto"`` exchanges updates: the Adam
#: family, where update mode trained better than gradient mode at the same bytes on both measured language models
#: (the transformer +10.8% over dense against +21.1%, the GRU +9.4% against +15.9%, 400 steps, 2 workers) and
#: where gradient mode's error feedback is known to fail (docs/update-mode.md). Every other optimizer (SGD above
#: all: averaging SGD's updates is averaging its gradients, and update mode would only lose overlap) keeps the
#: gradient.
AUTO_UPDATE_OPTIMIZERS = frozenset(ADAM_FAMILY) | KERAS_CALIBRATED | frozenset({
    "tf_keras.src.optimizers.legacy.adam.Adam", "keras.src.optimizers.legacy.adam.Adam",
})


def resolve_target(config: object, class_name: Optional[str], blockers: Sequence[str] = ()) -> str:
    """TopKConfig.target for one optimizer (class by qualified name; None where the front end never sees it: a
    gradient tape, a hand allreduce): "gradient" or "update". "auto" is "update" for AUTO_UPDATE_OPTIMIZERS unless
    the configuration asks for what only gradient mode does (momentum correction, spike_guard) or the front end
    names ``blockers`` (what its update mode cannot do for this optimizer: it then keeps gradient mode rather than
    refusing what the user did not ask for)."""
    target = getattr(config, "target")
    if target != "auto":
        return str(target)
    if class_name not in AUTO_UPDATE_OPTIMIZERS or blockers:
        return "gradient"
    if getattr(config, "momentum", 0) or getattr(config, "spike_guard", None) is not None:
        return "gradient"
    return "update"
