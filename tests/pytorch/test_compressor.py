"""TopKEF on one process: Horovod's compressor contract, and the full routed reduction on a 1-rank Horovod."""
import logging

import horovod.torch as hvd
import pytest
import torch

from horovod_topk.torch import TopKEF
from horovod_topk.torch.routing import ScopedCompression
from horovod_topk.core import PENDING_ATTR


@pytest.fixture(scope="module", autouse=True)
def horovod_single():
    hvd.init()
    yield


def test_compress_marks_an_alias_of_the_same_storage():
    comp = TopKEF(ratio=0.1)
    grad = torch.randn(100)
    marked, ctx = comp.compress(grad)
    assert marked.data_ptr() == grad.data_ptr() and getattr(marked, PENDING_ATTR) is ctx
    assert not hasattr(grad, PENDING_ATTR)
    assert ctx.route == "unrouted"


def test_class_and_instance_are_both_compressors():
    grad = torch.randn(10)
    marked, ctx = TopKEF.compress(grad)
    assert ctx.compressor is TopKEF.default() and TopKEF.default().config.ratio == 0.01
    with pytest.warns(UserWarning, match="reduced dense"):
        assert TopKEF.decompress(marked, ctx) is marked


def test_plain_hvd_allreduce_with_topkef_stays_correct_dense():
    t = torch.arange(10, dtype=torch.float32)
    with pytest.warns(UserWarning, match="reduced dense"):
        out = hvd.allreduce(t, name="plain", compression=TopKEF(ratio=0.1))
    torch.testing.assert_close(out, t)


def _route(comp, grad, name, op=hvd.Average):
    import horovod.torch.optimizer as hvd_optimizer

    if not isinstance(comp, ScopedCompression):  # what a wrapped optimizer hands Horovod
        comp = ScopedCompression(comp, "")
    marked, ctx = comp.compress(grad)
    handle = hvd_optimizer.allreduce_async_(marked, name=name, op=op)
    out = handle() if callable(handle) else hvd_optimizer.synchronize(handle)
    return comp.decompress(out, ctx), ctx


def test_routed_reduction_on_one_rank_sends_exactly_top_k_and_keeps_the_rest():
    comp = TopKEF(ratio=0.01, min_numel=0)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(50, 40, generator=gen) for _ in range(4)]
    total_out = torch.zeros(50, 40)
    for step, grad in enumerate(grads):
        out, ctx = _route(comp, grad.clone(), "w")
        assert ctx.route == "topk" and out.shape == grad.shape and out.dtype == grad.dtype
        assert int((out != 0).sum()) == 20  # k = ceil(0.01 * 2000)
        total_out += out
    residual = comp.registry.records["w"].residual.view(50, 40)
    torch.testing.assert_close(total_out + residual, sum(grads))
    s = comp.stats()
    assert s["steps"] == 4 and s["bytes_dense"] == 4 * 2000 * 4 and s["bytes_sent"] == 4 * 20 * 8
    assert s["compression_ratio"] == 50.0 and s["residual_norm"] > 0


def test_small_and_integer_tensors_go_dense():
    comp = TopKEF(ratio=0.01, min_numel=1024)
    out, ctx = _route(comp, torch.ones(10), "bias")
    assert ctx.route == "dense" and torch.equal(out, torch.ones(10))
    out, ctx = _route(comp, torch.ones(4096, dtype=torch.int32), "counts", op=hvd.Sum)
    assert ctx.route == "dense" and torch.equal(out, torch.ones(4096, dtype=torch.int32))
    assert comp.registry.records["bias"].residual is None


def test_state_dict_round_trip_continues_identically():
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(3000, generator=gen) for _ in range(6)]
    a = TopKEF(ratio=0.01)
    for g in grads[:3]:
        _route(a, g.clone(), "w")
    state = a.state_dict()
    b = TopKEF(ratio=0.01)
    b.load_state_dict(state)
    for g in grads[3:]:
        out_a, _ = _route(a, g.clone(), "w")
        out_b, _ = _route(b, g.clone(), "w")
        assert torch.equal(out_a, out_b)
    timing = {"compress_seconds"}  # host time, never equal twice
    assert {k: v for k, v in a.stats().items() if k not in timing} == {
        k: v for k, v in b.stats().items() if k not in timing}


def test_loaded_state_of_another_shape_is_refused_by_name():
    a = TopKEF(ratio=0.1)
    _route(a, torch.randn(2000), "w")
    b = TopKEF(ratio=0.1)
    b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="'w' has shape"):
        _route(b, torch.randn(1000, 3), "w")


def test_adasum_and_unsupported_ops_are_refused_at_construction():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Adasum"):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=TopKEF, op=hvd.Adasum)
    with pytest.raises(ValueError, match="op=hvd.Average and op=hvd.Sum"):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=TopKEF(), op=hvd.Max)


def test_a_state_with_a_nonfinite_residual_is_refused_by_name():
    comp = TopKEF(ratio=0.01, min_numel=0)
    _route(comp, torch.randn(2000), "w")
    state = comp.state_dict()
    state["tensors"]["w"]["residual"][3] = float("nan")
    with pytest.raises(ValueError, match="'w'.*NaN/Inf"):
        TopKEF(ratio=0.01).load_state_dict(state)


def test_spike_guard_caps_a_100x_gradient_before_it_reaches_the_residual():
    from horovod_topk.core.policy import SPIKE_GUARD_WARMUP_STEPS

    comp = TopKEF(ratio=0.01, min_numel=0, spike_guard=3.0)
    gen = torch.Generator().manual_seed(4)
    for _ in range(SPIKE_GUARD_WARMUP_STEPS + 5):
        _route(comp, torch.randn(2000, generator=gen), "w")
    record = comp.registry.records["w"]
    assert comp.stats()["guarded_steps"] == 0
    level, before = record.gradient_level, record.residual.clone()
    spike = 100 * torch.randn(2000, generator=gen)
    out, _ = _route(comp, spike.clone(), "w")
    assert comp.stats()["guarded_steps"] == 1
    # what entered (sent + kept) is the spike scaled to 3x the running level of the gradient norm
    entered = out.reshape(-1) + record.residual - before
    torch.testing.assert_close(entered.norm(), torch.tensor(3 * level), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entered / entered.norm(), spike / spike.norm(), rtol=1e-4, atol=1e-5)
    state = comp.state_dict()["tensors"]["w"]
    assert state["guarded_steps"] == 1 and state["gradient_level"] == record.gradient_level


@pytest.mark.parametrize("selector", ["sampled", "exact"])
def test_the_gradient_is_only_read_until_the_reduction_is_waited_for(selector):
    import horovod.torch.optimizer as hvd_optimizer

    comp = TopKEF(ratio=0.01, min_numel=0, selector=selector)
    grad = torch.randn(100, 50, generator=torch.Generator().manual_seed(6))
    original = grad.clone()
    marked, ctx = ScopedCompression(comp, "").compress(grad)
    handle = hvd_optimizer.allreduce_async_(marked, name="w", op=hvd.Average)
    assert ctx.route == "topk" and torch.equal(grad, original)  # what code reading .grad before synchronize() sees
    out = hvd_optimizer.synchronize(handle)
    assert out.data_ptr() == grad.data_ptr() and int((grad != 0).sum()) == 50  # the average, written in place


def _two_optimizers(models, compression):
    """Two hvd.DistributedOptimizer given one compression: what each was handed (on one rank Horovod registers
    no gradient hooks, so the tests route the gradients themselves with what the optimizer would use)."""
    return [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                     compression=compression)._compression for m in models]


def test_the_class_given_to_two_optimizers_keeps_one_state_per_optimizer():
    """Horovod's GAN test: both modules have a 'weight' and a 'bias', of other shapes."""
    TopKEF.reset()
    gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
    scoped = _two_optimizers((gen, disc), TopKEF)
    try:
        for _ in range(2):
            for module, compression in zip((gen, disc), scoped):
                for name, p in module.named_parameters():
                    _route(compression, torch.randn(p.shape), name)
        records = TopKEF.default().registry.records
        assert records["weight"].shape == (10, 1, 1, 1) and records["optimizer1/weight"].shape == (1, 10, 1, 1)
        assert TopKEF.stats()["steps"] == 2 and TopKEF.stats()["tensors_dense"] == 4
        assert "optimizer1/" in repr(scoped[1]) and scoped[1].stats() == TopKEF.stats()
    finally:
        TopKEF.reset()


def test_an_object_given_to_two_optimizers_keeps_their_residuals_apart():
    comp = TopKEF(ratio=0.01, min_numel=0)
    models = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)]  # same names and shapes
    scoped = _two_optimizers(models, comp)
    grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    for compression, sign in zip(scoped, (1.0, -1.0)):
        _route(compression, sign * grad, "weight")
    plain, other = comp.registry.records["weight"], comp.registry.records["optimizer1/weight"]
    # each residual holds its own optimizer's unsent gradient: a shared one would have cancelled out
    for record, sign in ((plain, 1.0), (other, -1.0)):
        kept = record.residual.view(64, 64)
        assert torch.count_nonzero(kept) == 64 * 64 - 41 and torch.all((kept == 0) | (kept == sign * grad))


def test_log_every_reports_through_logging_and_a_summary_writer(caplog):
    class RecordingWriter:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, value, step))

    writer = RecordingWriter()
    comp = TopKEF(ratio=0.01, min_numel=0, log_every=2, summary_writer=writer)
    gen = torch.Generator().manual_seed(9)
    with caplog.at_level(logging.INFO, logger="horovod_topk"):
        for _ in range(5):  # reports for steps 2 and 4, each made as step 3 / 5 starts
            for name in ("a", "b"):
                _route(comp, torch.randn(2000, generator=gen), name)
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_topk"]
    assert len(lines) == 2 and lines[0].startswith("horovod-topk rank 0 step 2: sent 0.00 MB in 2 steps (50.0x less")
    by_tag = {}
    for tag, value, step in writer.calls:
        by_tag.setdefault(tag, []).append((step, value))
    assert by_tag["horovod_topk/bytes_sent"] == [(2, 2 * 2 * 20 * 8.0), (4, 2 * 2 * 20 * 8.0)]
    assert [v for _, v in by_tag["horovod_topk/compression_ratio"]] == [50.0, 50.0]
    assert all(v > 0 for _, v in by_tag["horovod_topk/residual_norm"] + by_tag["horovod_topk/compress_ms_per_step"])
    assert comp.stats()["compress_seconds"] > 0
