"""What each DDP worker runs for ratio="auto" (tests/ddp/harness.py starts them): the real hook, collectives and
planning; where a test scripts the link, torch.ddp_auto.measure is replaced in the worker by tests/auto_links.py's
measurements for each step."""
# no "from __future__ import annotations": DDP checks a hook's annotations as objects

import copy
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_topk.torch import ddp_auto
from horovod_topk.torch.ddp import TopKEFState, update_mode_optimizer
from tests import auto_links
from tests.auto_links import CHECK_STEPS, FIRST_DECISION, FOURTH_DECISION, SECOND_DECISION, THIRD_DECISION

from .update_workers import BETAS, EPS, LR, logged_step
from .workers import all_equal_across_ranks, batch, ddp_of, flat_params, make_model, recording_hook, train_step

#: Scripts of the link by name (a spawned worker receives names, not closures): measurement by decision step.
SCRIPTS: Dict[str, Callable[[int], Callable[[int], Any]]] = {
    # sparse from the first decision, back to dense at the second (sparse measured slower), sparse again after
    "changes": lambda step: {FIRST_DECISION: auto_links.slow_link,
                             SECOND_DECISION: auto_links.sparse_slower_than_dense}.get(step,
                                                                                       auto_links.much_slower_link),
    "slow_then_sparse_slower": lambda step: (auto_links.slow_link if step < SECOND_DECISION
                                             else auto_links.sparse_slower_than_dense),
    # fp16 from the first decision (dense's communication half hidden), dense at the second (a fast link), then the
    # 20x slower link (fp16 again for this model)
    "half": lambda step: {FIRST_DECISION: auto_links.half_link,
                          SECOND_DECISION: auto_links.fast_link}.get(step, auto_links.much_slower_link),
    # int8 from the first decision (a quarter of dense's bytes hides), dense at the second, int8 again after
    "int8": lambda step: auto_links.fast_link if step == SECOND_DECISION else auto_links.int8_link,
}


def offer_held(state: TopKEFState, script: Optional[str]) -> None:
    """fp16 is among auto's choices only under the "half" script and int8 only under "int8": the others script
    dense <-> sparse sequences, which a link where fp16 or int8 is soonest would turn into those instead of dense."""
    state.auto.half = script == "half"
    state.auto.int8 = script == "int8"


def scripted(name: Optional[str], rank: int = 0) -> List[int]:
    """Replace ddp_auto.measure by the script ``name`` (None: keep the real probes); the steps decided at."""
    decided: List[int] = []
    if name is None:
        return decided

    def measure(auto, tensors, group, device, selector):
        decided.append(auto.step)
        plan = SCRIPTS[name](auto.step) if name != "ranks_disagree" else (
            auto_links.slow_link if rank == 0 else auto_links.fast_link)
        return plan(torch.distributed.get_world_size(group))

    ddp_auto.measure = measure
    return decided


def measured(rank: int, world_size: int, target: str = "gradient") -> Dict[str, Any]:
    """No script: the real probes decide; every rank must hold the same history and parameters. ``target="auto"``:
    the default, which puts the Adam optimizer in update mode (the optimizer's step is then the clock)."""
    model = make_model()
    state = TopKEFState(ratio="auto", min_numel=64, auto_every=6, named_parameters=model.named_parameters(),
                        target=target)
    ddp = ddp_of(model, state, bucket_cap_mb=0.3)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    opt = opt if target == "gradient" else update_mode_optimizer(opt, state)
    history = []
    for step in range(FIRST_DECISION + 14):
        train_step(ddp, opt, rank, step)
        history.append(state.auto.ratio)
    auto = state.stats()["auto"]
    return {"history": history, "decisions": auto["decisions"], "last": auto["last"], "target": state.target,
            "same": all_equal_across_ranks(flat_params(model))}


def update_mode_training(script: Optional[str]):
    """A float64 model, its auto state in update mode (fp16 offered under the "half" script), DDP and Adam."""
    model = make_model(torch.float64)
    state = TopKEFState(ratio="auto", min_numel=64, auto_every=CHECK_STEPS, target="update",
                        named_parameters=model.named_parameters(), bucket_bytes=20_000)
    offer_held(state, script)
    ddp = ddp_of(model, state, bucket_cap_mb=0.3)
    return model, state, ddp, update_mode_optimizer(torch.optim.Adam(model.parameters(), LR, betas=BETAS, eps=EPS),
                                                    state)


def update_invariant(rank: int, world_size: int, script: str) -> Dict[str, Any]:
    """Update mode (Adam) under a scripted link, float64: per step update_workers.logged_step's record of every
    compressed update, the density per step, the decision steps, the bytes sent per step."""
    decided = scripted(script)
    model, state, ddp, opt = update_mode_training(script)
    log, ratios, sent = [], [], []
    for step in range(FOURTH_DECISION):
        before = state.stats()["bytes_sent"]
        log.append(logged_step(model, state, ddp, opt, rank, step, torch.float64))
        ratios.append(state.auto.ratio)
        sent.append(state.stats()["bytes_sent"] - before)
    return {"log": log, "ratios": ratios, "sent": sent, "decided": decided,
            "same": all_equal_across_ranks(flat_params(model))}


def invariant(rank: int, world_size: int, script: str, micro_batches: int = 1,
              ddp_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A float64 model through the recording hook under a scripted link; every bucket's record, the density per
    step, the decision steps and the statistics. ``micro_batches`` > 1 accumulates under no_sync() (no hook
    call, so no step of auto's); ``ddp_options``: more DDP options (static_graph, gradients as bucket views)."""
    decided = scripted(script)
    model = make_model(torch.float64)
    state = TopKEFState(ratio="auto", min_numel=64, auto_every=CHECK_STEPS)
    offer_held(state, script)
    log: List[Dict[str, Any]] = []
    ddp = DDP(model, bucket_cap_mb=0.3, **(ddp_options or {}))
    ddp.register_comm_hook(state, recording_hook(log))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ratios, sent = [], []
    for step in range(FOURTH_DECISION):
        before = state.stats()["bytes_sent"]
        train_step(ddp, opt, rank, step, torch.float64, micro_batches)
        ratios.append(state.auto.ratio)
        sent.append(state.stats()["bytes_sent"] - before)
    params = flat_params(model)
    return {"log": log, "ratios": ratios, "sent": sent, "decided": decided, "stats": state.stats(),
            "same": all_equal_across_ranks(params)}


def resume(rank: int, world_size: int, target: str = "gradient", script: str = "slow_then_sparse_slower"
           ) -> Dict[str, Any]:
    """THIRD_DECISION steps straight, against a checkpoint (model, optimizer, TopKEFState) taken while sparse (int8
    under the "int8" script: each member's grid is in the checkpoint), loaded into fresh objects that run the rest
    (``target="update"``: each rank's own optimizer state)."""
    scripted(script)
    save_at, end = FIRST_DECISION + 3, THIRD_DECISION

    def fresh():
        model = make_model()
        state = TopKEFState(ratio="auto", min_numel=64, auto_every=5, named_parameters=model.named_parameters(),
                            target=target)
        offer_held(state, script)
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        opt = opt if target == "gradient" else update_mode_optimizer(opt, state)
        return model, state, ddp_of(model, state, bucket_cap_mb=0.3), opt

    model, state, ddp, opt = fresh()
    saved: Dict[str, Any] = {}
    for step in range(end):
        train_step(ddp, opt, rank, step)
        if step == save_at:
            saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "topk": state.state_dict()})
    straight, straight_ratios = flat_params(model), state.stats()["auto"]

    model, state, ddp, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["topk"])
    for step in range(save_at + 1, end):
        train_step(ddp, opt, rank, step)
    grids = sorted(r.int8_reference for _, r in state.registry)
    return {"straight": straight, "resumed": flat_params(model), "saved_ratio": saved["topk"]["auto"]["ratio"],
            "grids": grids,
            "straight_auto": straight_ratios, "resumed_auto": state.stats()["auto"]}


def int8_nonfinite(rank: int, world_size: int) -> Dict[str, Any]:
    """int8 from the first decision; rank 1's gradient of c.weight holds a NaN two steps later (each member on its
    grid by then): per parameter the averaged gradient of that step, every residual after it, and each member's
    grid reference after it."""
    from .workers import poison_on

    scripted("int8")
    model = make_model()
    state = TopKEFState(ratio="auto", min_numel=64, auto_every=CHECK_STEPS, named_parameters=model.named_parameters())
    offer_held(state, "int8")
    ddp = ddp_of(model, state, bucket_cap_mb=0.3)
    bad_step = FIRST_DECISION + 2
    step_box = poison_on(model, rank, bad_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: Dict[str, Any] = {}
    for step in range(bad_step + 1):
        step_box[0] = step
        if step == bad_step:
            out["before"] = {n: r.residual.clone() for n, r in state.registry if r.residual is not None}
            opt.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()  # no optimizer step: AMP would skip it
        else:
            train_step(ddp, opt, rank, step)
    out.update(ratio=state.auto.ratio, grads={n: p.grad.detach().clone() for n, p in model.named_parameters()},
               residuals={n: r.residual.clone() for n, r in state.registry if r.residual is not None},
               grids={n: r.int8_reference for n, r in state.registry},
               nonfinite_steps=state.stats()["nonfinite_steps"])
    return out


def disagree(rank: int, world_size: int, how: str) -> str:
    """Ranks that part: another budget on rank 1 (``how="budget"``), or a decision that differs by rank
    (``how="decision"``, a scripted link that differs by rank): every rank must raise instead of hanging."""
    if how == "decision":
        scripted("ranks_disagree", rank)
    model = make_model()
    budget = 0.2 if how == "budget" and rank == 1 else 0.1
    state = TopKEFState(ratio="auto", min_numel=64, budget=budget)
    offer_held(state, None)
    ddp = ddp_of(model, state, bucket_cap_mb=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(FIRST_DECISION + 3):
            train_step(ddp, opt, rank, step)
    except Exception as error:  # DDP re-raises the hook's RankMismatch from backward()
        return f"{type(error).__name__} at step {state.auto.step}: {error}"
    return "no error"


def update_held_dense(rank: int, world_size: int) -> Dict[str, Any]:
    """Update mode (Adam) with auto kept dense by a fast link: the gradient route, against DDP's own allreduce and
    torch's Adam on the same batches; the route of every step and the averaged gradient after the last."""
    SCRIPTS["fast"] = lambda step: auto_links.fast_link
    scripted("fast")
    plain_model = make_model()
    plain = ddp_of(plain_model, None, bucket_cap_mb=0.3)
    plain_opt = torch.optim.Adam(plain_model.parameters(), LR, betas=BETAS, eps=EPS)
    model = make_model()
    state = TopKEFState(ratio="auto", min_numel=64, auto_every=CHECK_STEPS, target="update",
                        named_parameters=model.named_parameters())
    offer_held(state, None)
    ddp = ddp_of(model, state, bucket_cap_mb=0.3)
    opt = update_mode_optimizer(torch.optim.Adam(model.parameters(), LR, betas=BETAS, eps=EPS), state)
    routes = []
    for step in range(FIRST_DECISION + 6):
        train_step(plain, plain_opt, rank, step)
        train_step(ddp, opt, rank, step)
        routes.append(opt.topk_update_step.route.last)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"plain": flat_params(plain_model), "ours": flat_params(model), "routes": routes,
            "ratio": state.auto.ratio, "decisions": state.auto.decisions,
            "same": all_equal_across_ranks(flat_params(model)), "grads_same": all_equal_across_ranks(grads)}


def update_entering(rank: int, world_size: int) -> Dict[str, Any]:
    """Update mode (Adam): sparse from the first decision, dense (the gradient route) from the second. The entering
    step runs at learning rate 0: what it changed in the parameters, against minus the ranks' mean update residual,
    and each first moment against Adam's on the mean of the ranks' first moments and the averaged gradient."""
    scripted("slow_then_sparse_slower")
    model, state, ddp, opt = update_mode_training("slow_then_sparse_slower")
    routes, out = [], {}
    group = torch.distributed.group.WORLD

    def mean(t):
        t = t.clone()
        torch.distributed.all_reduce(t, group=group)
        return t / world_size

    for step in range(SECOND_DECISION + 3):
        if step == SECOND_DECISION:
            residuals = {n: state.registry.records["update." + n].residual for n, _ in model.named_parameters()}
            out["had_residuals"] = sum(int(r is not None and bool(r.any())) for r in residuals.values())
            expected = {n: p.detach().clone() - mean(residuals[n] if residuals[n] is not None
                                                     else torch.zeros(p.numel(), dtype=p.dtype)).view_as(p)
                        for n, p in model.named_parameters()}
            moments = {n: mean(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
            opt.param_groups[0]["lr"] = 0.0
        train_step(ddp, opt, rank, step, torch.float64)
        routes.append(opt.topk_update_step.route.last)
        if step == SECOND_DECISION:
            opt.param_groups[0]["lr"] = LR
            out["param_gap"] = max(float((p.detach() - expected[n]).abs().max()) for n, p in model.named_parameters())
            out["moment_gap"] = max(float((opt.state[p]["exp_avg"] - (BETAS[0] * moments[n] + (1 - BETAS[0])
                                                                          * p.grad.float())).abs().max())
                                    for n, p in model.named_parameters())
            out["moments_same"] = all_equal_across_ranks(torch.cat([opt.state[p]["exp_avg"].reshape(-1)
                                                                    for p in model.parameters()]))
            out["residuals_left"] = [n for n, _ in model.named_parameters()
                                     if state.registry.records["update." + n].residual is not None]
    out.update(routes=routes, shared=list(state.auto.shared_scopes), same=all_equal_across_ranks(flat_params(model)))
    return out


def update_skipped_steps(rank: int, world_size: int) -> Dict[str, Any]:
    """Update mode (Adam) through dense -> sparse -> dense -> sparse, with the optimizer's step not taken (as AMP's
    GradScaler skips one) on the step that enters the gradient route and on the last one before it is left: the
    next step closes each (sharing the state of the first at its bucket 0) and training goes on alike everywhere."""
    scripted("changes")
    model, state, ddp, opt = update_mode_training("changes")
    skipped = {SECOND_DECISION, THIRD_DECISION - 1}
    routes, ratios = [], []
    for step in range(THIRD_DECISION + 3):
        if step in skipped:
            opt.zero_grad()
            x, y = batch(rank, step, torch.float64)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()  # reduced by the hook; no optimizer step
        else:
            train_step(ddp, opt, rank, step, torch.float64)
        routes.append(opt.topk_update_step.route.last)
        ratios.append(state.auto.ratio)
    return {"routes": routes, "ratios": ratios, "same": all_equal_across_ranks(flat_params(model)),
            "moments_same": all_equal_across_ranks(torch.cat([opt.state[p]["exp_avg"].reshape(-1)
                                                              for p in model.parameters()]))}
