"""The math of update mode (horovod_topk.torch.update_rule) against torch's own Adam/AdamW and plain formulas."""
import pytest
import torch

from horovod_topk.torch import update_rule


@pytest.mark.parametrize("numel, block", [(1000, 256), (1024, 256), (7, 256), (300, 1), (257, 16)])
def test_block_reductions_match_a_plain_loop_including_the_short_tail(numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    chunks = x.split(block)
    assert update_rule.block_count(numel, block) == len(chunks)
    torch.testing.assert_close(update_rule.block_means(x, block), torch.stack([c.mean() for c in chunks]))
    torch.testing.assert_close(update_rule.block_mean_squares(x, block),
                               torch.stack([c.square().mean() for c in chunks]))
    scales = torch.rand(len(chunks))
    expected = torch.cat([c * s for c, s in zip(chunks, scales)])
    torch.testing.assert_close(update_rule.scale_by_blocks(x, scales, block), expected)
    torch.testing.assert_close(update_rule.expand_blocks(scales, numel, block),
                               torch.cat([s.expand(len(c)) for c, s in zip(chunks, scales)]))


def test_a_non_finite_entry_makes_its_block_non_finite_only():
    g = torch.ones(600)
    g[300] = float("nan")
    squares = update_rule.block_mean_squares(g, 256)
    assert torch.isfinite(squares[[0, 2]]).all() and torch.isnan(squares[1])


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
def test_with_its_own_second_moment_the_update_is_torchs(optimizer):
    """One rank, the second moment per entry from its own gradient: exactly what torch.optim.Adam/AdamW do."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(64, 33, generator=gen)
    reference = torch.nn.Parameter(param.clone())
    options = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = getattr(torch.optim, optimizer)([reference], **options)
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    for step in range(1, 6):
        grad = torch.randn(64, 33, generator=gen)
        before = reference.detach().clone()
        reference.grad = grad.clone()
        opt.step()
        update_rule.update_second_moment(v, grad.square() if optimizer == "AdamW" else
                                         (grad + 0.1 * param).square(), 0.95)
        ours = update_rule.adam_update(param, grad, m, v, step, lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8,
                                       weight_decay=0.1, decoupled=optimizer == "AdamW")
        # before - after is read back from float32 parameters (|p| < 4): their rounding is allowed
        torch.testing.assert_close(ours, before - reference.detach(), rtol=1e-4, atol=1e-6)
        param = param - ours
        torch.testing.assert_close(param, reference.detach(), rtol=1e-5, atol=1e-6)


def test_block_second_moment_of_one_entry_per_block_is_the_per_entry_one():
    gen = torch.Generator().manual_seed(1)
    param, grad = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    v_entry, v_block = grad.square() * 0.05, update_rule.block_mean_squares(grad, 1) * 0.05
    kwargs = dict(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
    per_entry = update_rule.adam_update(param, grad, torch.zeros(100), v_entry, 1, **kwargs)
    per_block = update_rule.adam_update(param, grad, torch.zeros(100), v_block, 1, block=1, **kwargs)
    torch.testing.assert_close(per_block, per_entry)
