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
allreduce) trains better. So each rank's own optimizer (``second_moment="local"``) is the default.

A rank whose gradient holds NaN/Inf would poison its own optimizer state (and then every rank's parameters through
the exchange): when any rank has one, every rank skips the step the same way AMP's GradScaler skips one, and
nothing -- parameters, optimizer state, residuals -- changes anywhere. The ranks learn it from one small allreduce
before the step (the framework's synchronize), and again from the shared second moment's own allreduce, whose
blocks turn non-finite with any non-finite entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

__all__ = [
    "MOMENTS_NAME",
    "NONFINITE_NAME",
    "ADAM_FAMILY",
    "NORMALISING_OPTIMIZERS",
    "MomentsLayout",
    "moments_layout",
    "shared_moment_hyperparameters",
    "resolve_second_moment",
    "TAPE_REFUSAL",
    "TENSORFLOW_REFUSAL",
    "update_tensor_name",
    "update_tensor_names",
    "block_count",
]

#: The name of the non-finite agreement before the local step (a one-element allreduce of the ranks' counts).
NONFINITE_NAME = "topk.update.nonfinite"
#: The name of the shared second moment's allreduce (every tensor's block mean squares), before the local step.
MOMENTS_NAME = "topk.update.moments"

#: Optimizer classes whose step horovod-topk computes under a shared second moment, by qualified name (module and
#: class: a third-party class called "AdamW" with other options is not torch's) -> whether weight decay is
#: decoupled by default (AdamW) or joins the gradient (Adam's L2 penalty; Adam's ``decoupled_weight_decay=True``
#: group option makes it AdamW).
ADAM_FAMILY: Dict[str, bool] = {"torch.optim.adam.Adam": False, "torch.optim.adamw.AdamW": True}

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
    class_name: str, group: Dict[str, object]
) -> Tuple[float, float, float, float, float, bool]:
    """(lr, beta1, beta2, eps, weight_decay, decoupled) of one parameter group of an Adam-family optimizer (class by
    qualified name), read every step (a schedule changes lr); a ValueError names what the shared second moment
    cannot reproduce."""
    if class_name not in ADAM_FAMILY:
        short = class_name.rsplit(".", 1)[-1]
        raise ValueError(
            f"horovod-topk: TopKEF(target='update', second_moment='shared') computes torch.optim.Adam/AdamW's step "
            f"itself and cannot do {class_name}'s; use torch.optim.Adam or AdamW, or second_moment='local' (each "
            f"rank steps its own {short}; averaging their updates costs convergence as the number of ranks grows)."
        )
    short = class_name.rsplit(".", 1)[-1]
    for option in ("amsgrad", "maximize", "differentiable"):
        if bool(group.get(option, False)):
            raise ValueError(f"horovod-topk: {short}({option}=True) is not supported with target='update', "
                             f"second_moment='shared'; use second_moment='local' for it")
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
    """TopKConfig.second_moment for the user's optimizer: "local" as it is; "shared" after checking that horovod-topk
    can compute the optimizer's step (torch's Adam/AdamW without amsgrad, maximize or differentiable), refusing by
    name what it cannot."""
    if setting == "shared":
        for group in groups:
            shared_moment_hyperparameters(class_name, group)
    return setting
