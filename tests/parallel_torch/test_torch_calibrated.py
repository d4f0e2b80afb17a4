"""Update mode's calibrated second moment (TopKEF(target="update", second_moment="calibrated")) on real Horovod
workers: each rank's own Adam moments, its squared gradient scaled by the tensor's noise share (one allreduce of
sketches). Checked here: the first step against an independent reference with the exact share, the error-feedback
invariant from the state the step left, bit-identical parameters, continuing from a gradient-mode Adam state, and
the refusals. Non-finite skips, mixed precision, the start-up broadcast and exact resume run in
test_torch_update_mode.py, parametrized over the second moments."""
import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.torch import TopKEF

from .test_torch_update_mode import (FACTORIES, assert_error_feedback_invariant, first_step, gradient_mode_adam_state,
                                     identical_across_ranks)
from .torch_harness import Net, batch

CALIBRATED = dict(target="update", second_moment="calibrated")


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_first_step_matches_an_independent_reference_with_the_exact_share(factory):
    """Step 1 from a fresh state: m/(1 - b1) = g_i and v/(1 - b2) = g_i**2 * s, with s the tensor's share
    ||sum_i g_i||**2 / (P sum_i ||g_i||**2) clamped to [1/P, 1]; a sketch as wide as the tensor is exact, so the
    averaged update is mean_i lr * g_i / (|g_i| sqrt(s) + eps) (+ AdamW's decay lr * wd * p). Adam's L2 decay
    joins the gradient: g_i + wd * p."""
    lr, eps = 0.01, 1e-8
    make, wd, decoupled = FACTORIES[factory]
    widest = max(p.numel() for p in Net().parameters())
    initial, ours, grads = first_step(
        TopKEF(ratio=1.0, min_numel=0, dense_fallback=False, second_moment_sketch=widest, **CALIBRATED), make)
    world = hvd.size()
    shares = []
    for name, p0 in initial.items():
        every = grads[name]  # (ranks, *shape)
        if not decoupled:
            every = every + wd * p0.double()
        total = every.square().sum()
        share = (every.sum(0).square().sum() / (world * total)).clamp(1.0 / world, 1.0) if total > 0 else 1.0
        shares.append(float(share))
        local = lr * every / (every.abs() * share ** 0.5 + eps)
        decay = lr * wd * p0.double() if decoupled else 0.0
        expected = p0.double() - local.mean(0) - decay
        torch.testing.assert_close(ours[name].double(), expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert min(shares) < 1.0  # the ranks' gradients differ: some share is not 1, so the scaling was exercised


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_error_feedback_invariant_and_identical_parameters(exchange):
    """Each rank's local update recomputed from the Adam state its step left: lr * m_hat / (sqrt(v_hat) + eps)."""
    lr, betas, eps = 0.01, (0.9, 0.999), 1e-8
    torch.manual_seed(0)
    model = Net()
    compressor = TopKEF(ratio=0.05, min_numel=0, dense_fallback=False, exchange=exchange, **CALIBRATED)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=eps),
                                   named_parameters=model.named_parameters(), compression=compressor)

    def local_update(name: str, p: torch.Tensor, before: torch.Tensor, step: int) -> torch.Tensor:
        state = opt.state[p]
        assert int(state["step"]) == step + 1
        m_hat = state["exp_avg"].double() / (1 - betas[0] ** (step + 1))
        v_hat = state["exp_avg_sq"].double() / (1 - betas[1] ** (step + 1))
        return lr * m_hat / (v_hat.sqrt() + eps)

    assert_error_feedback_invariant(model, opt, compressor, local_update)
    moments = {n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters()}
    assert identical_across_ranks(moments, "own_moment") != []  # each rank's second moment is its own


def test_the_second_moment_is_smaller_than_the_ranks_own_by_the_noise_share():
    """Against a local Adam on the same gradients: the calibrated second moment is the local one times a share in
    [1/P, 1] at step 1 (the same per tensor), and below it where the ranks' gradients disagree."""
    torch.manual_seed(0)
    moments = {}
    for mode in ("local", "calibrated"):
        torch.manual_seed(0)
        model = Net()
        compressor = TopKEF(ratio=1.0, target="update", second_moment=mode)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=compressor)
        opt.zero_grad()
        x, tokens, y = batch(0)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        opt.step()
        assert ("noise_share" in compressor.stats()) == (mode == "calibrated")
        moments[mode] = {n: opt.state[p]["exp_avg_sq"].double() for n, p in model.named_parameters()}
    world = hvd.size()
    below = 0
    for name, local in moments["local"].items():
        calibrated = moments["calibrated"][name]
        seen = local > 0
        if not bool(seen.any()):
            continue
        ratio = calibrated[seen] / local[seen]
        torch.testing.assert_close(ratio, ratio[0].expand_as(ratio), rtol=1e-4, atol=0.0)  # one share per tensor
        assert 1.0 / world - 1e-6 <= float(ratio[0]) <= 1.0 + 1e-6, (name, float(ratio[0]))
        below += float(ratio[0]) < 0.99
    assert below >= 1
    summary = compressor.stats()["noise_share"]  # the calibrated run's shares: what the ratios above measured
    assert 1.0 / world - 1e-6 <= summary["min"] <= summary["mean"] <= summary["max"] <= 1.0 + 1e-6
    assert summary["min"] < 0.99


def test_a_gradient_mode_adam_state_is_continued():
    """A gradient-mode Adam checkpoint loaded on rank 0 and broadcast: the calibrated second moment continues from
    Adam's own moments and step (the same keys), then each rank's moments move on their own."""
    saved = gradient_mode_adam_state()
    model = Net()
    update = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(), compression=TopKEF(**CALIBRATED))
    if hvd.rank() == 0:
        update.load_state_dict(saved)
    hvd.broadcast_optimizer_state(update, root_rank=0)
    params = [q for g in update.param_groups for q in g["params"]]
    for index, p in enumerate(params):
        torch.testing.assert_close(update.state[p]["exp_avg_sq"], saved["state"][index]["exp_avg_sq"])
        assert float(update.state[p]["step"]) == 2
    update.zero_grad()
    x, tokens, y = batch(2)
    nn.functional.cross_entropy(model(x, tokens, True), y).backward()
    update.step()
    assert all(float(update.state[p]["step"]) == 3 for p in params)
    assert identical_across_ranks({n: p.detach() for n, p in model.named_parameters()}) == []


def test_what_cannot_be_computed_is_refused_by_name():
    model = Net()
    params = list(model.parameters())

    def wrap(optimizer, **options):
        return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        compression=TopKEF(**CALIBRATED, **options))

    assert wrap(torch.optim.AdamW(params, lr=0.1)).topk_update_step.second_moment == "calibrated"
    with pytest.raises(ValueError, match=r"second_moment='calibrated'.*SGD"):
        wrap(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        wrap(torch.optim.Adam(params, lr=0.1, amsgrad=True))
    with pytest.raises(ValueError, match="second_moment_sketch must be a positive integer"):
        TopKEF(**CALIBRATED, second_moment_sketch=0)
    with pytest.raises(ValueError, match="apply to target='update' only"):
        TopKEF(target="gradient", second_moment_sketch=32)


def test_a_state_of_the_shared_second_moment_is_refused_by_name():
    torch.manual_seed(0)
    model = Net()
    shared = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression=TopKEF(target="update", second_moment="shared"))
    hvd.broadcast_optimizer_state(shared, root_rank=0)
    saved = shared.state_dict()
    model = Net()
    calibrated = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                          named_parameters=model.named_parameters(), compression=TopKEF(**CALIBRATED))
    calibrated.load_state_dict(saved)
    with pytest.raises(ValueError, match="not Adam's"):
        hvd.broadcast_optimizer_state(calibrated, root_rank=0)
