"""The DDP hook on a GPU (NCCL, one process per GPU): gradient mode and update mode train as on the CPU, with the
same residuals, and a gradient-mode step never makes the host wait. Skipped on machines without CUDA; the GPU check
(scripts/gpu_check.sh) runs it."""
from __future__ import annotations

import pytest
import torch

from . import cuda_workers, harness

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                                reason="needs a GPU and NCCL")

STEPS = 6


def _gpu_and_cpu(options, optimizer):
    (result,) = harness.run(cuda_workers.cuda_against_cpu, 1, options, STEPS, optimizer, backend="nccl")
    cpu, cuda = result["cpu"], result["cuda"]
    print(f"host syncs in the last step ({options}, {optimizer}): {cuda['syncs']}")
    assert cuda["bytes_sent"] == cpu["bytes_sent"] > 0
    assert sorted(cuda["residuals"]) == sorted(cpu["residuals"]) and cpu["residuals"]
    for residual in cuda["residuals"].values():
        assert torch.isfinite(residual).all()
    assert torch.isfinite(cuda["params"]).all()
    return cpu, cuda


@pytest.mark.parametrize("options,optimizer", [
    (dict(ratio=0.05, min_numel=0), "adam"),
    (dict(ratio=0.05, min_numel=0, exchange="sparse_allreduce"), "adam"),
    (dict(ratio=0.05, min_numel=0, target="update"), "sgd"),
], ids=["gradient", "gradient-sparse-allreduce", "update-sgd"])
def test_gpu_trains_as_the_cpu(options, optimizer):
    cpu, cuda = _gpu_and_cpu(options, optimizer)
    for name, residual in cpu["residuals"].items():
        torch.testing.assert_close(cuda["residuals"][name], residual, rtol=1e-4, atol=1e-6,
                                   msg=lambda detail, name=name: f"{name}: {detail}")
    torch.testing.assert_close(cuda["params"], cpu["params"], rtol=1e-4, atol=1e-5)
    if options.get("exchange") != "sparse_allreduce" and options.get("target") != "update":
        assert cuda["syncs"] == 0  # the alltoall's split sizes and update mode's agreement are read on the host


def test_gpu_update_mode_with_adam_runs():
    """Update mode with Adam on a GPU: the same bytes as on the CPU, finite residuals and parameters. Not compared
    entry by entry: Adam's first updates are lr * sign(g) for every entry, so which k of those near-ties leave is
    decided by rounding (on the CPU alone a 1e-6 relative change of the input reorders them and the residuals
    differ by ~lr), as it is between any two selection kernels."""
    _gpu_and_cpu(dict(ratio=0.05, min_numel=0, target="update"), "adam")
