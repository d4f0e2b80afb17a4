"""The device selection paths on real Horovod workers, forced on the CPU (HOROVOD_TOPK_SELECTION=device or triton):
training gives the same parameters as the reference path (torch.topk), and non-finite gradients follow the same
rule. With triton, a bucket's allgather members are selected by one run of the grouped kernels (torch.bucket_select)."""
import importlib.util
import os
import sys

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.torch import TopKEF, selection

from .torch_harness import Net, assert_same_params, batch, differs, train

SPARSE = dict(ratio=0.05, min_numel=1000)


def use_triton_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 before Triton is first imported (its own library functions are made for the GPU or the
    interpreter when it is imported), so: checked for with find_spec, not imported."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set: run the workers with TRITON_INTERPRET=1 "
                    "in their environment (scripts/test.sh does)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("backend", ["device", "triton"])
@pytest.mark.parametrize("options", [{}, {"momentum": 0.9}, {"value_dtype": "float16"}, {"ratio": 0.2}],
                         ids=["plain", "momentum", "fp16_values", "ratio0.2"])
def test_training_with_the_device_path_matches_the_reference(monkeypatch, options, backend):
    """Both device paths: device_select, and the Triton kernels (here under Triton's interpreter, set before
    the backend first imports them)."""
    if backend == "triton":
        use_triton_interpreter(monkeypatch)
    reference = TopKEF(**{**SPARSE, **options}, selector="exact")
    # TopKEF's momentum replaces the optimizer's (DGC momentum correction)
    opt = {"optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.1)} if options.get("momentum") else {}
    expected = train(reference, steps=5, **opt)
    monkeypatch.setenv(selection.ENV, backend)
    device = TopKEF(**{**SPARSE, **options}, selector="sampled")
    assert device._backend(torch.zeros(1)).name == backend
    ours = train(device, steps=5, **opt)
    initial = train(hvd.Compression.none, steps=0)
    assert_same_params(ours, expected, rtol=0, atol=0)
    assert {"fc1.weight", "fc2.weight"} <= set(differs(ours, initial))
    stats, ref_stats = device.stats(), reference.stats()
    assert stats["tensors_compressed"] >= 2 and stats["bytes_sent"] == ref_stats["bytes_sent"]
    assert stats["bytes_sent"] < stats["bytes_dense"] / 2
    if backend == "triton" and not options.get("momentum"):  # a bucket's members selected by one grouped run
        assert stats["buckets"]["grouped"] == 5, stats["buckets"]
    for name in ("fc1.weight", "fc2.weight"):
        assert torch.equal(device.registry.records[name].residual, reference.registry.records[name].residual)


@pytest.mark.parametrize("backend", ["device", "triton"])
def test_a_nonfinite_gradient_on_one_rank_reaches_every_rank_and_stays_out_of_the_residual(monkeypatch, backend):
    if backend == "triton":
        use_triton_interpreter(monkeypatch)
    monkeypatch.setenv(selection.ENV, backend)
    torch.manual_seed(0)
    model = Net()
    compressor = TopKEF(**SPARSE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor)
    poisoned = {"now": False}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if poisoned["now"] and hvd.rank() == 1:
            grad = grad.clone()
            grad.view(-1)[5] = float("inf")
        return grad

    model.fc1.weight.register_hook(hook)
    averaged_finite, residual_at_5 = [], []
    for step in range(3):
        poisoned["now"] = step == 1
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        opt.synchronize()
        averaged_finite.append(bool(torch.isfinite(model.fc1.weight.grad).all()))
        residual = compressor.registry.records["fc1.weight"].residual
        residual_at_5.append(float(residual[5]))
        assert bool(torch.isfinite(residual).all())
        with opt.skip_synchronize():
            pass  # the step is skipped, as an AMP scaler would do on a non-finite average
    assert averaged_finite == [True, False, True]
    assert compressor.stats()["nonfinite_steps"] == (1 if hvd.rank() == 1 else 0)
    if hvd.rank() == 1:  # the injected entry did not touch the residual on the poisoned step
        assert residual_at_5[1] == residual_at_5[0]
