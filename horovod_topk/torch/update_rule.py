"""The math of update mode (core.config ``target="update"``): each rank's local Adam update under a second moment
that every rank shares.

Why a shared second moment: averaging P updates that were each normalised by their own rank's second moment is not
Adam on the averaged gradient (it costs convergence even uncompressed, more as P grows). With one second moment
``v`` on every rank, each rank's update ``lr * m_i / (sqrt(v) + eps)`` is linear in its own first moment ``m_i``, so
the average of the P updates is exactly the update of Adam whose first moment is the average of the ranks' -- which
is Adam on the averaged gradient, since ``m`` is linear in the gradients.

Why blocks: the shared ``v`` must be built from every rank's gradient, so it costs a collective. A per-coordinate
``v`` would cost a dense allreduce; one value per block of ``block`` consecutive entries (the mean of the ranks'
squared gradients over the block, as Adam-mini shares one second moment per block) costs ``1/block`` of one.
The ranks contribute their *own* squared gradients: the mean over ranks of ``g_i**2`` is what every rank can
form without the averaged gradient.

Pure functions of tensors: no collectives and no state here (torch.update_mode holds the state and the calls).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..core.update_mode import MASK31, SIGN_HASH_MULTIPLIERS, block_count

__all__ = ["block_means", "block_mean_squares", "expand_blocks", "scale_by_blocks", "block_count", "adam_update",
           "update_second_moment", "row_signs", "sketch_into", "noise_shares"]


def _split(flat: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole blocks of ``flat`` as a (blocks, block) view, and the short tail (possibly empty): no copies."""
    whole = flat.numel() // block * block
    return flat[:whole].view(-1, block), flat[whole:]


def _per_block(flat: torch.Tensor, block: int, reduce: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """``reduce`` (a per-row reduction) over each block of ``flat``, the tail as one more block."""
    rows, tail = _split(flat, block)
    parts = [reduce(rows, 1)] if rows.numel() else []
    if tail.numel():
        parts.append(reduce(tail.view(1, -1), 1))
    if not parts:  # a tensor of no entries has no blocks
        return flat.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def block_means(values: torch.Tensor, block: int) -> torch.Tensor:
    """The mean of ``values`` over each block of ``block`` consecutive entries (float32; the last block is the mean
    of the entries it has)."""
    return _per_block(values.reshape(-1).float(), block, lambda rows, dim: rows.mean(dim))


def block_mean_squares(grad: torch.Tensor, block: int) -> torch.Tensor:
    """The mean of ``grad**2`` over each block of ``block`` consecutive entries: what a rank contributes to the
    shared second moment. One pass in float32, no temporary of the gradient's size for a contiguous gradient. A
    NaN/Inf entry makes its block's value non-finite: the caller decides what that means."""
    def mean_square(rows: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.linalg.vector_norm(rows, dim=dim, dtype=torch.float32).square_().div_(rows.shape[dim])

    return _per_block(grad.reshape(-1), block, mean_square)


def expand_blocks(values: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """One value per block back to one per entry."""
    return values.repeat_interleave(block)[:numel]


def scale_by_blocks(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """A new float32 tensor shaped as ``values``: each block of ``block`` entries times its scale (one pass)."""
    out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    rows, tail = _split(values.reshape(-1), block)
    out_rows, out_tail = _split(out.view(-1), block)
    if rows.numel():
        torch.mul(rows, scales[: rows.shape[0], None], out=out_rows)
    if tail.numel():
        torch.mul(tail, scales[-1], out=out_tail)
    return out


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    block: Optional[int] = None,
) -> torch.Tensor:
    """The local update ``param_before - param_after`` of one Adam (``decoupled=False``) or AdamW step, as
    ``torch.optim.Adam``/``AdamW`` compute it, with the first moment ``exp_avg`` (this rank's, float32, updated in
    place) and a second moment ``exp_avg_sq`` that the caller has already updated with the shared signal (one value
    per entry, or per block of ``block`` entries). ``step`` counts from 1. ``param`` is not changed.

    Returns the update in float32 (the residual's precision), shaped as ``param``. With blocks, the per-entry work
    is three passes (first moment, scaled copy, decay): the divisor is computed per block.
    """
    g = grad if grad.dtype == torch.float32 else grad.float()
    if weight_decay and not decoupled:  # Adam's L2 penalty joins the gradient, hence the first moment
        g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    if block is None:
        update = exp_avg / (exp_avg_sq / bias2).sqrt_().add_(eps) * (lr / bias1)
    else:
        scales = (exp_avg_sq / bias2).sqrt_().add_(eps).reciprocal_().mul_(lr / bias1)
        update = scale_by_blocks(exp_avg, scales, block)
    if weight_decay and decoupled:  # AdamW's decay acts on the parameter, the same on every rank
        update.add_(param, alpha=lr * weight_decay)
    return update


def update_second_moment(exp_avg_sq: torch.Tensor, signal: torch.Tensor, beta2: float) -> None:
    """``exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * signal`` in place (signal: the ranks' shared squares)."""
    exp_avg_sq.mul_(beta2).add_(signal, alpha=1.0 - beta2)


def row_signs(rows: int, salt: int, device: torch.device) -> torch.Tensor:
    """``rows`` signs (float32 +-1) drawn from ``salt`` (core.update_mode.sketch_salt) by core.update_mode.row_sign's
    integer hash of the row index, computed where the gradient lives: the same on every rank and every device
    (integer arithmetic in 31-bit steps inside int64, exact everywhere), and no generator state to checkpoint or
    keep in step."""
    x = torch.arange(rows, dtype=torch.int64, device=device)
    x = (x * SIGN_HASH_MULTIPLIERS[0] + (salt & MASK31)) & MASK31
    for multiplier in SIGN_HASH_MULTIPLIERS[1:]:
        x = ((x ^ (x >> 15)) * multiplier) & MASK31
    x = x ^ (x >> 13)
    return ((x >> 7) & 1).to(torch.float32).mul_(2.0).sub_(1.0)


def sketch_into(out: torch.Tensor, grad: torch.Tensor, salt: int) -> None:
    """Write one rank's contribution to a tensor's noise share into ``out`` (``width + 1`` float32 values): the
    count sketch of ``grad`` (entry ``r * width + b`` into bucket ``b`` with row ``r``'s sign; one matrix-vector
    product over the whole rows, the short last row on its own) and then ``||grad||**2``. A NaN/Inf entry makes
    both non-finite: the caller decides what that means."""
    width = out.numel() - 1
    flat = grad.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    whole = flat.numel() // width
    tail = flat[whole * width:]
    signs = row_signs(whole + (1 if tail.numel() else 0), salt, flat.device)
    sketch = out[:width]
    if whole:
        torch.mv(flat[: whole * width].view(whole, width).t(), signs[:whole], out=sketch)
    else:
        sketch.zero_()
    if tail.numel():
        sketch[: tail.numel()].add_(tail * signs[-1])
    out[width] = torch.linalg.vector_norm(flat, dtype=torch.float32).square()


def noise_shares(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    """Each tensor's noise share from the ranks' summed contributions (a ``(tensors, width + 1)`` float32 tensor,
    rows written by sketch_into and summed over ranks): ``||sum_r sketch_r||**2 / (P * sum_r ||g_r||**2)`` estimates
    ``||mean_r g_r||**2 / mean_r ||g_r||**2``, clamped to [1/P, 1] -- the range of the true share unless the ranks'
    gradients oppose each other, and the bound an estimate's spread must not cross (a share near 0 would make the
    second moment vanish and the step explode). A tensor whose gradient is zero on every rank gets 1. On the
    gradient's device, without a host sync."""
    width = summed.shape[1] - 1
    sketched = summed[:, :width].square().sum(dim=1)
    norms = summed[:, width] * float(world_size)
    share = torch.where(norms > 0, sketched / norms.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(norms))
    return share.clamp_(1.0 / world_size, 1.0)
