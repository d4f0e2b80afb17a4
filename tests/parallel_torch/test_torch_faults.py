"""Faults on real Horovod workers: non-finite gradients (with an AMP-style loss scaler on CPU) and bad input."""
import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.torch import TopKEF

from .torch_harness import Net, batch


def _inject(model: nn.Module, when: dict, value: float) -> None:
    """On rank 1, when ``when["now"]`` is set, entry 5 of fc1.weight's gradient becomes ``value`` (a tensor hook:
    it runs before Horovod's hook reduces the gradient)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if when["now"] and hvd.rank() == 1:
            grad = grad.clone()
            grad.view(-1)[5] = value
        return grad

    model.fc1.weight.register_hook(hook)


@pytest.mark.parametrize("selector", ["sampled", "exact"])
def test_a_nonfinite_gradient_on_one_rank_skips_the_amp_step_everywhere_and_keeps_the_residual(selector):
    torch.manual_seed(0)
    model = Net()
    compressor = TopKEF(ratio=0.05, min_numel=1000, selector=selector)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    when = {"now": False}
    _inject(model, when, float("inf"))
    seen = []
    for step in range(4):
        when["now"] = step == 2
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        record = compressor.registry.records.get("fc1.weight")
        residual_before = None if record is None else record.residual.clone()
        opt.zero_grad()
        x, tokens, y = batch(step)
        loss = nn.functional.cross_entropy(model(x, tokens, True), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        averaged_finite = bool(torch.isfinite(model.fc1.weight.grad).all())
        scale = scaler.get_scale()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        residual = compressor.registry.records["fc1.weight"].residual
        seen.append((averaged_finite, moved, scale, residual_before, residual.clone()))
    # every rank: the poisoned step (2) reached everyone as non-finite, was skipped, and the scale was halved
    assert [s[0] for s in seen] == [True, True, False, True]
    assert [s[1] for s in seen] == [True, True, False, True]
    assert seen[3][2] == seen[2][2] / 2
    for averaged_finite, moved, scale, residual_before, residual in seen:
        assert torch.isfinite(residual).all()
    if hvd.rank() == 1:
        # the injected entry never entered the residual: it kept its value through the poisoned step
        assert seen[2][4].view(-1)[5] == seen[2][3].view(-1)[5]
        assert compressor.stats()["nonfinite_steps"] == 1
    else:
        assert compressor.stats()["nonfinite_steps"] == 0


def test_nan_without_a_scaler_reaches_every_rank_like_a_dense_allreduce():
    torch.manual_seed(0)
    model = Net()
    compressor = TopKEF(ratio=0.05, min_numel=1000)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor)
    when = {"now": True}
    _inject(model, when, float("nan"))
    opt.zero_grad()
    x, tokens, y = batch(0)
    nn.functional.cross_entropy(model(x, tokens, True), y).backward()
    opt.synchronize()
    grad = model.fc1.weight.grad.view(-1)
    assert torch.isnan(grad[5]) and int(torch.isnan(grad).sum()) == 1
    assert torch.isfinite(compressor.registry.records["fc1.weight"].residual).all()


class OddShapes(nn.Module):
    """A 0-d parameter, an empty one, and an ordinary matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.nothing = nn.Parameter(torch.empty(0))
        self.weight = nn.Parameter(torch.randn(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.scale + self.nothing.sum()


def _train_odd(compression, steps=3):
    torch.manual_seed(0)
    model = OddShapes()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 * hvd.rank() + step)
        opt.zero_grad()
        model(torch.randn(8, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_zero_dim_and_empty_parameters_train_like_plain_horovod():
    compressor = TopKEF(ratio=1.0, min_numel=0, dense_fallback=False)
    ours = _train_odd(compressor)
    plain = _train_odd(hvd.Compression.none)
    for name in plain:
        torch.testing.assert_close(ours[name], plain[name])
    routes = {n: r.residual is not None for n, r in compressor.registry}
    assert routes == {"scale": True, "nothing": False, "weight": True}  # the 0-d one goes Top-K with k = 1
