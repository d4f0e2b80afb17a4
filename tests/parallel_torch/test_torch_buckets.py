"""Buckets on real Horovod workers: a bucketed step equals the per-tensor step bit for bit, under every option that
changes what a member sends; buckets leave during backward; one member's NaN leaves its bucket-mates' residuals
alone; checkpoints load across bucket layouts and resume exactly."""
import copy
import tempfile

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from horovod_topk.torch import TopKEF

from . import torch_harness
from .torch_harness import batch, differs, train

BUCKETED = {"bucket_bytes": 1 << 20}
PER_TENSOR = {"bucket_bytes": 0}


@pytest.mark.parametrize("options", [
    {"ratio": 0.05},
    {"ratio": 0.05, "selector": "exact"},
    {"ratio": 0.05, "value_dtype": "float16"},
    {"ratio": 0.05, "index_bits": 16, "value_dtype": "float8"},
    {"ratio": 0.05, "momentum": 0.9},
    {"ratio": 0.05, "warmup_steps": 3},
    {"ratio": 0.05, "spike_guard": 2.0},
    {"ratio": 0.05, "exchange": "sparse_allreduce"},
    {"ratio": 1.0, "dense_fallback": False},
])
def test_a_bucketed_step_equals_the_per_tensor_step(options):
    momentum = 0.0 if "momentum" in options else 0.9
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum)  # noqa: E731
    bucketed = TopKEF(**options, **BUCKETED)
    per_tensor = TopKEF(**options, **PER_TENSOR)
    ours = train(bucketed, steps=5, optimizer_factory=factory)
    theirs = train(per_tensor, steps=5, optimizer_factory=factory)
    assert differs(ours, theirs) == []
    for name, record in per_tensor.registry.records.items():
        mine = bucketed.registry.records[name]
        assert (mine.residual is None) == (record.residual is None), name
        if record.residual is not None:
            assert torch.equal(mine.residual, record.residual), name
    assert bucketed.stats()["bytes_sent"] == per_tensor.stats()["bytes_sent"]
    buckets = bucketed.stats()["buckets"]
    assert buckets["buckets"] == 1
    if "warmup_steps" not in options:
        # one exchange per step carries every compressed member; per tensor there are four
        assert buckets["collectives"] == 5 and buckets["tensors"] == 5 * 4
    assert "buckets" not in per_tensor.stats()


@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_horovods_groups_are_the_buckets_and_train_as_per_tensor(exchange):
    """groups=[[fc1.weight, fc2.weight], [head.weight, head.bias]]: each group is one bucket (its two compressed
    members share one payload per step), bit for bit the per-tensor step."""
    options = {"ratio": 0.05, "exchange": exchange}
    grouped, per_tensor = TopKEF(**options), TopKEF(**options, **PER_TENSOR)
    ours = train(grouped, steps=5, groups="list")
    theirs = train(per_tensor, steps=5, groups="list")
    assert differs(ours, theirs) == []
    for name, record in per_tensor.registry.records.items():
        if record.residual is not None:
            assert torch.equal(grouped.registry.records[name].residual, record.residual), name
    buckets = grouped.stats()["buckets"]
    # fc1/fc2 compressed, head's two members dense (under min_numel): one collective per step for fc1 + fc2
    assert buckets["buckets"] == 2 and buckets["collectives"] == 5 and buckets["tensors"] == 5 * 2, buckets
    assert "buckets" not in per_tensor.stats()


def test_a_bucket_leaves_during_backward_once_its_last_member_is_ready():
    """Small buckets: the ones whose members are ready before backward ends are sent from the hooks, not from
    synchronize()."""
    compressor = TopKEF(ratio=0.05, bucket_bytes=9000)
    torch.manual_seed(0)
    model = torch_harness.Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor)
    assert len(compressor.bucket_table) >= 2
    during = []
    for step in range(3):
        opt.zero_grad()
        x, tokens, y = batch(step)
        before = compressor._bucketed.collectives
        nn.functional.cross_entropy(model(x, tokens, True), y).backward()
        during.append(compressor._bucketed.collectives - before)
        opt.step()
    after = compressor.stats()["buckets"]
    assert min(during) >= 1, during
    assert after["flushed_incomplete"] == 0


def test_a_nan_in_one_member_leaves_its_bucket_mates_residuals_exact():
    compressor = TopKEF(ratio=0.05, **BUCKETED)
    raw, sent, averaged_nonfinite = {}, {}, []

    original = torch_harness.Net

    class Recording(original):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            for name, p in self.named_parameters():
                def hook(g, name=name):
                    if name == "fc2.weight" and hvd.rank() == 1:
                        g = g.clone()
                        g[0, 0] = float("nan")
                    raw[name] = raw.get(name, 0) + g.detach().clone()
                    return g
                p.register_hook(hook)

    def capture(model):
        for name, p in model.named_parameters():
            if name != "fc2.weight":
                sent[name] = sent.get(name, 0) + p.grad.detach().clone()
            else:  # the NaN reaches every rank's average, as with a dense allreduce
                averaged_nonfinite.append(not bool(torch.isfinite(p.grad).all()))
            p.grad = torch.nan_to_num(p.grad, nan=0.0)

    torch_harness.Net = Recording
    try:
        train(compressor, steps=3, on_synchronized=capture, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
    finally:
        torch_harness.Net = original
    for name, record in sorted(compressor.registry.records.items()):
        if record.residual is None:
            continue
        assert bool(torch.isfinite(record.residual).all()), name
        if name == "fc2.weight":
            continue
        total_raw = hvd.allreduce(raw[name].reshape(-1), op=hvd.Sum, name=f"bucket.nan.raw.{name}")
        total_residual = hvd.allreduce(record.residual, op=hvd.Sum, name=f"bucket.nan.res.{name}")
        torch.testing.assert_close(hvd.size() * sent[name].reshape(-1) + total_residual, total_raw,
                                   rtol=1e-5, atol=1e-6)
    assert averaged_nonfinite == [True, True, True]
    assert compressor.stats()["nonfinite_steps"] >= (3 if hvd.rank() == 1 else 0)


def _train_from(compressor, state, steps):
    torch.manual_seed(0)
    model = torch_harness.Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compressor)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        compressor.load_state_dict(state["topk"])
    for step in steps:
        opt.zero_grad()
        x, tokens, y = batch(step)
        nn.functional.cross_entropy(model(x, tokens, step % 2 == 0), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("saved_with, resumed_with", [(BUCKETED, BUCKETED), (BUCKETED, PER_TENSOR),
                                                       (PER_TENSOR, BUCKETED)])
def test_a_checkpoint_resumes_exactly_whatever_the_bucket_layout(saved_with, resumed_with):
    straight = TopKEF(ratio=0.05, **saved_with)
    model, _ = _train_from(straight, None, range(6))
    first = TopKEF(ratio=0.05, **saved_with)
    model_half, opt_half = _train_from(first, None, range(3))
    with tempfile.TemporaryFile() as f:
        torch.save({"model": model_half.state_dict(), "optimizer": opt_half.state_dict(),
                    "topk": first.state_dict()}, f)
        f.seek(0)
        state = torch.load(f, weights_only=False)
    resumed = TopKEF(ratio=0.05, **resumed_with)
    model_resumed, _ = _train_from(resumed, copy.deepcopy(state), range(3, 6))
    assert differs({n: p.detach() for n, p in model.named_parameters()},
                   {n: p.detach() for n, p in model_resumed.named_parameters()}) == []
