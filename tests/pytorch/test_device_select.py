"""The device selection path (horovod_topk/torch/device_select.py), run on the CPU with the same torch ops it
runs on a GPU: the same selections as the reference (ops), bit for bit, on every kind of gradient."""
import math

import pytest
import torch

from horovod_topk.core import PayloadLayout
from horovod_topk.torch import device_select, ops, selection


def reference_step(grad, residual, k, wire, momentum_buffer=None, momentum=0.0):
    out = ops.compensate_nonfinite(grad, residual, k, wire, momentum_buffer, momentum)
    if out is not None:
        return out[0], out[1], 1
    return (*ops.compensate_and_select(grad, residual, k, wire, momentum_buffer, momentum), 0)


def gradients(kind, n, gen):
    if kind == "gaussian":
        return torch.randn(n, generator=gen)
    if kind == "heavy_tailed":  # Cauchy: a few entries dwarf the rest
        return torch.tan(math.pi * (torch.rand(n, generator=gen) - 0.5))
    if kind == "misleading_sample":
        # almost every entry tiny, and the large ones where a strided sample does not look: a sampled threshold
        # would land far too low or too high (the kernel's rescan case)
        g = torch.randn(n, generator=gen) * 1e-6
        g[7::997] = torch.randn(g[7::997].numel(), generator=gen) * 1e3
        return g
    if kind == "tiny_range":  # all magnitudes within a few ulps: the radix selection needs its last rounds
        return 1.0 + torch.randint(0, 4, (n,), generator=gen).float() * 2.0 ** -23
    raise ValueError(kind)


def run_both(grads, k, wire=torch.float32, res_dtype=torch.float32, momentum=0.0, ties=False):
    """Several steps of both paths on the same gradients; asserts the same payloads and state after each.

    With ``ties`` (half-precision gradients have few distinct values), a step whose k-th magnitude is shared by
    entries on both sides of the cut may pick other equals than torch.topk: then the sent magnitudes must be the
    same multiset, and the reference's state is set to the device path's to go on."""
    n = grads[0].numel()
    r_ref = torch.zeros(n, dtype=res_dtype)
    r_dev = r_ref.clone()
    u_ref = torch.zeros(n, dtype=res_dtype) if momentum else None
    u_dev = u_ref.clone() if momentum else None
    for grad in grads:
        before = r_dev.clone()
        i_ref, v_ref, bad_ref = reference_step(grad.clone(), r_ref, k, wire, u_ref, momentum)
        i_dev, v_dev, bad_dev = device_select.compensate_and_select(grad.clone(), r_dev, k, wire, u_dev, momentum)
        assert i_dev.dtype == torch.int32 and v_dev.dtype == wire and bad_dev.shape == ()
        if ties and not torch.equal(i_dev, i_ref):
            assert torch.equal(v_dev.abs().sort().values, v_ref.abs().sort().values)
            r_ref.copy_(r_dev)
            if momentum:
                u_ref.copy_(u_dev)
        assert torch.equal(i_dev, i_ref) or ties
        assert torch.equal(v_dev.view(torch.uint8), v_ref.view(torch.uint8)) or ties  # bits, NaN included
        assert int(bad_dev) == bad_ref
        assert torch.equal(r_dev, r_ref)
        if momentum:
            assert torch.equal(u_dev, u_ref)
        if not bad_ref and not momentum:  # error feedback: nothing lost, nothing invented
            sent = torch.zeros(n, dtype=res_dtype).index_add_(0, i_dev.long(), v_dev.to(res_dtype))
            torch.testing.assert_close(r_dev + sent, before + grad.to(res_dtype), rtol=0, atol=0)
    return r_dev


@pytest.mark.parametrize("kind", ["gaussian", "heavy_tailed", "misleading_sample", "tiny_range"])
@pytest.mark.parametrize("n,k", [(10_000, 100), (4099, 41), (100, 100), (33, 1)])
def test_same_selection_as_reference(kind, n, k):
    gen = torch.Generator().manual_seed(n + k)
    grads = [gradients(kind, n, gen) for _ in range(3)]
    if kind == "tiny_range":  # ties: compare only where torch.topk's order among equals is not asked for
        r = torch.zeros(n)
        for grad in grads:
            i, v, _ = device_select.compensate_and_select(grad, r, k, torch.float32)
            assert i.unique().numel() == k and bool((i[1:] > i[:-1]).all())
        return
    run_both(grads, k)


def test_ties_send_exactly_k_of_the_largest_lowest_indices_first():
    grad = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 1.0, 2.0])
    residual = torch.zeros(8)
    indices, values, _ = device_select.compensate_and_select(grad, residual, 3, torch.float32)
    assert indices.tolist() == [1, 2, 4]
    assert values.tolist() == [-2.0, 2.0, -2.0]
    assert residual.tolist() == [1.0, 0.0, 0.0, 0.5, 0.0, 2.0, 1.0, 2.0]
    everything_equal = torch.ones(1000)
    indices, _, _ = device_select.compensate_and_select(everything_equal, torch.zeros(1000), 10, torch.float32)
    assert indices.tolist() == list(range(10))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("wire", [None, torch.float16, torch.bfloat16])
def test_gradient_and_value_dtypes(grad_dtype, wire):
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(5000, generator=gen).to(grad_dtype) for _ in range(3)]
    run_both(grads, 50, wire=wire or grad_dtype, res_dtype=ops.residual_dtype(grad_dtype),
             ties=grad_dtype in (torch.float16, torch.bfloat16))


def test_momentum_correction():
    gen = torch.Generator().manual_seed(4)
    run_both([torch.randn(3000, generator=gen) for _ in range(4)], 30, momentum=0.9)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("bad_count", [1, 3, 40])  # fewer and more non-finite entries than k
def test_nonfinite_entries_are_sent_and_never_kept(bad_count, momentum):
    gen = torch.Generator().manual_seed(bad_count)
    grads = [torch.randn(2000, generator=gen) for _ in range(3)]
    spots = torch.randperm(2000, generator=gen)[:bad_count]
    grads[1][spots] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(bad_count)[:bad_count]
    residual = run_both(grads, 20, wire=torch.float16, momentum=momentum)
    assert bool(torch.isfinite(residual).all())


def test_backend_choice(monkeypatch):
    cpu = torch.zeros(4)
    monkeypatch.delenv(selection.ENV, raising=False)
    assert selection.backend_for(cpu, "exact").name == "reference"
    assert selection.backend_for(cpu, "sampled").name in ("fused", "reference")  # reference if no compiler
    assert selection.backend_for(torch.zeros(4, device="meta"), "sampled").name == "device"
    assert selection.backend_for(torch.zeros(4, device="meta"), "exact").name == "reference"
    monkeypatch.setenv(selection.ENV, "device")
    assert selection.backend_for(cpu, "exact").name == "device"
    monkeypatch.setenv(selection.ENV, "fastest")
    with pytest.raises(ValueError, match="HOROVOD_TOPK_SELECTION"):
        selection.backend_for(cpu, "sampled")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_device_backend_payload_round_trip_matches_reference(wire, out_dtype):
    gen = torch.Generator().manual_seed(9)
    layout = PayloadLayout(64, torch.empty(0, dtype=wire).element_size())
    payloads, outs = {}, {}
    for backend in (selection.ReferenceBackend(), selection.DeviceBackend()):
        grad = torch.randn(6400, generator=gen.manual_seed(9))
        payload, nonfinite = backend.compress(grad, torch.zeros(6400), None, 0.0, layout, wire, 0, 0)
        assert int(nonfinite) == 0
        payloads[backend.name] = payload
        out = grad.to(out_dtype)
        backend.decompress(torch.cat([payload, payload]), 2, layout, wire, 0.5, out)
        outs[backend.name] = out
    assert torch.equal(payloads["device"], payloads["reference"])
    assert torch.equal(outs["device"], outs["reference"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="k=0"):
        device_select.compensate_and_select(torch.ones(4), torch.zeros(4), 0, torch.float32)
    with pytest.raises(ValueError, match="float32 or float64"):
        device_select.compensate_and_select(torch.ones(4), torch.zeros(4, dtype=torch.float16), 1, torch.float16)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_no_op_that_would_synchronise_on_a_gpu(momentum):
    """The CPU stand-in for the sync-debug test below, so that CI checks it too: every aten op the device path
    calls, compress and decompress, recorded with a dispatch mode; none of them may need the host to wait."""
    from .sync_check import recorded_ops, syncing

    grad = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    grad[17] = float("nan")
    residual = torch.zeros(5000)
    u = torch.zeros(5000) if momentum else None
    layout = PayloadLayout(50, 2)
    backend = selection.DeviceBackend()
    out = {}

    def run():
        out["payload"], out["nonfinite"] = backend.compress(grad.clone(), residual, u, momentum, layout,
                                                            torch.float16, 0, 0)
        backend.decompress(torch.cat([out["payload"]] * 2), 2, layout, torch.float16, 0.5, grad)

    ops_called = recorded_ops(run)
    assert len(ops_called) > 50 and "aten.nonzero_static.default" in ops_called  # the recording works
    assert syncing(ops_called) == []
    assert int(out["nonfinite"]) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_no_host_synchronisation_on_cuda(momentum):
    """Every op of the device path, compress to payload, under torch's sync debug mode set to raise."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(1 << 20, device="cuda", generator=gen)
    grad[123] = float("nan")
    residual = torch.zeros_like(grad)
    u = torch.zeros_like(grad) if momentum else None
    layout = PayloadLayout(1000, 2)
    backend = selection.DeviceBackend()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2):
            payload, nonfinite = backend.compress(grad.clone(), residual, u, momentum, layout, torch.float16, 0, step)
            backend.decompress(torch.cat([payload, payload]), 2, layout, torch.float16, 0.5, grad.clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(nonfinite) == 1
    assert payload.view(torch.int32)[:1000].tolist() == [123] * 1000  # the NaN, in every slot
    # a finite gradient: the same selection on the GPU as the reference's on the CPU
    grad[123] = 0.5
    residual = torch.randn(grad.numel(), device="cuda", generator=gen)
    cpu_residual = residual.cpu()
    i_dev, v_dev, bad = device_select.compensate_and_select(grad, residual, 1000, torch.float32)
    i_ref, v_ref = ops.compensate_and_select(grad.cpu(), cpu_residual, 1000, torch.float32)
    assert int(bad) == 0 and torch.equal(i_dev.cpu(), i_ref) and torch.equal(v_dev.cpu(), v_ref)
    assert torch.equal(residual.cpu(), cpu_residual)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gaussian", "heavy_tailed", "misleading_sample", "tiny_range"])
@pytest.mark.parametrize("n,k", [(1 << 20, 10_486), (10_000, 100), (4099, 41), (33, 1)])
def test_cuda_selects_what_the_reference_selects_on_the_cpu(kind, n, k):
    """The GPU run of the device path against its own CPU run (bit for bit, ties included: both take the lowest
    indices among equals) and, where there are no ties, against the reference, over several steps (the residual
    carries over, so later steps select among accumulated entries)."""
    gen = torch.Generator().manual_seed(n + k)
    r_ref, r_cpu = torch.zeros(n), torch.zeros(n)
    r_gpu = r_cpu.cuda()
    for _ in range(3):
        grad = gradients(kind, n, gen)
        i_cpu, v_cpu, bad_cpu = device_select.compensate_and_select(grad.clone(), r_cpu, k, torch.float32)
        i_dev, v_dev, bad_dev = device_select.compensate_and_select(grad.cuda(), r_gpu, k, torch.float32)
        assert int(bad_dev) == int(bad_cpu) == 0
        assert torch.equal(i_dev.cpu(), i_cpu)
        assert torch.equal(v_dev.cpu().view(torch.int32), v_cpu.view(torch.int32))
        assert torch.equal(r_gpu.cpu(), r_cpu)
        if kind != "tiny_range":  # ties: torch.topk's choice among equals is its own
            i_ref, _, _ = reference_step(grad.clone(), r_ref, k, torch.float32)
            assert torch.equal(i_cpu, i_ref)


def test_the_device_benchmark_runs_with_torch_alone():
    """benchmarks/bench_compress.py --device, as on a GPU machine without Horovod (here on the CPU, tiny sizes)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compress.py"
    code = (
        "import runpy, sys\n"
        "sys.modules['horovod'] = None  # as if Horovod were not installed\n"
        f"sys.argv = ['bench', '--device', 'cpu', '--shrink', '5000', '--repeat', '1', '--ratios', '0.01']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "assert not [m for m in sys.modules if m.startswith('horovod.')]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "0.01" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["resnet50-25.6M", "gpt2-small-124M", "25M"]
    import runpy

    shapes = runpy.run_path(str(script))["gpt2_small_shapes"]()
    assert sum(math.prod(shape) for shape in shapes) == 124_439_808  # GPT-2 small, output layer tied
    shrunk = sum(max(1, math.prod(shape) // 5000) for shape in shapes)
    assert f"| gpt2-small-124M | 0.01 | {shrunk:,} |" in result.stdout
