"""What each DDP worker runs for update mode's tests (tests/ddp/test_ddp_update_mode.py). Module-level functions,
so that spawned workers can import them; each takes (rank, world_size, ...) and returns plain values."""
# no "from __future__ import annotations": DDP checks a hook's annotations as objects

import copy
from typing import Any, Dict

import torch
import torch.nn.functional as F

from horovod_topk.torch.ddp import TopKEFState, update_mode_optimizer

from .workers import all_equal_across_ranks, batch, ddp_of, flat_params, make_model, poison_on, train_step

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


def _training(rank: int, options: Dict[str, Any], make_opt=None, bucket_cap_mb: float = 0.3):
    model = make_model()
    state = TopKEFState(named_parameters=model.named_parameters(), target="update", **options)
    ddp = ddp_of(model, state, bucket_cap_mb=bucket_cap_mb)
    opt = make_opt(model) if make_opt is not None else torch.optim.Adam(model.parameters(), LR, betas=BETAS, eps=EPS)
    return model, state, ddp, update_mode_optimizer(opt, state)


def sgd_parity(rank: int, world_size: int) -> Dict[str, Any]:
    """SGD without momentum at ratio 1: averaging the ranks' updates lr * g_r is averaging their gradients, so
    update mode trains as DDP's own allreduce does (up to rounding)."""
    plain_model = make_model()
    plain = ddp_of(plain_model, None, bucket_cap_mb=0.3)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    model, state, ddp, opt = _training(rank, dict(ratio=1.0, min_numel=0, dense_fallback=False),
                                       lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    for step in range(4):
        train_step(plain, plain_opt, rank, step)
        train_step(ddp, opt, rank, step)
    return {"plain": flat_params(plain_model), "ours": flat_params(model), "second_moment":
            opt.topk_update_step.second_moment, "same": all_equal_across_ranks(flat_params(model))}


def logged_step(model, state, ddp, opt, rank: int, step: int, dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """One training step in update mode (Adam at LR, BETAS, EPS) and, per compressed update, its residual before and
    after, this rank's local update recomputed from the Adam state its step left (lr * m_hat / (sqrt(v_hat) +
    eps)), and what every rank applied (the parameter before minus after)."""
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    old = {n: r.residual.double().clone() for n, r in state.registry if r.residual is not None}
    train_step(ddp, opt, rank, step, dtype)
    entry: Dict[str, Any] = {"applied": {}, "local": {}, "old": {}, "new": {}}
    for name, p in model.named_parameters():
        key = "update." + name
        record = state.registry.records.get(key)
        if record is None or (record.residual is None and key not in old):
            continue
        s = opt.state[p]
        if "exp_avg" in s:  # Adam's keys: each rank's own moments ("local", "calibrated")
            t = int(s["step"])
            m_hat = s["exp_avg"].double() / (1 - BETAS[0] ** t)
            v_hat = s["exp_avg_sq"].double() / (1 - BETAS[1] ** t)
            entry["local"][name] = (LR * m_hat / (v_hat.sqrt() + EPS)).reshape(-1)
        entry["applied"][name] = (before[name] - p.detach().double()).reshape(-1)
        entry["old"][name] = old.get(key, torch.zeros(p.numel(), dtype=torch.float64)).reshape(-1)
        # None: sent whole on a dense step and dropped (torch.state._send_leftovers on the CPU): zeros
        entry["new"][name] = (record.residual.double().reshape(-1).clone() if record.residual is not None
                              else torch.zeros(p.numel(), dtype=torch.float64))
    return entry


def invariant(rank: int, world_size: int, exchange: str, second_moment: str) -> Dict[str, Any]:
    """4 steps of Adam at ratio 0.05: per step, each compressed update's residual before and after, this rank's
    local update recomputed from the Adam state its step left (lr * m_hat / (sqrt(v_hat) + eps)), and what every
    rank applied."""
    model, state, ddp, opt = _training(rank, dict(ratio=0.05, min_numel=64, exchange=exchange,
                                                  second_moment=second_moment, bucket_bytes=200_000))
    log = [logged_step(model, state, ddp, opt, rank, step) for step in range(4)]
    key = "exp_avg_sq" if second_moment != "shared" else "shared_exp_avg_sq"
    own = torch.cat([opt.state[p][key].reshape(-1) for p in model.parameters()])
    return {"log": log, "same": all_equal_across_ranks(flat_params(model)), "own_same": all_equal_across_ranks(own),
            "stats": state.stats(), "second_moment": opt.topk_update_step.second_moment}


def nonfinite(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1's gradient of c.weight holds a NaN on step 1: after backward every rank's gradients in that DDP bucket
    are NaN (so a GradScaler, which looks for any, skips on every rank), and the step changes nothing anywhere;
    step 2 trains on."""
    model, state, ddp, opt = _training(rank, dict(ratio=0.05, min_numel=64))
    step_box = poison_on(model, rank, 1)
    out: Dict[str, Any] = {}
    for step in range(3):
        step_box[0] = step
        if step == 1:
            params = flat_params(model)
            residuals = {n: r.residual.clone() for n, r in state.registry if r.residual is not None}
            moments = copy.deepcopy(opt.state_dict()["state"])
        opt.zero_grad()
        x, y = batch(rank, step)
        F.cross_entropy(ddp(x), y).backward()
        if step == 1:
            out["nan_params"] = sorted(n for n, p in model.named_parameters() if bool(torch.isnan(p.grad).all()))
        opt.step()
        if step == 1:
            out["params_kept"] = torch.equal(params, flat_params(model))
            out["residuals_kept"] = all(torch.equal(residuals[n], r.residual) for n, r in state.registry
                                        if r.residual is not None) and bool(residuals)
            after = opt.state_dict()["state"]
            out["moments_kept"] = all(torch.equal(moments[i][k], after[i][k]) for i in moments for k in moments[i])
    final = flat_params(model)
    out.update({"finite": bool(torch.isfinite(final).all()), "moved": not torch.equal(params, final),
                "same": all_equal_across_ranks(final), "skipped": opt.topk_update_step.skipped_steps})
    return out


def resume(rank: int, world_size: int) -> Dict[str, Any]:
    """6 steps straight against 3 steps, a checkpoint per rank (model, this rank's optimizer state, the hook's
    state), fresh objects that load it, and 3 more steps."""
    options = dict(ratio=0.05, min_numel=64)
    model, state, ddp, opt = _training(rank, options)
    for step in range(6):
        train_step(ddp, opt, rank, step)
    straight = flat_params(model)
    model, state, ddp, opt = _training(rank, options)
    for step in range(3):
        train_step(ddp, opt, rank, step)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "topk": state.state_dict()})
    model, state, ddp, opt = _training(rank, options)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["topk"])
    for step in range(3, 6):
        train_step(ddp, opt, rank, step)
    return {"straight": straight, "resumed": flat_params(model), "names": sorted(saved["topk"]["tensors"]),
            "same": all_equal_across_ranks(flat_params(model))}


def default_target(rank: int, world_size: int) -> Dict[str, Any]:
    """TopKEFState() (target="auto"): update_mode_optimizer puts an AdamW in update mode and returns an SGD as it
    is (the hook keeps averaging its gradients); wrapping after the hook averaged gradients is refused."""
    out: Dict[str, Any] = {}
    for kind in ("adamw", "sgd"):
        model = make_model()
        state = TopKEFState(ratio=0.05, min_numel=64, named_parameters=model.named_parameters())
        ddp = ddp_of(model, state, bucket_cap_mb=0.3)
        base = (torch.optim.AdamW(model.parameters(), lr=1e-2) if kind == "adamw"
                else torch.optim.SGD(model.parameters(), lr=0.1))
        opt = update_mode_optimizer(base, state)
        for step in range(2):
            train_step(ddp, opt, rank, step)
        out[kind] = {"wrapped": hasattr(opt, "topk_update_step"), "target": state.target,
                     "keys": sorted(name for name, _ in state.registry),
                     "same": all_equal_across_ranks(flat_params(model))}
        if kind == "sgd":  # the hook has averaged gradients: an Adam wrapped now would switch modes mid-run
            try:
                update_mode_optimizer(torch.optim.Adam(model.parameters()), state)
                out["late"] = "no error"
            except ValueError as error:
                out["late"] = str(error)
    return out
