"""The DDP hook on a GPU (NCCL, one process per GPU): gradient mode and update mode train as on the CPU, with the
same residuals, and a gradient-mode step never makes the host wait. Skipped on machines without CUDA; the GPU check
(scripts/gpu_check.sh) runs it."""
from __future__ import annotations

import pytest
import torch

from horovod_topk.core.autodensity import WINDOW_STEPS

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


def test_gpu_fp16_trains_as_the_cpu_without_host_waits():
    """ratio="auto"'s fp16 on NCCL: each bucket's members joined into one run of the torch operations (the CPU runs
    the fused kernel member by member): residuals of the same size, the same parameters, no host wait in a step."""
    # SGD: Adam's first updates are lr * sign(g), so a gradient that float16 rounds to zero on one device and not on
    # the other moves a parameter by lr (see the next test)
    cpu, cuda = _gpu_and_cpu(dict(ratio="auto", min_numel=0, hold="fp16"), "sgd")
    for name, residual in cpu["residuals"].items():
        assert residual.abs().sum() > 0  # the rounding stayed
        # a residual is a rounding error, decided by the gradient's last bits, which the two devices compute in
        # another order (the matmuls' sums): compared by size, not entry by entry (the parameters are, below)
        ours = cuda["residuals"][name]
        print(f"{name}: residual max {float(residual.abs().max()):.3g} (cpu) {float(ours.abs().max()):.3g} (cuda), "
              f"entries equal {float((ours == residual).float().mean()):.2f}")
        assert float(ours.abs().max()) <= 2 * float(residual.abs().max()) + 1e-9, name
        assert float(residual.abs().max()) <= 2 * float(ours.abs().max()) + 1e-9, name
    torch.testing.assert_close(cuda["params"], cpu["params"], rtol=1e-4, atol=1e-5)
    assert cuda["syncs"] == 0


def test_gpu_update_mode_with_adam_runs():
    """Update mode with Adam on a GPU: the same bytes as on the CPU, finite residuals and parameters. Not compared
    entry by entry: Adam's first updates are lr * sign(g) for every entry, so which k of those near-ties leave is
    decided by rounding (on the CPU alone a 1e-6 relative change of the input reorders them and the residuals
    differ by ~lr), as it is between any two selection kernels."""
    _gpu_and_cpu(dict(ratio=0.05, min_numel=0, target="update"), "adam")


@pytest.mark.parametrize("target", ["gradient", "update"])
def test_gpu_ratio_auto_times_the_device_and_waits_only_where_it_measures(target):
    """ratio="auto" on NCCL: decisions are taken from waits timed with CUDA events, read only for the steps whose
    wait counts; in gradient mode a step that reads none and takes no decision makes the host wait nowhere."""
    (result,) = harness.run(cuda_workers.cuda_auto, 1, target, 50, backend="nccl")
    log, auto = result["log"], result["auto"]
    print(f"{target}: auto {auto}")
    print(f"{target}: host syncs per step {[e['syncs'] for e in log]}")
    print(f"{target}: (period, wait, compress) ms of the last samples "
          f"{[tuple(round(v * 1e3, 3) for v in s) for s in result['samples'][-5:]]}")
    assert auto["decisions"] >= 2 and auto["last"]
    assert torch.isfinite(result["params"]).all()
    assert all(0.0 <= wait <= period for period, wait, _ in result["samples"])
    reads = result["reads"]
    print(f"{target}: events read after steps {[s for s, _ in reads]}, waits ms {[round(w * 1e3, 4) for _, w in reads]}")
    assert len(reads) >= WINDOW_STEPS and all(log[s]["counted"] and w is not None and w >= 0.0 for s, w in reads)
    free = [e for before, e in zip(log, log[1:]) if not e["counted"] and not before["counted"]
            and e["decisions"] == before["decisions"]]
    if target == "gradient":
        assert free and all(e["syncs"] == 0 for e in free), log


def test_whole_bucket_graphs_train_exactly_as_the_usual_path():
    """HOROVOD_TOPK_CUDA_GRAPHS=bucket: each steady bucket's selection, NCCL collectives and adding back replayed
    as one CUDA graph on a side stream (torch.bucket_graph): parameters, residuals and counters are the usual
    path's bit for bit, through rebuilt buckets and a load, and a replayed step never makes the host wait."""
    (result,) = harness.run(cuda_workers.cuda_whole_bucket_graphs, 1, 10, 5, backend="nccl")
    whole, usual = result["whole"], result["usual"]
    print(f"whole bucket graphs: {whole['replays']} replays, host syncs in the last step {whole['syncs']}")
    assert whole["replays"] > 0
    assert torch.equal(whole["params"], usual["params"])
    assert whole["counters"] == usual["counters"] and whole["residuals"].keys() == usual["residuals"].keys()
    assert all(torch.equal(whole["residuals"][n], usual["residuals"][n]) for n in whole["residuals"])
    assert whole["buckets"] == usual["buckets"]
    assert whole["syncs"] == 0
