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


def test_row_signs_are_balanced_independent_per_salt_and_reproducible():
    from horovod_topk.core.update_mode import sketch_salt

    cpu = torch.device("cpu")
    a = update_rule.row_signs(100_000, sketch_salt(1, 0), cpu)
    b = update_rule.row_signs(100_000, sketch_salt(2, 0), cpu)
    assert set(a.unique().tolist()) == {-1.0, 1.0} and a.dtype == torch.float32
    assert torch.equal(a, update_rule.row_signs(100_000, sketch_salt(1, 0), cpu))
    for statistic in (a.mean(), (a * b).mean(), (a[1:] * a[:-1]).mean()):  # 5 sigma of an iid sign
        assert abs(float(statistic)) < 5 / 100_000 ** 0.5
    assert torch.equal(update_rule.row_signs(10, 5, cpu), update_rule.row_signs(1000, 5, cpu)[:10])  # by index
    from horovod_topk.core.update_mode import row_sign  # the definition TensorFlow vectorises too

    salt = sketch_salt(9, 4)
    assert update_rule.row_signs(500, salt, cpu).tolist() == [float(row_sign(r, salt)) for r in range(500)]


@pytest.mark.parametrize("numel", [1, 40, 64, 65, 1000])
def test_the_sketch_is_linear_and_ends_with_the_exact_squared_norm(numel):
    gen = torch.Generator().manual_seed(numel)
    a, b = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    out_a, out_b, out_sum = torch.empty(65), torch.empty(65), torch.empty(65)
    for out, x in ((out_a, a), (out_b, b), (out_sum, a + b)):
        update_rule.sketch_into(out, x, salt=99)
    torch.testing.assert_close(out_a[:64] + out_b[:64], out_sum[:64])
    torch.testing.assert_close(out_a[64], a.square().sum())
    if numel <= 64:  # one row: the sketch is the tensor up to one sign, its norm exact
        torch.testing.assert_close(out_a[:64].square().sum(), a.square().sum())


@pytest.mark.parametrize("offset, spread_bounds", [(0.0, (0.12, 0.25)), (0.5, (0.2, 0.45))])
def test_the_sketch_estimates_the_squared_norm_without_bias_over_fresh_signs(offset, spread_bounds):
    """Unbiased whatever the gradient's structure; the relative spread is about sqrt(2 / 64) = 0.18 for entries
    without a common offset, and larger with one (every bucket holds each row's offset with that row's sign, so
    the buckets move together): measured 0.33 at an offset of half the entries' spread."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) + offset
    out = torch.empty(65)
    estimates = []
    for salt in range(400):
        update_rule.sketch_into(out, x, salt=salt * 7919)
        estimates.append(float(out[:64].square().sum()))
    exact = float(x.square().sum())
    mean = sum(estimates) / len(estimates)
    spread = (sum((e - mean) ** 2 for e in estimates) / len(estimates)) ** 0.5 / exact
    assert abs(mean / exact - 1) < 5 * spread / len(estimates) ** 0.5  # 5 standard errors of the mean
    assert spread_bounds[0] < spread < spread_bounds[1]


def test_noise_shares_are_clamped_to_one_over_p_and_one_and_1_for_zero_gradients():
    width, world = 4, 4
    signal = torch.tensor([1.0, 2.0, 0.0, 0.0])
    rows = []
    for sketch_sum, norm_sum in ((world * signal, world * signal.square().sum()),  # every rank alike: share 1
                                 (signal, world * signal.square().sum()),  # ||sum||^2 = ||g||^2: 1 / P^2 -> 1/P
                                 (2 * signal, world * signal.square().sum()),  # 4 / 16 = 1/4 = 1/P exactly
                                 (3 * signal, world * signal.square().sum()),  # 9 / 16
                                 (torch.zeros(width), torch.tensor(0.0))):  # no gradient anywhere
        rows.append(torch.cat([sketch_sum, norm_sum.reshape(1)]))
    shares = update_rule.noise_shares(torch.stack(rows), world)
    torch.testing.assert_close(shares, torch.tensor([1.0, 0.25, 0.25, 9 / 16, 1.0]))
