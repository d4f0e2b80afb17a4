"""What code written for plain Horovod relies on, on real workers: ``.grad`` between ``backward()`` and
``synchronize()``, and several distributed optimizers given one TopKEF (the class, or one object)."""
import copy

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.torch import TopKEF, restore_state

EVERYTHING = dict(ratio=1.0, min_numel=0, dense_fallback=False)


def _data(step):
    gen = torch.Generator().manual_seed(100 * hvd.rank() + step)
    return torch.randn(8, 64, generator=gen)


@pytest.mark.parametrize("selector", ["sampled", "exact"])
@pytest.mark.parametrize("ratio", [0.01, 1.0])
def test_grad_holds_this_ranks_gradient_until_synchronize(selector, ratio):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    reference = copy.deepcopy(model)  # the same model without Horovod: this rank's own gradient
    compressor = TopKEF(ratio=ratio, min_numel=0, selector=selector, dense_fallback=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=compressor)
    seen, averaged = [], []
    for step in range(3):
        opt.zero_grad()
        reference.zero_grad()
        model(_data(step)).square().sum().backward()
        reference(_data(step)).square().sum().backward()
        # the compressed reductions are in flight now: .grad must still be this rank's gradient
        seen.append([(p.grad.clone(), r.grad.clone()) for p, r in zip(model.parameters(), reference.parameters())])
        opt.synchronize()
        averaged.append([(p.grad.clone(), hvd.allreduce(r.grad, name=f"grad.{step}.{i}"))
                         for i, (p, r) in enumerate(zip(model.parameters(), reference.parameters()))])
        with opt.skip_synchronize():
            opt.step()
    assert compressor.stats()["tensors_compressed"] == 4
    for step in seen:
        for grad, own in step:
            torch.testing.assert_close(grad, own, rtol=0, atol=0)
    if ratio == 1.0:  # every entry sent: synchronize() writes the average, as plain Horovod does
        for step in averaged:
            for grad, average in step:
                torch.testing.assert_close(grad, average)


def _gan(size):
    torch.manual_seed(1)
    return nn.Conv2d(1, size, 1), nn.Conv2d(size, 1, 1)


@pytest.mark.parametrize("passed", ["class", "object"])
def test_dynamic_requires_grad_with_one_compressor_for_two_optimizers(passed):
    """Horovod's own test_dynamic_requires_grad (GAN: generator and discriminator, both with a 'weight' and a
    'bias' of other shapes), with TopKEF passed to both optimizers; once tiny (dense), once compressed."""
    TopKEF.reset()
    for size in (10, 2048):
        compression = TopKEF if passed == "class" else TopKEF(min_numel=1000)
        gen, disc = _gan(size)
        inp = torch.rand([1, 1, 10, 10])
        gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                           named_parameters=gen.named_parameters(), compression=compression)
        disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                            named_parameters=disc.named_parameters(), compression=compression)
        for _ in range(3):
            for train_gen in (True, False):
                for p in gen.parameters():
                    p.requires_grad_(train_gen)
                for p in disc.parameters():
                    p.requires_grad_(not train_gen)
                gen_opt.zero_grad()
                disc_opt.zero_grad()
                disc(gen(inp)).sum().backward()
                for p in (gen if train_gen else disc).parameters():
                    assert p.grad is not None and p.grad.abs().max() > 0
                (gen_opt if train_gen else disc_opt).step()
        owner = TopKEF.default() if passed == "class" else compression
        scopes = gen_opt._compression.scope, disc_opt._compression.scope
        assert scopes[0] != scopes[1]
        records = owner.registry.records
        for scope, module in zip(scopes, (gen, disc)):
            for name, p in module.named_parameters():
                assert records[scope + name].shape == tuple(p.shape)
        if size > 1000:  # the 2048-channel weights were compressed, each with a residual of its own
            assert all(records[scope + "weight"].residual is not None for scope in scopes)
    assert TopKEF.stats()["tensors_compressed"] >= (2 if passed == "class" else 0)
    TopKEF.reset()


def _twins():
    torch.manual_seed(2)
    return nn.Linear(64, 64), nn.Linear(64, 64)  # same names, same shapes: only separate state keeps them apart


def _train_twins(compression, steps=4):
    a, b = _twins()
    opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                     compression=compression) for m in (a, b)]
    for step in range(steps):
        for model, opt in zip((a, b), opts):
            opt.zero_grad()
            model(_data(step)).square().mean().backward()
            opt.step()
    return [p.detach().clone() for m in (a, b) for p in m.parameters()]


def test_two_optimizers_with_the_same_names_and_shapes_match_plain_horovod():
    plain = _train_twins(hvd.Compression.none)
    compressor = TopKEF(**EVERYTHING)
    ours = _train_twins(compressor)
    for mine, theirs in zip(ours, plain):
        torch.testing.assert_close(mine, theirs)
    assert sorted(compressor.registry.records) == ["bias", "optimizer1/bias", "optimizer1/weight", "weight"]


def test_state_of_two_optimizers_round_trips_through_a_checkpoint():
    compressor = TopKEF(ratio=0.05, min_numel=0)
    _train_twins(compressor, steps=2)
    saved = compressor.state_dict()
    restored = TopKEF(ratio=0.05, min_numel=0)
    restored.load_state_dict(saved)
    for name, record in compressor.registry:
        torch.testing.assert_close(restored.registry.records[name].residual, record.residual)
    assert restored.stats()["bytes_sent"] == compressor.stats()["bytes_sent"] > 0
    # and through the all-ranks checkpoint helpers
    again = TopKEF(ratio=0.05, min_numel=0)
    from horovod_topk.torch import gather_state
    state = gather_state(compressor)
    restore_state(again, state)
    for name, record in compressor.registry:
        torch.testing.assert_close(again.registry.records[name].residual, record.residual)


@pytest.mark.parametrize("target", ["gradient", "update"])
def test_an_optimizer_built_by_horovods_own_function_is_refused_by_name(target):
    """A reference to Horovod's DistributedOptimizer taken before horovod-topk routed Horovod builds an optimizer
    without TopKEF's per-optimizer set-up (update mode would silently send gradients): its first backward raises,
    on every rank alike, before any collective."""
    horovods_own = hvd.DistributedOptimizer.__wrapped__  # what such a reference holds
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = horovods_own(torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                       compression=TopKEF(ratio=0.1, min_numel=0, target=target))
    assert not hasattr(opt, "topk_update_step")
    with pytest.raises(ValueError, match="optimizer built by Horovod's own DistributedOptimizer.*Import "
                                         "horovod_topk.torch"):
        model(_data(0)).square().sum().backward()
