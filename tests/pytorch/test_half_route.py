"""ratio="auto"'s fp16 route on one rank (torch.half_route.to_half): what float16 does not carry stays in the
residual, a sum of P ranks' values cannot overflow, and non-finite gradients are sent but never kept."""
import pytest
import torch

from horovod_topk.torch import kernels
from horovod_topk.torch.half_route import FLOAT16_MAX, HalfHandle, to_half


def _carried(sent: torch.Tensor, scale: float) -> torch.Tensor:
    return sent.double() / scale


@pytest.mark.parametrize("world_size", [2, 8])
def test_what_float16_does_not_carry_stays_in_the_residual(world_size):
    torch.manual_seed(0)
    scale = 1.0 / world_size
    grad = torch.randn(10_000) * torch.logspace(-9, 3, 10_000)  # below float16's subnormals up to large values
    residual = torch.randn(10_000) * 1e-4
    acc = grad.double() + residual.double()
    sent, nonfinite = to_half(grad, residual, scale, world_size)
    assert sent.dtype == torch.float16 and nonfinite == 0
    # exact error feedback: what travelled plus what stays is what there was (float32 rounding of the residual)
    torch.testing.assert_close(_carried(sent, scale) + residual.double(), acc, rtol=1.2e-7, atol=1e-12)
    assert torch.count_nonzero(residual) > 0  # rounding and underflow did stay
    # the residual is at most half a float16 step of the value (relative 2**-11) where nothing was clamped
    assert bool((residual.double().abs() <= acc.abs() * 2 ** -11 / (1 - 2 ** -11) + 2 ** -25 / scale).all())


@pytest.mark.parametrize("world_size", [3, 4, 7])
def test_the_sum_of_every_rank_cannot_overflow_and_the_clamped_part_waits(world_size):
    scale = 1.0 / world_size
    grad = torch.tensor([1e6, -3e5, 70000.0, 1.0])
    residual = torch.zeros(4)
    sent, _ = to_half(grad, residual, scale, world_size)
    assert bool(torch.isfinite(sent).all()) and float(sent.float().abs().max()) <= FLOAT16_MAX / world_size
    total = sent
    for _ in range(world_size - 1):  # P ranks' sum, rounded to float16 at every step as a reduction does
        total = (total.float() + sent.float()).half()
    assert bool(torch.isfinite(total).all())
    torch.testing.assert_close(_carried(sent, scale) + residual.double(), grad.double(), rtol=1e-7, atol=0)
    # later steps send what was cut: a zero gradient keeps draining the residual, nothing is lost
    total = _carried(sent, scale)
    for _ in range(200):
        sent, _ = to_half(torch.zeros(4), residual, scale, world_size)
        total += _carried(sent, scale)
    torch.testing.assert_close(total + residual.double(), grad.double(), rtol=1e-7, atol=0)
    assert float(residual.abs().max()) < 1e-2


def test_a_non_finite_gradient_is_sent_as_such_and_never_kept():
    grad = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.5, 1e6])
    residual = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    sent, nonfinite = to_half(grad, residual, 0.5, 2)
    assert nonfinite == 1
    assert torch.isnan(sent[0]) and sent[1] == float("inf") and sent[2] == -float("inf")
    # the residual keeps its old values where the gradient was not finite, and stays finite everywhere
    assert residual[:3].tolist() == pytest.approx([0.1, 0.2, 0.3]) and bool(torch.isfinite(residual).all())
    torch.testing.assert_close(_carried(sent[3:], 0.5) + residual[3:].double(), torch.tensor([0.9, 1e6]).double(),
                               rtol=1e-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_kernel_and_the_torch_operations_give_the_same_bits(monkeypatch, dtype):
    if kernels.load() is None:
        pytest.skip("no compiler here: only the torch operations run")
    torch.manual_seed(2)
    n = 100_003  # not a multiple of the kernel's 8 lanes
    grad = (torch.randn(n) * torch.logspace(-10, 6, n)).to(dtype)
    grad[[5, 77, 100_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    residual = (torch.randn(n) * 1e-3).to(dtype)
    fused_residual, plain_residual = residual.clone(), residual.clone()
    for scale, world_size in ((0.5, 2), (0.125, 8), (3.0, 2)):  # 3.0: a postscale that overflows some values
        fused, fused_bad = to_half(grad, fused_residual, scale, world_size)
        with monkeypatch.context() as m:
            m.setattr(kernels, "load", lambda: None)
            plain, plain_bad = to_half(grad, plain_residual, scale, world_size)
        assert fused_bad == plain_bad == 1
        torch.testing.assert_close(fused, plain, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(fused_residual, plain_residual, rtol=0, atol=0)
        assert bool(torch.isfinite(fused_residual).all())
    # into a slice of a larger buffer, as a bucket does
    buffer = torch.zeros(n + 10, dtype=torch.float16)
    again = residual.clone()
    to_half(grad, again, 0.5, 2, out=buffer[5:5 + n])
    torch.testing.assert_close(buffer[5:5 + n], to_half(grad, residual.clone(), 0.5, 2)[0], rtol=0, atol=0,
                               equal_nan=True)
    assert buffer[:5].abs().sum() == 0 and buffer[5 + n:].abs().sum() == 0


def test_a_zero_scale_is_refused_by_name():
    with pytest.raises(ValueError, match="scaled by 0"):
        to_half(torch.ones(3), torch.zeros(3), 0.0, 2)


def test_the_handle_writes_the_sum_over_the_gradient_in_its_shape():
    out = torch.zeros(6)
    summed = torch.arange(6, dtype=torch.float16)
    waited = []
    handle = HalfHandle("h", lambda h: waited.append(h) or summed, out, (2, 3))
    result = handle()
    assert result.shape == (2, 3) and result.data_ptr() == out.data_ptr() and out.tolist() == list(range(6))
    assert handle() is result and waited == ["h"]  # waited once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_no_host_synchronisation_and_the_same_values_as_the_cpu():
    torch.manual_seed(1)
    grad = torch.randn(1 << 20) * 100
    grad[7] = float("nan")
    residual = torch.randn(1 << 20) * 1e-3
    cpu_residual = residual.clone()
    cpu_sent, cpu_bad = to_half(grad, cpu_residual, 0.25, 4)
    device_grad, device_residual = grad.cuda(), residual.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host read of a device value raises
    try:
        sent, bad = to_half(device_grad, device_residual, 0.25, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert isinstance(bad, torch.Tensor) and int(bad) == cpu_bad == 1
    torch.testing.assert_close(sent.cpu(), cpu_sent, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(device_residual.cpu(), cpu_residual, rtol=0, atol=0)
