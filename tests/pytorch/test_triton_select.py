"""The grouped Triton path (horovod_topk/torch/triton_select.py) against device_select + ops.pack, byte for byte.

Without a GPU the kernels run under Triton's interpreter (on the CPU, the same kernel code); on a GPU machine
(scripts/gpu_check.sh) the same tests run on CUDA, plus the host-synchronisation check."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton makes its kernels (its own library's too) for the GPU or for the interpreter when they are defined,
    # i.e. at import: once imported without the interpreter, Triton cannot run them on the CPU in this process
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the "
                    "environment (scripts/test.sh does)", pytrace=False)
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton") if not os.environ.get("CI") else __import__("triton")  # CI must have it

from horovod_topk.core import PayloadLayout  # noqa: E402
from horovod_topk.torch import device_select, ops, selection, triton_select  # noqa: E402

from .test_device_select import gradients  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WIRES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def group_of(numels, ratio_or_ks, wire):
    ks = ratio_or_ks if isinstance(ratio_or_ks, list) else [max(1, round(ratio_or_ks * n)) for n in numels]
    layouts = tuple(PayloadLayout(k, WIRES[wire]) for k in ks)
    return triton_select.GroupLayout(tuple(numels), layouts, DEVICE)


def expected_step(grads, residuals, group, wire):
    """device_select + ops.pack, tensor by tensor (on the CPU): the payloads and the non-finite flags."""
    payloads, flags = [], []
    for g, r, lay in zip(grads, residuals, group.layouts):
        i, v, bad = device_select.compensate_and_select(g, r, lay.k, wire)
        payloads.append(ops.pack(i, v, lay))
        flags.append(int(bad))
    return payloads, flags


def check_steps(numels, ks, kinds, wire=torch.float32, steps=3, seed=0, poison=None):
    """``steps`` steps of the grouped path and of device_select on the same gradients (``poison(step, grads)``
    may edit them); the same payload bytes, flags and residuals after each."""
    group = group_of(numels, ks, wire)
    gen = torch.Generator().manual_seed(seed)
    r_exp = [torch.zeros(n) for n in numels]
    r_got = torch.zeros(group.numel, device=DEVICE)
    for step in range(steps):
        grads = [gradients(kinds[i % len(kinds)], n, gen) for i, n in enumerate(numels)]
        if poison is not None:
            poison(step, grads)
        want, want_bad = expected_step([g.clone() for g in grads], r_exp, group, wire)
        flat = torch.cat(grads).to(DEVICE)
        buffer, bad = triton_select.compensate_and_select(flat, r_got, group, wire)
        assert buffer.dtype == torch.uint8 and buffer.numel() == group.nbytes
        got = [p.cpu() for p in group.payloads(buffer)]
        for t, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"step {step}, tensor {t} ({numels[t]} elements): payload differs"
        assert bad.cpu().tolist() == want_bad
        assert torch.equal(r_got.cpu(), torch.cat(r_exp)), f"step {step}: residuals differ"
    return group


@pytest.mark.parametrize("kind", ["gaussian", "heavy_tailed", "misleading_sample", "tiny_range"])
def test_one_tensor_matches_device_select(kind):
    check_steps([10_000], [100], [kind])


def test_a_group_of_many_shapes_matches_tensor_by_tensor():
    """Tensors that fill blocks exactly, one element, k = n, and tensors across block boundaries."""
    numels = [1, 33, 4096, 4099, 8192 + 5, 100, 12_000]
    ks = [1, 1, 41, 4099, 82, 100, 120]
    check_steps(numels, ks, ["gaussian", "heavy_tailed", "misleading_sample", "tiny_range"])


def test_more_k_than_nonzero_entries_sends_the_lowest_zeros():
    """k above the count of non-zero entries: the rest are ties at zero, the lowest indices go (a frozen or unused
    part of a layer); the later rounds then count every entry of a block, through the block histogram."""
    def sparse(step, grads):
        for g in grads:
            g.zero_()
            g[step * 11 + 3::977] = step + 1.0

    check_steps([9000, 5000], [100, 2], ["gaussian"], poison=sparse)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_half_precision_wire_keeps_the_rounding_in_the_residual(wire):
    check_steps([5000, 3000], [50, 300], ["gaussian", "heavy_tailed"], wire=wire)


@pytest.mark.parametrize("wire,beyond", [(torch.float16, 70000.0), (torch.bfloat16, 3.4e38)])
def test_values_beyond_the_wire_range_travel_clamped_as_device_select_sends_them(wire, beyond):
    """A value past the wire's range travels as its largest finite value and the excess stays in the residual
    (ops.to_wire): the same bytes and residuals as device_select, and none of them an Inf."""
    def large(step, grads):
        if step == 0:
            grads[0][[3, 4000]] = torch.tensor([beyond, -beyond])
            grads[1][17] = beyond

    check_steps([5000, 3000], [50, 30], ["gaussian"], wire=wire, poison=large)


@pytest.mark.parametrize("bad_count", [1, 7, 80])
def test_a_nonfinite_tensor_sends_its_nonfinite_entries_and_the_others_are_unaffected(bad_count):
    def poison(step, grads):
        if step == 1:
            where = torch.arange(bad_count) * 37 + 5
            grads[1][where] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(bad_count)[:bad_count]

    check_steps([3000, 4500, 2000], [30, 45, 20], ["gaussian"], poison=poison)


@pytest.mark.parametrize("wire", [torch.float32, torch.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_accumulate_adds_ranks_in_order_like_the_device_backend(wire, world):
    numels, ks = [3000, 17, 9000], [30, 17, 90]
    group = group_of(numels, ks, wire)
    gen = torch.Generator().manual_seed(world)
    buffers = []
    for _ in range(world):
        grads = torch.randn(group.numel, generator=gen) * 3
        residual = torch.zeros(group.numel, device=DEVICE)
        buffers.append(triton_select.compensate_and_select(grads.to(DEVICE), residual, group, wire)[0])
    out = torch.full((group.numel,), 7.0, device=DEVICE)  # overwritten, not added to
    triton_select.accumulate(buffers, group, wire, 1.0 / world, out)
    backend = selection.DeviceBackend()
    for t, lay in enumerate(group.layouts):
        gathered = torch.cat([group.payloads(b)[t].cpu() for b in buffers])
        want = torch.empty(numels[t])
        backend.decompress(gathered, world, lay, wire, 1.0 / world, want)
        got = out[group.starts[t]:group.starts[t + 1]].cpu()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"tensor {t}"


def test_bad_input_is_named():
    group = group_of([100, 50], [10, 5], torch.float32)
    r = torch.zeros(150, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        triton_select.compensate_and_select(torch.zeros(150, dtype=torch.float64, device=DEVICE), r, group,
                                            torch.float32)
    with pytest.raises(ValueError, match="float32 residuals"):
        triton_select.compensate_and_select(torch.zeros(150, device=DEVICE), r.double(), group, torch.float32)
    with pytest.raises(ValueError, match="150 elements"):
        triton_select.compensate_and_select(torch.zeros(149, device=DEVICE), r, group, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        triton_select.compensate_and_select(torch.zeros(150, device=DEVICE), r, group, torch.float16)
    with pytest.raises(ValueError, match="outside"):
        group_of([10], [11], torch.float32)
    with pytest.raises(ValueError, match="one plain layout"):
        triton_select.GroupLayout((10, 10), (PayloadLayout(1, 4), PayloadLayout(1, 2)), DEVICE)
    with pytest.raises(ValueError, match="gathered payload buffer"):
        triton_select.accumulate([torch.zeros(8, dtype=torch.uint8, device=DEVICE)], group, torch.float32, 1.0,
                                 torch.zeros(150, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_large_group_on_cuda_matches_and_never_synchronises():
    """ResNet-50-like sizes on the GPU: the same payloads as device_select, and no host synchronisation once the
    group layout exists (torch's sync debug mode set to raise around compress and decompress)."""
    numels, ks = [1 << 20, 2_359_296, 65_536, 9408], [10_486, 23_593, 656, 95]
    check_steps(numels, ks, ["gaussian", "heavy_tailed"], steps=2)
    group = group_of(numels, ks, torch.float16)
    grad = torch.randn(group.numel, device=DEVICE)
    grad[5] = float("nan")
    residual = torch.zeros_like(grad)
    out = torch.empty_like(grad)
    triton_select.compensate_and_select(grad, residual, group, torch.float16)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            buffer, bad = triton_select.compensate_and_select(grad, residual, group, torch.float16)
            triton_select.accumulate([buffer, buffer], group, torch.float16, 0.5, out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bad.tolist() == [1, 0, 0, 0]


def assert_same_payload(got, want, layout, wire):
    """The same bytes, except that a NaN may have other payload bits (torch's own float-to-half conversion writes
    NaN as 0x7E00 or 0x7FFF depending on where in the tensor it falls)."""
    (gi, gv), (wi, wv) = ops.unpack(got, 1, layout, wire), ops.unpack(want, 1, layout, wire)
    assert torch.equal(gi, wi)
    assert torch.equal(gv.isnan(), wv.isnan())
    zero = torch.zeros((), dtype=wire)
    no_nan = [torch.where(v.isnan(), zero, v).view(torch.uint8) for v in (gv, wv)]
    assert torch.equal(*no_nan)


@pytest.mark.parametrize("grad_dtype,wire", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                             (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_the_triton_backend_matches_the_device_backend(grad_dtype, wire):
    """selection.TritonBackend (a tensor as a group of one) against DeviceBackend: the same payloads, flags,
    residuals and averages, over steps, with a non-finite step in the middle."""
    triton_backend, device = selection.TritonBackend(triton_select), selection.DeviceBackend()
    n, world = 7000, 2
    layout = PayloadLayout(70, WIRES[wire])
    gen = torch.Generator().manual_seed(1)
    r_ref, r_got = torch.zeros(n), torch.zeros(n, device=DEVICE)
    for step in range(3):
        grad = (torch.randn(n, generator=gen) * 2).to(grad_dtype)
        if step == 1:
            grad[17] = float("nan")
        want, want_bad = device.compress(grad.clone(), r_ref, None, 0.0, layout, wire, 0, step)
        got, got_bad = triton_backend.compress(grad.to(DEVICE), r_got, None, 0.0, layout, wire, 0, step)
        assert_same_payload(got.cpu(), want, layout, wire)
        assert int(got_bad) == int(want_bad) == (step == 1)
        assert torch.equal(r_got.cpu(), r_ref)
        for out_dtype in (torch.float32, grad_dtype):  # half precision outputs go to the device backend
            gathered = torch.cat([want, want])
            expect = torch.empty(n, dtype=out_dtype)
            device.decompress(gathered, world, layout, wire, 1.0 / world, expect)
            out = torch.empty(n, dtype=out_dtype, device=DEVICE)
            triton_backend.decompress(gathered.to(DEVICE), world, layout, wire, 1.0 / world, out)
            torch.testing.assert_close(out.cpu(), expect, rtol=0, atol=0, equal_nan=True)  # exact, NaN as NaN


def test_the_triton_backend_leaves_momentum_to_device_select():
    triton_backend, device = selection.TritonBackend(triton_select), selection.DeviceBackend()
    layout, n = PayloadLayout(30, 4), 3000
    grad = torch.randn(n, generator=torch.Generator().manual_seed(2))
    r_ref, u_ref = torch.zeros(n), torch.zeros(n)
    r_got, u_got = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    want, _ = device.compress(grad.clone(), r_ref, u_ref, 0.9, layout, torch.float32, 0, 0)
    got, _ = triton_backend.compress(grad.to(DEVICE), r_got, u_got, 0.9, layout, torch.float32, 0, 0)
    assert torch.equal(got.cpu(), want) and torch.equal(u_got.cpu(), u_ref)


def test_forcing_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv(selection.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        selection.backend_for(torch.zeros(4), "sampled")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert selection.backend_for(torch.zeros(4), "exact").name == "triton"
    monkeypatch.delenv(selection.ENV)
    assert selection.backend_for(torch.zeros(4, device="meta"), "sampled").name == "device"  # not CUDA
