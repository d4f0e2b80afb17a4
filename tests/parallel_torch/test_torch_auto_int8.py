"""ratio="auto"'s int8 route on real Horovod workers (torch.int8_route): error feedback exact through
dense -> int8 -> dense, a quarter of dense's bytes, identical parameters on every rank, a rank's NaN reaching every
rank without entering a residual, and an exact resume from a checkpoint taken on the int8 route.

The decisions come from scripted links (tests/auto_links.py); the collectives, compressor and planning are real.
"""
import copy

import horovod.torch as hvd
import torch
from torch import nn

from horovod_topk.core.autodensity import FIRST_DECISION, INT8
from horovod_topk.core.exchange import DENSE_INT8
from horovod_topk.torch import TopKEF, auto_density
from horovod_topk.torch.int8_route import int8_words
from tests.auto_links import CHECK_STEPS, SECOND_DECISION, THIRD_DECISION, fast_link, int8_link, script

from .test_torch_auto_density import Model, recorded, run
from .torch_harness import differs


def int8_then_dense(step):
    """int8 from the first decision, dense again from the second (the int8 window measured 1 s a step)."""
    return int8_link if step < SECOND_DECISION else fast_link


def test_int8_keeps_error_feedback_exact_and_parameters_identical(monkeypatch):
    """dense -> int8 (its first step in float16: no grid reference yet) -> dense. Per tensor, over all ranks and
    steps: sum of raw gradients == P * sum of averaged gradients + sum of residuals (float16's rounding on the one
    fp16 step, float32's elsewhere: the integer sums are exact); the int8 steps send 4 bytes per 4 entries and a
    control word; identical parameters."""
    decided = script(monkeypatch, auto_density, int8_then_dense)
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=100)
    sent, bound, ratios, step_bytes, exchanges = {}, {}, [], [0], []
    world = hvd.size()

    def record(model):
        exchanges.append({n: r.exchange for n, r in compressor.registry.records.items()})
        for name, p in model.named_parameters():
            sent[name] = sent.get(name, 0) + p.grad.detach().clone()
            rounding = exchanges[-1].get(name) == "dense_fp16"
            bound[name] = bound.get(name, 0) + (world * (world - 1) * 2 ** -10 * p.grad.detach().abs() + 2 ** -22
                                                if rounding else 0)
        ratios.append(compressor.auto.ratio)
        step_bytes.append(compressor.stats()["bytes_sent"])

    raw, model = recorded(compressor, range(THIRD_DECISION), record)
    assert ratios[FIRST_DECISION] == INT8 and ratios[SECOND_DECISION] is None, (ratios, decided)
    int8_steps = [i for i, r in enumerate(ratios) if r == INT8]
    first = int8_steps[0]
    assert set(exchanges[first].values()) == {"dense_fp16"}, exchanges[first]  # no reference yet: float16
    assert set(exchanges[first + 1].values()) == {DENSE_INT8}, exchanges[first + 1]
    per_step = [b - a for a, b in zip(step_bytes, step_bytes[1:])]
    words = sum(4 * int8_words(p.numel()) for p in model.parameters())
    assert all(per_step[i] == words for i in int8_steps[1:]), (per_step, int8_steps, words)
    for name, rec in sorted(compressor.registry.records.items()):
        residual = rec.residual if rec.residual is not None else torch.zeros(rec.numel)
        total_raw = hvd.allreduce(raw[name].reshape(-1), op=hvd.Sum, name=f"int8.raw.{name}")
        total_residual = hvd.allreduce(residual, op=hvd.Sum, name=f"int8.res.{name}")
        gap = (world * sent[name].reshape(-1) + total_residual - total_raw).abs()
        allowed = torch.as_tensor(bound[name]).reshape(-1) + 1e-5 * (1 + total_raw.abs())
        assert bool((gap <= allowed).all()), (name, float(gap.max()))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="int8.params")
    assert torch.equal(everyone[0], everyone[1])


def test_fp16_steps_leave_the_int8_grid_as_it_was():
    """int8 -> fp16 -> int8 (auto held at each in turn, as a decision would set it): the fp16 steps do not read
    their results' largest entries for a grid (a pass per tensor and step that a long fp16 period would pay for
    nothing); int8 resumes on the grid it left, without another fp16 step."""
    from horovod_topk.core.autodensity import HALF

    compressor = TopKEF(ratio="auto", min_numel=256)
    compressor.auto.next_decision = 10 ** 6  # no decision: the test sets the route
    held = [INT8] * 3 + [HALF] * 2 + [INT8] * 2
    compressor.auto.ratio = held[0]
    exchanges, references = [], []

    def record(model):
        records = compressor.registry.records
        exchanges.append({n: r.exchange for n, r in records.items()})
        references.append({n: r.int8_reference for n, r in records.items()})
        if len(exchanges) < len(held):
            compressor.auto.ratio = held[len(exchanges)]

    recorded(compressor, range(len(held)), record)
    routes = [set(e.values()) for e in exchanges]
    assert routes == [{"dense_fp16"}] + [{DENSE_INT8}] * 2 + [{"dense_fp16"}] * 2 + [{DENSE_INT8}] * 2, routes
    assert all(v > 0 for v in references[2].values()), references[2]
    assert references[3] == references[4] == references[2], references[2:5]
    assert references[5] != references[4], references[4:6]


def test_the_routes_buckets_train_as_one_allreduce_per_tensor_does(monkeypatch):
    """fp16 and int8 steps in turn (auto held at each, as decisions would set it), with one allreduce per tensor
    (bucket_bytes=0), with the routes' default buckets (int8's: Model's six tensors are one bucket; fp16 per tensor)
    and with fp16 bucketed too: the same parameters and residuals bit for bit (two ranks' sums are exact in any
    order), identical on every rank, and one collective per bucketed step where per tensor ran six."""
    import horovod_topk.core.buckets as core_buckets
    from horovod_topk.core.autodensity import HALF
    from horovod_topk.core.exchange import DENSE_HALF

    held = [HALF, HALF, INT8, INT8, INT8, HALF, INT8]
    caps = dict(core_buckets.HELD_BUCKET_BYTES)
    outcome = {}
    for label, options, fp16_cap in (("per tensor", {"bucket_bytes": 0}, 0), ("default", {}, caps[DENSE_HALF]),
                                     ("fp16 bucketed", {}, 2 ** 20)):
        monkeypatch.setitem(core_buckets.HELD_BUCKET_BYTES, DENSE_HALF, fp16_cap)
        compressor = TopKEF(ratio="auto", min_numel=256, **options)
        compressor.auto.next_decision = 10 ** 6  # no decision: the test sets the route
        compressor.auto.ratio = held[0]
        routes = []

        def record(model, compressor=compressor, routes=routes):
            routes.append(sorted({r.exchange for r in compressor.registry.records.values()}))
            if len(routes) < len(held):
                compressor.auto.ratio = held[len(routes)]

        _, model = recorded(compressor, range(len(held)), record)
        residuals = {n: r.residual.clone() for n, r in compressor.registry.records.items()}
        outcome[label] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), residuals, routes,
                          compressor.stats().get("held_buckets"))
    params, residuals, routes, held_stats = outcome.pop("per tensor")
    assert [DENSE_INT8] in routes and ["dense_fp16"] in routes, routes
    assert held_stats is None, held_stats
    int8_steps, fp16_steps = held.count(INT8), held.count(HALF)
    expected = {"default": {DENSE_INT8: int8_steps},
                "fp16 bucketed": {DENSE_INT8: int8_steps, DENSE_HALF: fp16_steps}}
    for label, (b_params, b_residuals, b_routes, b_held) in outcome.items():
        assert b_routes == routes, (label, b_routes)
        assert torch.equal(params, b_params), label
        assert residuals.keys() == b_residuals.keys(), label
        assert all(torch.equal(residuals[n], b_residuals[n]) for n in residuals), label
        assert {route: (s["buckets"], s["collectives"], s["tensors"], s["flushed_incomplete"])
                for route, s in b_held.items() if s["collectives"]} == {
            route: (1, steps, 6 * steps, 0) for route, steps in expected[label].items()}, (label, b_held)
        everyone = hvd.allgather(b_params.unsqueeze(0), name=f"int8.bucketed.params.{label}")
        assert torch.equal(everyone[0], everyone[1]), label


def test_a_nan_on_one_rank_reaches_every_rank_and_no_residual(monkeypatch):
    """On an int8 step one rank's gradient holds a NaN: every rank's averaged gradient of that tensor is NaN (so a
    loss scaler skips the step everywhere), no residual takes it, and the next steps train on, identical."""
    script(monkeypatch, auto_density, lambda step: int8_link)
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=100)
    poisoned = FIRST_DECISION + 3
    seen = {}
    torch.manual_seed(0)
    model = Model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compressor)
    current = [0]

    def poison(grad):  # before Horovod's hook sees the gradient
        if current[0] == poisoned and hvd.rank() == 1:
            grad = grad.clone()
            grad[3, 5] = float("nan")
        return grad

    model.fc2.weight.register_hook(poison)
    for step in range(poisoned + 4):
        current[0] = step
        opt.zero_grad()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 10 + hvd.rank()))
        model(x).pow(2).mean().backward()
        opt.synchronize()
        if step == poisoned:
            seen["exchange"] = compressor.registry.records["fc2.weight"].exchange
            seen["fc2"] = bool(torch.isnan(model.fc2.weight.grad).all())
            seen["fc1"] = bool(torch.isfinite(model.fc1.weight.grad).all())
        with opt.skip_synchronize():
            if step != poisoned:
                opt.step()
    assert seen == {"exchange": DENSE_INT8, "fc2": True, "fc1": True}, seen
    for name, rec in compressor.registry.records.items():
        assert rec.residual is None or bool(torch.isfinite(rec.residual).all()), name
    assert compressor.auto.ratio == INT8
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert bool(torch.isfinite(flat).all())
    everyone = hvd.allgather(flat.unsqueeze(0), name="int8.nan.params")
    assert torch.equal(everyone[0], everyone[1])


def test_a_checkpoint_on_the_int8_route_resumes_exactly(monkeypatch):
    """Saved within int8 (the grid's references in the state), resumed by a fresh compressor: the same words, the
    same parameters bit for bit."""
    script(monkeypatch, auto_density, lambda step: int8_link)
    save_at = FIRST_DECISION + 4

    def keep(step, model, opt, compressor, saved):
        if step == save_at:
            saved.update(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "topk": compressor.state_dict()}))

    straight, saved = run(TopKEF(ratio="auto", min_numel=256, auto_every=100), range(save_at + 6), on_step=keep)
    assert saved["topk"]["auto"]["ratio"] == INT8
    assert all(e["int8_reference"] > 0 for e in saved["topk"]["tensors"].values()), saved["topk"]["tensors"]
    resumed, _ = run(TopKEF(ratio="auto", min_numel=256, auto_every=100), range(save_at + 1, save_at + 6),
                     state=saved)
    assert differs(straight, resumed) == []


def test_update_mode_runs_int8_steps_as_gradient_mode_and_leaving_keeps_the_residual(monkeypatch):
    """Update mode (Adam) while auto holds int8: the steps take the gradient route (int8 words from backward, Adam
    on the averaged gradient); back to a density, int8's residual joins each rank's own gradient before its local
    step; parameters identical on every rank throughout."""
    from horovod_topk.core.update_mode import update_tensor_name
    from tests.auto_links import slow_link

    from .test_torch_update_gradient_route import same_on_every_rank, train

    leave = SECOND_DECISION
    script(monkeypatch, auto_density, lambda step: int8_link if step < leave else slow_link)
    compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS)
    compressor.auto.half = False  # from int8 to a density at the second decision, not to fp16
    raw, seen, routes, exchanges = {}, {}, [], []

    def before(step, model, opt):
        if step == leave:  # what int8 left in each residual
            records = compressor.registry.records
            seen.update({n: records[update_tensor_name(n)].residual.clone() for n, _ in model.named_parameters()})

    def after(step, model, opt):
        routes.append((compressor.auto.ratio, opt.topk_update_step.route.last))
        exchanges.append(compressor.registry.records[update_tensor_name("fc1.weight")].exchange)
        if step == leave:
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, raw[name] + seen[name].view_as(p), rtol=0, atol=1e-7)

    model, _ = train(compressor, range(leave + 3), before=before, after=after, raw=raw)
    held = [route for ratio, route in routes[FIRST_DECISION + 1:leave] if ratio == INT8]
    assert held and set(held) == {"gradient"}, routes
    assert DENSE_INT8 in exchanges, exchanges
    assert isinstance(routes[leave][0], float) and routes[leave][1] == "local", routes
    assert any(bool(r.any()) for r in seen.values())  # int8's rounding was left over
    assert same_on_every_rank([p.detach() for p in model.parameters()], "int8.update.params")
