"""ratio="auto"'s int8 route on one process (torch.int8_route): P ranks' words summed as an int32 allreduce sums
them (here: torch's own int32 sum), read back exactly; no overflow at the grid's extremes; what the grid does not
carry stays in each rank's residual; a rank's NaN makes the tensor NaN and never enters a residual."""
import pytest
import torch

from horovod_topk.core.exchange import int8_lane_limit, int8_offered, int8_word_bias
from horovod_topk.torch.int8_route import SPREAD, from_int8, int8_words, to_int8


def reduce_ranks(grads, residuals, scale, world_size, reference):
    """Each rank's words, their int32 sum (what Horovod's Sum allreduce returns), and the decoded result."""
    sent = [to_int8(g, r, scale, world_size, reference) for g, r in zip(grads, residuals)]
    words = torch.stack([w for w, _, _ in sent]).sum(0, dtype=torch.int32)
    delta = sent[0][2]
    out = torch.empty(grads[0].numel())
    result, next_reference = from_int8(words, grads[0].numel(), world_size, delta, out)
    return sent, result, next_reference, delta


@pytest.mark.parametrize("world_size, numel", [(2, 1), (4, 10_001), (8, 4096), (127, 7)])
def test_the_sum_is_exact_and_error_feedback_keeps_the_rest(world_size, numel):
    torch.manual_seed(world_size)
    scale = 1.0 / world_size
    grads = [torch.randn(numel) * 3 for _ in range(world_size)]
    residuals = [torch.randn(numel) * 0.01 for _ in range(world_size)]
    before = [g.double() + r.double() for g, r in zip(grads, residuals)]
    reference = 1.0
    sent, result, next_reference, delta = reduce_ranks(grads, residuals, scale, world_size, reference)
    limit = int8_lane_limit(world_size)
    assert delta == pytest.approx(SPREAD * reference / (limit * world_size))
    # each rank: what its integers carried (q x delta / scale) plus what stayed is what it had
    steps = [(b - r.double()) * scale / delta for b, r in zip(before, residuals)]
    for s in steps:
        assert torch.allclose(s, s.round(), atol=1e-4) and float(s.abs().max()) <= limit + 1e-4
    summed = sum(s.round() for s in steps)  # the ranks' integer sums, read back exactly
    assert torch.equal(result, summed.float().mul_(delta))
    assert next_reference == pytest.approx(float(result.abs().max()))
    assert [w.numel() for w, _, _ in sent] == [int8_words(numel)] * world_size


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 127])
def test_no_overflow_when_every_rank_sits_on_the_grid_edge(world_size):
    """Every rank at +L (or -L) in every lane: the word sum is the largest in magnitude; each lane reads back
    exactly P x L, never a neighbour's carry."""
    numel = 9
    for sign in (1.0, -1.0):
        grads = [torch.full((numel,), sign * 1e6) for _ in range(world_size)]  # clamped to the edge
        residuals = [torch.zeros(numel) for _ in range(world_size)]
        _, result, _, delta = reduce_ranks(grads, residuals, 1.0, world_size, 1.0)
        assert torch.equal(result, torch.full((numel,), sign * world_size * int8_lane_limit(world_size) * delta))
        assert all(bool((r != 0).all()) for r in residuals)  # what the clamp cut waits in the residual


def test_a_nan_on_one_rank_makes_the_tensor_nan_and_stays_out_of_every_residual():
    world_size = 4
    grads = [torch.randn(100) for _ in range(world_size)]
    grads[2][17] = float("nan")
    grads[3][5] = float("inf")
    residuals = [torch.full((100,), 0.5) for _ in range(world_size)]
    sent, result, next_reference, _ = reduce_ranks(grads, residuals, 0.25, world_size, 2.0)
    assert [bad for _, bad, _ in sent] == [0, 0, 1, 1]
    assert bool(torch.isnan(result).all()) and next_reference == 0.0  # the next step goes fp16
    assert all(bool(torch.isfinite(r).all()) for r in residuals)
    assert float(residuals[2][17]) == 0.5 and float(residuals[3][5]) == 0.5  # untouched where not finite


def test_bias_and_limits():
    assert [int8_lane_limit(p) for p in (1, 2, 4, 8, 16, 64, 127, 128)] == [127, 63, 31, 15, 7, 1, 1, 0]
    assert int8_word_bias(31) == 31 * (1 + 2 ** 8 + 2 ** 16 + 2 ** 24)
    assert 127 * int8_word_bias(1) < 2 ** 31  # P ranks' word sum stays an int32
    assert [int8_offered(p) for p in (2, 3, 4, 5, 8, 16)] == [True, True, True, False, False, False]


def test_a_grid_without_a_reference_is_refused():
    with pytest.raises(ValueError, match="no int8 grid"):
        to_int8(torch.ones(4), torch.zeros(4), 0.5, 2, 0.0)
    with pytest.raises(ValueError, match="no int8 grid"):
        to_int8(torch.ones(4), torch.zeros(4), 0.5, 128, 1.0)


@pytest.mark.parametrize("grad_dtype, residual_dtype", [(torch.float32, torch.float32),
                                                        (torch.float64, torch.float64),
                                                        (torch.float32, torch.float64)])
def test_the_fused_kernel_and_the_torch_operations_give_the_same_bits(monkeypatch, grad_dtype, residual_dtype):
    from horovod_topk.torch import kernels

    if kernels.load() is None:
        pytest.skip("no C++ compiler: the torch operations are the only path")
    torch.manual_seed(0)
    world_size, numel = 4, 10_003
    grad = (torch.randn(numel) * torch.logspace(-6, 2, numel)).to(grad_dtype)
    grad[7] = float("nan")
    residual = (torch.randn(numel) * 1e-3).to(residual_dtype)
    results = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(kernels, "load", lambda: None)
            r = residual.clone()
            words, bad, delta = to_int8(grad, r, 0.25, world_size, 3.0)
            summed = words * world_size  # every rank sending the same words: a valid sum
            summed[-1] = 0
            out = torch.empty(numel, dtype=grad_dtype)
            result, reference = from_int8(summed, numel, world_size, delta, out)
            results.append((words, bad, r, result.clone(), reference))
    (w1, b1, r1, o1, ref1), (w2, b2, r2, o2, ref2) = results
    assert torch.equal(w1, w2) and b1 == b2 == 1 and ref1 == ref2 > 0
    assert torch.equal(r1, r2) and torch.equal(o1, o2)


def test_ties_round_to_even_in_the_fused_kernel_as_in_torch(monkeypatch):
    from horovod_topk.torch import kernels

    if kernels.load() is None:
        pytest.skip("no C++ compiler: the torch operations are the only path")
    world_size, limit = 4, int8_lane_limit(4)
    # a reference whose grid step is 2^-5: scale / delta = 8 exactly, so (k + 1/2) / 8 lands on a tie
    reference = 2.0 ** -5 * limit * world_size / SPREAD
    grad = (torch.arange(-limit - 2, limit + 2, dtype=torch.float32) + 0.5) / 8
    sent = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(kernels, "load", lambda: None)
            residual = torch.zeros_like(grad)
            words, _, delta = to_int8(grad, residual, 0.25, world_size, reference)
            assert delta == 2.0 ** -5
            steps = words[:-1].add(int8_word_bias(limit)).view(torch.uint8)[:grad.numel()].to(torch.int64) - limit
            sent.append((steps, residual))
    (fused_steps, fused_residual), (torch_steps, torch_residual) = sent
    assert torch.equal(fused_steps, torch_steps) and torch.equal(fused_residual, torch_residual)
    expected = torch.round(grad * 8).clamp(-limit, limit).to(torch.int64)  # half to even: 0.5 -> 0, 1.5 -> 2
    assert torch.equal(fused_steps, expected)
    assert fused_steps[limit + 2].item() == 0 and fused_steps[limit + 3].item() == 2  # +0.5 and +1.5
