"""ratio="auto" on real Horovod workers: the same decision on every rank at the same step, error feedback exact
through every change of density, identical parameters, exact resume, and a named error for a mismatched budget.

Where a test needs a given sequence of decisions it scripts the link the decisions are made from (the same script
on every rank, a function of the step); the collectives, the compressor and the planning are the real ones.
"""
import copy

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.core import RankMismatch
from horovod_topk.torch import TopKEF, auto_density

from horovod_topk.core.autodensity import HALF
from tests.auto_links import (CHECK_STEPS, FIRST_DECISION, FOURTH_DECISION, SECOND_DECISION, THIRD_DECISION,
                              fast_link, much_slower_link, script, slow_link, sparse_slower_than_dense)

from .torch_harness import batch, differs


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def run(compressor, steps, *, state=None, on_step=None, target_lr=0.1, optimizer="sgd"):
    torch.manual_seed(0)
    model = Model()
    base = (torch.optim.SGD(model.parameters(), lr=target_lr) if optimizer == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.01))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compressor)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        compressor.load_state_dict(state["topk"])
    saved = {}
    for step in steps:
        opt.zero_grad()
        x, _, y = batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if on_step is not None:
            on_step(step, model, opt, compressor, saved)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, saved


def test_measured_decisions_are_the_same_on_every_rank_and_parameters_stay_identical():
    """No script: the real probes, timings and selection timing decide; every rank must hold the same history."""
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=6)
    history = []
    params, _ = run(compressor, range(FIRST_DECISION + 20),
                    on_step=lambda step, m, o, c, s: history.append(c.auto.ratio))
    flat = torch.cat([params[n].reshape(-1) for n in sorted(params)])
    same = hvd.allgather(flat.unsqueeze(0), name="auto.measured.params")
    stats = compressor.stats()["auto"]
    everyone = hvd.allgather_object((history, stats["decisions"], stats["last"].get("ratio")), name="auto.history")
    assert torch.equal(same[0], same[1])
    assert stats["decisions"] >= 2
    assert all(h == everyone[0] for h in everyone)
    assert history[:FIRST_DECISION] == [None] * FIRST_DECISION  # dense while the first window is measured


def recorded(compressor, steps, after_synchronize):
    """Train Model with SGD through ``compressor``, calling ``after_synchronize(model)`` once each step's averaged
    gradients are in ``.grad``; returns (each parameter's raw local gradients summed over the steps, the model)."""
    raw = {}
    torch.manual_seed(0)
    model = Model()
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: raw.__setitem__(name, raw.get(name, 0) + g.detach().clone()))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compressor)
    for step in steps:
        opt.zero_grad()
        x, _, y = batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        after_synchronize(model)
        with opt.skip_synchronize():
            opt.step()
    return raw, model


def test_parameters_are_bit_identical_on_every_rank_through_changes(monkeypatch):
    script(monkeypatch, auto_density, lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=5)
    params, _ = run(compressor, range(THIRD_DECISION))
    flat = torch.cat([params[n].reshape(-1) for n in sorted(params)])
    everyone = hvd.allgather(flat.unsqueeze(0), name="auto.params")
    assert torch.equal(everyone[0], everyone[1])
    assert compressor.stats()["auto"]["changes"] >= 2


def test_error_feedback_stays_exact_through_every_change_of_density(monkeypatch):
    """Per tensor, over all ranks: sum of raw gradients == P * sum of averaged gradients + sum of residuals, across
    dense -> sparse -> dense (leftovers flushed into the dense step) -> sparse."""
    measured = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
    decided = script(monkeypatch, auto_density, lambda step: measured.get(step, much_slower_link))
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=CHECK_STEPS)
    compressor.auto.half = False  # the script's sequence is dense <-> sparse; fp16 has its own test below
    compressor.auto.int8 = False  # int8 has its own tests (test_torch_auto_int8.py)
    sent, ratios = {}, []

    def record(model):
        for name, p in model.named_parameters():
            sent[name] = sent.get(name, 0) + p.grad.detach().clone()
        ratios.append(compressor.auto.ratio)

    raw, _ = recorded(compressor, range(FOURTH_DECISION), record)
    for name, record in sorted(compressor.registry.records.items()):
        residual = record.residual if record.residual is not None else torch.zeros(record.numel)
        total_raw = hvd.allreduce(raw[name].reshape(-1), op=hvd.Sum, name=f"auto.ef.raw.{name}")
        total_residual = hvd.allreduce(residual, op=hvd.Sum, name=f"auto.ef.res.{name}")
        torch.testing.assert_close(hvd.size() * sent[name].reshape(-1) + total_residual, total_raw,
                                   rtol=1e-5, atol=1e-5)
    changes = [(i, r) for i, r in enumerate(ratios) if i and r != ratios[i - 1]]
    assert ratios[0] is None and len(changes) >= 3, (changes, decided)
    assert any(r is None for _, r in changes[1:]), changes  # went back to dense at least once


def test_checkpoint_resumes_exactly_with_the_density_in_force(monkeypatch):
    script(monkeypatch, auto_density, lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    save_at = FIRST_DECISION + 3

    def keep(step, model, opt, compressor, saved):
        if step == save_at:
            saved.update(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "topk": compressor.state_dict()}))

    straight, saved = run(TopKEF(ratio="auto", min_numel=256, auto_every=5), range(THIRD_DECISION), on_step=keep)
    assert saved["topk"]["auto"]["ratio"] is not None  # saved while sparse
    resumed_compressor = TopKEF(ratio="auto", min_numel=256, auto_every=5)
    resumed, _ = run(resumed_compressor, range(save_at + 1, THIRD_DECISION), state=saved)
    assert differs(straight, resumed) == []


@pytest.mark.parametrize("half", [False, True], ids=["dense-sparse", "fp16"])
def test_update_mode_follows_the_density_and_keeps_parameters_identical(monkeypatch, half):
    """Update mode (Adam): the updates follow the density in force (without fp16 among the choices: sparse, then
    back to dense; with it: sparse, fp16, dense); every rank holds the same parameters."""
    if half:
        links = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
        script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    else:
        script(monkeypatch, auto_density,
               lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    compressor = TopKEF(ratio="auto", min_numel=256, target="update", auto_every=CHECK_STEPS if half else 5)
    compressor.auto.half = half
    compressor.auto.int8 = False  # int8 has its own tests (test_torch_auto_int8.py)
    ratios = []
    params, _ = run(compressor, range(FOURTH_DECISION if half else THIRD_DECISION), optimizer="adam",
                    on_step=lambda step, m, o, c, s: ratios.append(c.auto.ratio))
    flat = torch.cat([params[n].reshape(-1) for n in sorted(params)])
    everyone = hvd.allgather(flat.unsqueeze(0), name=f"auto.update.params.{half}")
    assert torch.equal(everyone[0], everyone[1])
    assert ratios[0] is None and any(isinstance(r, float) for r in ratios) and ratios[-1] is None, ratios
    assert (HALF in ratios) == half, ratios
    exchanges = compressor.stats()["exchanges"]
    assert exchanges and (exchanges.get("dense_fp16", 0) > 0) == half, exchanges


def test_fp16_keeps_error_feedback_exact_and_parameters_identical_through_its_changes(monkeypatch):
    """ratio="auto"'s fp16 over Horovod: dense -> sparse -> fp16 (the sparse residuals' leftovers go out in
    float16) -> dense (fp16's residual goes out dense). Per tensor, over all ranks and steps: sum of raw gradients
    == P * sum of averaged gradients + sum of residuals, within the float16 sums' own rounding on fp16 steps (each
    rank's rounding is in its residual); identical parameters; fp16 sends 2 bytes an entry."""
    links = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
    decided = script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=CHECK_STEPS)
    compressor.auto.int8 = False  # int8 has its own tests (test_torch_auto_int8.py)
    sent, bound, ratios, step_bytes = {}, {}, [], [0]
    world = hvd.size()

    def record(model):
        half = compressor.auto.ratio == HALF
        for name, p in model.named_parameters():
            sent[name] = sent.get(name, 0) + p.grad.detach().clone()
            # the float16 sum's rounding: at most P - 1 roundings of 2**-11, in units of P x the average
            bound[name] = bound.get(name, 0) + (world * (world - 1) * 2 ** -10 * p.grad.detach().abs() + 2 ** -22
                                                if half else 0)
        ratios.append(compressor.auto.ratio)
        step_bytes.append(compressor.stats()["bytes_sent"])

    raw, model = recorded(compressor, range(FOURTH_DECISION), record)
    for name, record in sorted(compressor.registry.records.items()):
        residual = record.residual if record.residual is not None else torch.zeros(record.numel)
        total_raw = hvd.allreduce(raw[name].reshape(-1), op=hvd.Sum, name=f"auto.half.raw.{name}")
        total_residual = hvd.allreduce(residual, op=hvd.Sum, name=f"auto.half.res.{name}")
        gap = (world * sent[name].reshape(-1) + total_residual - total_raw).abs()
        assert bool((gap <= torch.as_tensor(bound[name]).reshape(-1) + 1e-5).all()), name
    assert isinstance(ratios[FIRST_DECISION], float), (ratios, decided)
    assert ratios[SECOND_DECISION] == HALF and ratios[-1] is None, (ratios, decided)
    per_step = [b - a for a, b in zip(step_bytes, step_bytes[1:])]
    assert all(b == per_step[0] // 2 for b, r in zip(per_step, ratios) if r == HALF), (per_step, ratios)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="auto.half.params")
    assert torch.equal(everyone[0], everyone[1])


def test_a_different_budget_on_one_rank_is_named_instead_of_hanging():
    compressor = TopKEF(ratio="auto", min_numel=256, budget=0.1 if hvd.rank() == 0 else 0.2)
    with pytest.raises(RankMismatch, match="budget"):
        run(compressor, range(2))
    # The step's other collectives were started on both ranks but never waited for: let them finish before a
    # later test starts collectives of the same names (fc1.weight...), which Horovod refuses while they are pending.
    hvd.allreduce(torch.zeros(1), name="auto.budget.mismatch.done")
