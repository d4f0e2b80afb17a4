"""exchange="sparse_allreduce" on real Horovod workers: parity with plain Horovod at ratio 1.0, and exact error
feedback (over all ranks, new residuals + applied sum == old residuals + gradients) below it."""
import horovod.torch as hvd
import pytest
import torch

from horovod_topk.core import RankMismatch
from horovod_topk.torch import TopKEF
from horovod_topk.torch.routing import ScopedCompression

from .conftest import SINGLE_RANK_SETS
from .torch_harness import assert_same_params, differs, train

SPARSE = dict(min_numel=0, dense_fallback=False, exchange="sparse_allreduce")

OPTIONS = {
    "named": {},
    "groups_int": {"groups": 2},
    "groups_list": {"groups": "list"},
    "two_backward_passes": {"passes": 2},
    "op_sum": {"op": hvd.Sum},
    "predivide": {"gradient_predivide_factor": 2.0},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_ratio_one_matches_plain_horovod(option):
    kwargs = OPTIONS[option]
    plain = train(hvd.Compression.none, **kwargs)
    compressor = TopKEF(ratio=1.0, **SPARSE)
    ours = train(compressor, **kwargs)
    initial = train(hvd.Compression.none, steps=0, **kwargs)
    assert_same_params(ours, plain)
    assert "fc1.weight" in differs(plain, initial)
    stats = compressor.stats()
    assert stats["tensors_compressed"] >= 8
    assert stats["exchanges"] == {"sparse_allreduce": stats["tensors_compressed"]}


def test_float16_gradients_match_plain_horovod_at_ratio_one():
    plain = train(hvd.Compression.none, dtype=torch.float16)
    compressor = TopKEF(ratio=1.0, **SPARSE)
    ours = train(compressor, dtype=torch.float16)
    assert_same_params(ours, plain)
    assert compressor.registry.records["fc1.weight"].residual.dtype == torch.float32


def _invariant_step(compressor, grads, op, old):
    """Reduce ``grads`` (name -> tensor) once through the routed optimizer path; return the reduced tensors."""
    from horovod.torch import optimizer as hvd_optimizer

    handles = {}
    for name, grad in grads.items():
        compressed, ctx = ScopedCompression(compressor, "").compress(grad)  # as a wrapped optimizer does
        handles[name] = (hvd_optimizer.allreduce_async_(compressed, name=name, op=op), ctx)
    return {name: compressor.decompress(hvd_optimizer.synchronize(h), ctx) for name, (h, ctx) in handles.items()}


@pytest.mark.parametrize("value_dtype", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("op_name", ["average", "sum"])
def test_error_feedback_is_exact_over_all_ranks(op_name, value_dtype):
    op = hvd.Average if op_name == "average" else hvd.Sum
    size = hvd.size()
    compressor = TopKEF(ratio=0.05, min_numel=0, value_dtype=value_dtype, exchange="sparse_allreduce")
    torch.manual_seed(0)
    shapes = {"conv": (16, 8, 3, 3), "embed": (500, 16), "fc": (3000,)}
    gen = torch.Generator().manual_seed(hvd.rank())
    for step in range(4):
        grads = {n: torch.randn(s, generator=gen) * (1 + 10 * (step % 2)) for n, s in shapes.items()}
        old = {n: (compressor.registry.records[n].residual.clone() if n in compressor.registry.records
                   and compressor.registry.records[n].residual is not None else torch.zeros(grads[n].numel()))
               for n in shapes}
        before = {n: old[n].double() + grads[n].reshape(-1).double() for n in shapes}
        out = _invariant_step(compressor, {n: g.clone() for n, g in grads.items()}, op, old)
        for name in shapes:
            residual = compressor.registry.records[name].residual
            total_before = hvd.allreduce(before[name], op=hvd.Sum, name=f"inv.before.{name}.{step}")
            total_residual = hvd.allreduce(residual.double(), op=hvd.Sum, name=f"inv.res.{name}.{step}")
            applied = out[name].reshape(-1).double() * (size if op_name == "average" else 1)
            same = hvd.allgather(applied.unsqueeze(0), name=f"inv.applied.{name}.{step}")
            assert torch.equal(same[0], same[-1]), "every rank must apply the same update"
            torch.testing.assert_close(total_residual + applied, total_before, rtol=0, atol=1e-4)
            k = compressor.registry.records[name].residual.numel() * 0.05
            assert int((out[name] != 0).sum()) <= k + size  # at most ~k entries applied
    assert compressor.stats()["bytes_sent"] > 0


def test_nonfinite_gradient_reaches_every_rank_and_stays_out_of_residuals():
    compressor = TopKEF(ratio=0.05, min_numel=0, exchange="sparse_allreduce")
    grad = torch.randn(4000, generator=torch.Generator().manual_seed(hvd.rank()))
    if hvd.rank() == 0:
        grad[123] = float("nan")
    out = _invariant_step(compressor, {"w": grad}, hvd.Average, None)["w"]
    assert torch.isnan(out[123])
    assert bool(torch.isfinite(compressor.registry.records["w"].residual).all())




@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_values_beyond_float16_travel_clamped_and_the_excess_follows(exchange):
    """value_dtype="float16" with gradients past 65504 (a gradient under an AMP loss scale, a residual that grew):
    nothing travels as an Inf that no rank had, no residual holds one, every rank applies the same finite update,
    error feedback stays exact over all ranks, and the excess goes out on the following steps. Every rank's entry 11
    is 60000, so the sparse allreduce's owner re-sends a sum past 65504 too; each rank's own entry passes it alone."""
    compressor = TopKEF(ratio=0.05, min_numel=0, value_dtype="float16", exchange=exchange)
    grad = torch.randn(3000, generator=torch.Generator().manual_seed(hvd.rank()))
    grad[11] = 60000.0
    grad[2000:2000 + hvd.size()] = 0.0
    grad[2000 + hvd.rank()] = 1e5
    applied_total = torch.zeros(3000, dtype=torch.float64)
    for step in range(4):
        record = compressor.registry.records.get("w")
        old = record.residual.double() if record is not None else torch.zeros(3000, dtype=torch.float64)
        before = hvd.allreduce(old + grad.double(), op=hvd.Sum, name=f"range.before.{exchange}.{step}")
        out = _invariant_step(compressor, {"w": grad.clone()}, hvd.Sum, None)["w"]
        residual = compressor.registry.records["w"].residual
        assert bool(torch.isfinite(out).all()), "a finite gradient must not average to an Inf"
        assert bool(torch.isfinite(residual).all()), "no Inf in a residual"
        same = hvd.allgather(out.unsqueeze(0), name=f"range.out.{exchange}.{step}")
        assert torch.equal(same[0], same[-1]), "every rank must apply the same update"
        total_residual = hvd.allreduce(residual.double(), op=hvd.Sum, name=f"range.res.{exchange}.{step}")
        torch.testing.assert_close(total_residual + out.double(), before, rtol=0, atol=0.05)
        applied_total += out.double()
        grad = torch.zeros(3000)  # the following steps send what stayed
    assert float(applied_total[11]) == pytest.approx(60000.0 * hvd.size(), abs=0.05), "the excess went out"
    for rank in range(hvd.size()):
        assert float(applied_total[2000 + rank]) == pytest.approx(1e5, abs=0.05)


def test_loading_a_state_forgets_the_reductions_of_an_abandoned_step():
    """Horovod elastic loads the last commit after a failure; the phase-1 handles of the step that failed belong
    to the old Horovod context, so the next tensor must not poll them (it did: "Handle ... was not created or has
    been cleared", found by tests/elastic with the sparse allreduce). Here the step is started, the state loaded,
    and the next step must find nothing left to poll."""
    from horovod.torch import optimizer as hvd_optimizer

    compressor = TopKEF(ratio=0.05, min_numel=0, exchange="sparse_allreduce")
    _invariant_step(compressor, {"a": torch.randn(3000), "b": torch.randn(2000)}, hvd.Average, None)
    saved = compressor.state_dict()
    started = []
    for name in ("a", "b"):  # a step whose phase 1 is started and never synchronized
        compressed, _ = ScopedCompression(compressor, "").compress(torch.randn(3000 if name == "a" else 2000))
        started.append(hvd_optimizer.allreduce_async_(compressed, name=name, op=hvd.Average))
    exchange = compressor._sparse_allreduce
    assert exchange._in_flight, "the second tensor's phase 1 is in flight"
    compressor.load_state_dict(saved)
    assert exchange._in_flight == []
    for handle in started:  # (this test's own collectives still complete, on both ranks alike)
        hvd_optimizer.synchronize(handle)
    out = _invariant_step(compressor, {"a": torch.ones(3000), "b": torch.ones(2000)}, hvd.Average, None)
    assert set(out) == {"a", "b"}


def test_process_set():
    my_set = SINGLE_RANK_SETS[hvd.rank()]
    plain = train(hvd.Compression.none, process_set=my_set)
    ours = train(TopKEF(ratio=1.0, **SPARSE), process_set=my_set)
    assert_same_params(ours, plain)
    assert differs(ours, train(hvd.Compression.none)), "a one-rank process set must not average with the other"
