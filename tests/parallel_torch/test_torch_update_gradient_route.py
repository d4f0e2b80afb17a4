"""Update mode's gradient route on real Horovod workers (core.update_mode): while ratio="auto" holds dense or fp16 a
step of update mode runs as gradient mode. Checked: it is Adam on the averaged gradient; entering it makes every
rank's moments their mean and applies the mean of the update residuals; leaving it puts fp16's residual into each
rank's own gradient; parameters stay identical; a checkpoint on either side of a change resumes exactly.

The links the decisions are made from are scripted (tests/auto_links.py); collectives and compressor are real.
"""
import copy

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.core.autodensity import HALF
from horovod_topk.core.update_mode import update_tensor_name
from horovod_topk.torch import TopKEF, auto_density
from tests.auto_links import (CHECK_STEPS, FIRST_DECISION, SECOND_DECISION, THIRD_DECISION, fast_link, half_link,
                              script, slow_link, sparse_slower_than_dense)

from .test_torch_auto_density import Model
from .torch_harness import assert_same_params, batch, differs, train as train_harness

BETA1 = 0.9


def train(compression, steps, *, before=None, after=None, state=None, raw=None):
    """Adam through ``hvd.DistributedOptimizer``; ``before(step, model, opt)`` / ``after(step, model, opt)`` around
    each step; ``raw`` collects each parameter's local gradient of the step (before any reduction)."""
    torch.manual_seed(0)
    model = Model()
    if raw is not None:
        for name, p in model.named_parameters():
            p.register_hook(lambda g, name=name: raw.__setitem__(name, g.detach().clone()))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, betas=(BETA1, 0.999)),
                                   named_parameters=model.named_parameters(), compression=compression)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        compression.load_state_dict(state["topk"])
    for step in steps:
        if before is not None:
            before(step, model, opt)
        opt.zero_grad()
        x, _, y = batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if after is not None:
            after(step, model, opt)
    return model, opt


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_on_every_rank(tensors, name):
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    everyone = hvd.allgather(flat.unsqueeze(0), name=name)
    return all(torch.equal(everyone[0], row) for row in everyone)


def test_held_dense_is_adam_on_the_averaged_gradient(monkeypatch):
    """auto kept dense (a fast link): update mode's steps are Horovod's gradient-mode Adam, and p.grad holds the
    averaged gradient after the step."""
    script(monkeypatch, auto_density, lambda step: fast_link)
    compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS)
    routes = []
    model, _ = train(compressor, range(FIRST_DECISION + 6),
                     after=lambda step, m, o: routes.append(o.topk_update_step.route.last))
    reference, _ = train(hvd.Compression.none, range(FIRST_DECISION + 6))
    assert routes == ["gradient"] * len(routes)
    assert compressor.auto.ratio is None and compressor.auto.decisions >= 1
    for name, p in params_of(model).items():
        torch.testing.assert_close(p, params_of(reference)[name], rtol=1e-5, atol=1e-6)
    assert same_on_every_rank([p.grad for p in model.parameters()], "route.dense.grads")
    assert same_on_every_rank(list(params_of(model).values()), "route.dense.params")


def test_entering_averages_the_moments_and_applies_the_mean_update_residual(monkeypatch):
    """sparse (updates exchanged, residuals left) -> dense at SECOND_DECISION. With lr 0 on the entering step the
    parameters move by exactly minus the ranks' mean update residual, and each first moment is Adam's on the mean
    of the ranks' first moments and the averaged gradient."""
    script(monkeypatch, auto_density, lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS)
    compressor.auto.half = False
    compressor.auto.int8 = False  # int8 has its own tests (test_torch_auto_int8.py)
    seen, routes = {}, []

    def before(step, model, opt):
        if step != SECOND_DECISION:
            return
        names = dict(model.named_parameters())
        residuals = {n: compressor.registry.records[update_tensor_name(n)].residual for n in names}
        seen["mean_residual"] = {n: hvd.allreduce(r if r is not None else torch.zeros(names[n].numel()),
                                                  op=hvd.Average, name=f"route.enter.res.{n}")
                                 for n, r in residuals.items()}
        seen["sparse_residuals"] = sum(int(r is not None and bool(r.any())) for r in residuals.values())
        seen["mean_exp_avg"] = {n: hvd.allreduce(opt.state[p]["exp_avg"].clone(), op=hvd.Average,
                                                 name=f"route.enter.m.{n}") for n, p in names.items()}
        seen["params"] = params_of(model)
        opt.param_groups[0]["lr"] = 0.0

    def after(step, model, opt):
        routes.append(opt.topk_update_step.route.last)
        if step != SECOND_DECISION:
            return
        opt.param_groups[0]["lr"] = 0.01
        for name, p in model.named_parameters():
            expected = seen["params"][name] - seen["mean_residual"][name].view_as(p)
            torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
            moment = BETA1 * seen["mean_exp_avg"][name] + (1 - BETA1) * p.grad
            torch.testing.assert_close(opt.state[p]["exp_avg"], moment, rtol=1e-5, atol=1e-7)
            assert compressor.registry.records[update_tensor_name(name)].residual is None
        assert same_on_every_rank([opt.state[p]["exp_avg"] for p in model.parameters()], "route.enter.m.same")
        assert same_on_every_rank([opt.state[p]["exp_avg_sq"] for p in model.parameters()], "route.enter.v.same")

    model, _ = train(compressor, range(SECOND_DECISION + 3), before=before, after=after)
    assert seen["sparse_residuals"] >= 1  # there was a residual to apply
    assert routes[SECOND_DECISION - 1] == "local" and routes[SECOND_DECISION:] == ["gradient"] * 3, routes
    assert compressor.auto.shared_scopes == [""]
    assert same_on_every_rank(list(params_of(model).values()), "route.enter.params")


def test_leaving_fp16_puts_its_residual_into_the_ranks_own_gradient(monkeypatch):
    """fp16 (gradient route, residuals of float16's rounding) -> a density (update mode): the step back takes each
    rank's fp16 residual into that rank's own gradient, before its local step."""
    links = {FIRST_DECISION: half_link, SECOND_DECISION: slow_link}
    script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS)
    compressor.auto.half = True
    compressor.auto.int8 = False  # int8 has its own tests (test_torch_auto_int8.py)
    raw, seen, ratios, routes = {}, {}, [], []

    def before(step, model, opt):
        records = compressor.registry.records
        seen[step] = {n: (records[update_tensor_name(n)].residual.clone()
                          if update_tensor_name(n) in records and records[update_tensor_name(n)].residual is not None
                          else None) for n, _ in model.named_parameters()}

    def after(step, model, opt):
        ratios.append(compressor.auto.ratio)
        routes.append(opt.topk_update_step.route.last)
        if step == SECOND_DECISION:
            for name, p in model.named_parameters():
                residual = seen[step][name]
                assert residual is not None, name
                torch.testing.assert_close(p.grad, raw[name] + residual.view_as(p), rtol=0, atol=1e-7)

    model, _ = train(compressor, range(SECOND_DECISION + 2), before=before, after=after, raw=raw)
    assert ratios[FIRST_DECISION] == HALF and isinstance(ratios[SECOND_DECISION], float), ratios
    assert routes[SECOND_DECISION - 1] == "gradient" and routes[SECOND_DECISION] == "local", routes
    assert any(bool(r.any()) for r in seen[SECOND_DECISION].values() if r is not None)
    assert compressor.auto.shared_scopes == []
    assert same_on_every_rank(list(params_of(model).values()), "route.leave.params")


@pytest.mark.parametrize("links, save_at, shared", [
    ({FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}, SECOND_DECISION - 2, []),
    ({FIRST_DECISION: half_link}, FIRST_DECISION + 2, [""]),
], ids=["in-update-mode-before-entering", "within-fp16"])
def test_a_checkpoint_resumes_exactly(monkeypatch, links, save_at, shared):
    """Saved in update mode before the step that enters the gradient route (sparse -> dense: the resumed job must
    average as the straight one did), or within fp16's gradient route (its residuals hold gradient: the resumed job
    must not take them for update residuals)."""
    script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    saved = {}

    def keep(step, model, opt):
        if step == save_at:
            saved.update(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "topk": compressor.state_dict()}))

    compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS)
    compressor.auto.half = True
    compressor.auto.int8 = False  # int8 has its own tests (test_torch_auto_int8.py)
    straight, _ = train(compressor, range(THIRD_DECISION), after=keep)
    assert saved["topk"]["auto"]["shared_scopes"] == shared
    resumed_compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS)
    resumed_compressor.auto.half = True
    resumed_compressor.auto.int8 = False  # int8 has its own tests (test_torch_auto_int8.py)
    resumed, _ = train(resumed_compressor, range(save_at + 1, THIRD_DECISION), state=saved)
    assert differs(params_of(straight), params_of(resumed)) == []


def test_sparse_gradients_with_sparse_as_dense_on_the_gradient_route():
    """sparse_as_dense=True, SGD, auto dense through its first window (the gradient route): Horovod hands the averaged
    sparse gradient back sparse; it is made dense before the step, which then equals plain Horovod's."""
    kwargs = {"optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.1), "sparse_embedding": True,
              "sparse_as_dense": True}
    plain = train_harness(hvd.Compression.none, **kwargs)
    ours = train_harness(TopKEF(ratio="auto", min_numel=0, target="update"), **kwargs)
    assert_same_params(ours, plain)


def test_after_an_elastic_reset_the_route_averages_the_ranks_own_state_again(monkeypatch):
    """The shared second moment keeps each rank's first moment beside its residual, which a worker that joins an
    elastic job starts anew. Within the gradient route, a reset (core.checkpoint.sync_after_reset, over Horovod's
    collectives) makes the next step average the ranks' first moments again: here rank 1's are zeroed as a joined
    worker's would be, and every rank's parameters and moments stay the same."""
    from horovod_topk.core.checkpoint import sync_after_reset
    from horovod_topk.torch.checkpoint import _TorchTransport

    script(monkeypatch, auto_density, lambda step: fast_link)
    compressor = TopKEF(ratio="auto", min_numel=256, target="update", second_moment="shared",
                        auto_every=CHECK_STEPS)

    def reset(step, model, opt):
        if step != 4:
            return
        if hvd.rank() == 1:
            for name, _ in model.named_parameters():
                compressor.registry.records[update_tensor_name(name)].momentum.zero_()
        sync_after_reset(compressor, _TorchTransport())
        assert compressor.auto.resync_scopes == [""]

    model, _ = train(compressor, range(FIRST_DECISION + 2), before=reset)
    moments = [compressor.registry.records[update_tensor_name(n)].momentum for n, _ in model.named_parameters()]
    assert same_on_every_rank(moments, "route.resync.m")
    assert same_on_every_rank(list(params_of(model).values()), "route.resync.params")
    assert compressor.auto.resync_scopes == []
