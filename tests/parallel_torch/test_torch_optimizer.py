"""TopKEF inside an unmodified hvd.DistributedOptimizer on real Horovod workers.

With ratio 1.0 every entry is sent, so training must match plain Horovod exactly (up to float rounding): that
checks the routing, scaling and decompression for every option Horovod's optimizer has.
"""
import os
import tempfile

import horovod.torch as hvd
import pytest
import torch

from horovod_topk.core.buckets import bucket_collective_name
from horovod_topk.torch import TopKEF

from ..timeline import timeline_activities
from .conftest import SINGLE_RANK_SETS
from .torch_harness import assert_same_params, differs, train

EVERYTHING = dict(ratio=1.0, min_numel=0, dense_fallback=False, target="gradient")  # gradient mode, named

OPTIONS = {
    "named": {},
    "unnamed": {"named": False},
    "groups_int": {"groups": 2},
    "groups_list": {"groups": "list"},
    "two_backward_passes": {"passes": 2},
    "op_sum": {"op": hvd.Sum},
    "predivide": {"gradient_predivide_factor": 2.0},
    "clipping_flow": {"clip": 0.5},
    "adam": {"optimizer_factory": lambda params: torch.optim.Adam(params, lr=0.01)},
    "sparse_as_dense": {"sparse_embedding": True, "sparse_as_dense": True},
}


@pytest.mark.parametrize("selector", ["sampled", "exact"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_ratio_one_matches_plain_horovod(option, selector):
    kwargs = OPTIONS[option]
    plain = train(hvd.Compression.none, **kwargs)
    compressor = TopKEF(**EVERYTHING, selector=selector)
    ours = train(compressor, **kwargs)
    initial = train(hvd.Compression.none, steps=0, **kwargs)
    moved = differs(plain, initial)
    stats = compressor.stats()
    assert_same_params(ours, plain)
    assert "sometimes.weight" in moved and "fc1.weight" in moved, "training must actually change the parameters"
    assert stats["tensors_compressed"] >= 8 and stats["bytes_sent"] > 0


def test_class_itself_as_compression_matches_plain_horovod_at_ratio_one():
    TopKEF.default().reset()
    plain = train(hvd.Compression.none)
    TopKEF.default().config = TopKEF(**EVERYTHING).config
    try:
        ours = train(TopKEF)
        stats = TopKEF.stats()
    finally:
        TopKEF.default().config = TopKEF().config
        TopKEF.reset()
    assert_same_params(ours, plain)
    assert stats["steps"] == 4 and stats["tensors_compressed"] > 0


def test_sparse_gradients_keep_horovods_sparse_path():
    factory = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731 (sparse grads need plain SGD)
    plain = train(hvd.Compression.none, sparse_embedding=True, optimizer_factory=factory)
    compressor = TopKEF(**EVERYTHING)
    ours = train(compressor, sparse_embedding=True, optimizer_factory=factory)
    assert_same_params(ours, plain)
    assert "embed.weight" not in compressor.registry.records  # never went through the compressor
    assert "fc1.weight" in compressor.registry.records


def test_float16_gradients_match_plain_horovod_and_keep_float32_residuals():
    plain = train(hvd.Compression.none, dtype=torch.float16)
    compressor = TopKEF(**EVERYTHING)
    ours = train(compressor, dtype=torch.float16)
    assert_same_params(ours, plain)
    residual = compressor.registry.records["fc1.weight"].residual
    assert residual.dtype == torch.float32


def test_bfloat16_gradients_travel_as_bytes():
    """Horovod's allgather has no bfloat16; our payload is bytes, so bf16 models compress fine."""
    reference = train(TopKEF(**EVERYTHING), dtype=torch.float32)
    compressor = TopKEF(**EVERYTHING)
    ours = train(compressor, dtype=torch.bfloat16)
    assert compressor.registry.records["fc1.weight"].residual.dtype == torch.float32
    for name in reference:
        # bf16 keeps ~3 significant digits: training must follow the float32 run closely, not exactly.
        torch.testing.assert_close(ours[name].float(), reference[name], rtol=0.05, atol=0.02)


def test_process_set():
    my_set = SINGLE_RANK_SETS[hvd.rank()]
    plain = train(hvd.Compression.none, process_set=my_set)
    compressor = TopKEF(**EVERYTHING)
    ours = train(compressor, process_set=my_set)
    global_run = train(hvd.Compression.none)
    assert_same_params(ours, plain)
    assert differs(ours, global_run), "a one-rank process set must not average with the other rank"


@pytest.mark.parametrize("option", ["named", "groups_list", "op_sum", "two_backward_passes"])
def test_ratio_one_with_16_bit_indices_matches_plain_horovod(option):
    """The compact index encoding carries exactly the same entries: at ratio 1.0 training equals plain Horovod."""
    kwargs = OPTIONS[option]
    plain = train(hvd.Compression.none, **kwargs)
    compressor = TopKEF(**EVERYTHING, index_bits=16)
    ours = train(compressor, **kwargs)
    assert_same_params(ours, plain)
    assert compressor.stats()["tensors_compressed"] >= 8


@pytest.mark.parametrize("options", [{}, {"selector": "exact"}, {"value_dtype": "float16"},
                                     {"index_bits": 16, "value_dtype": "float8"},
                                     {"index_bits": 16, "value_dtype": "float8", "selector": "exact"}])
def test_error_feedback_invariant_at_one_percent(options):
    """Per tensor: sum of all ranks' gradients == P * sum of averaged (sent) gradients + sum of residuals."""
    compressor = TopKEF(ratio=0.01, **options)
    raw_sum, sent_sum = {}, {}
    averaged_nonzeros = {}

    def capture(model):
        for name, p in model.named_parameters():
            sent_sum[name] = sent_sum.get(name, 0) + p.grad.detach().clone()
            averaged_nonzeros.setdefault(name, []).append(int((p.grad != 0).sum()))

    # record raw gradients with tensor hooks: they see each gradient before Horovod's hooks reduce it
    import horovod_topk.torch  # noqa: F401
    from . import torch_harness

    original_net = torch_harness.Net

    class RecordingNet(original_net):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            for name, p in self.named_parameters():
                p.register_hook(lambda g, name=name: raw_sum.__setitem__(name, raw_sum.get(name, 0) + g.detach().clone()))

    torch_harness.Net = RecordingNet
    try:
        train(compressor, steps=5, on_synchronized=capture, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
    finally:
        torch_harness.Net = original_net

    checked = []
    for name, record in sorted(compressor.registry.records.items()):
        if record.residual is None:
            continue
        numel = record.residual.numel()
        total_raw = hvd.allreduce(raw_sum[name].reshape(-1), op=hvd.Sum, name=f"ef.raw.{name}")
        total_residual = hvd.allreduce(record.residual, op=hvd.Sum, name=f"ef.res.{name}")
        sent = hvd.size() * sent_sum[name].reshape(-1)
        torch.testing.assert_close(sent + total_residual, total_raw, rtol=1e-5, atol=1e-6)
        k = -(-numel // 100)
        assert max(averaged_nonzeros[name]) <= hvd.size() * k
        checked.append(name)
    assert {"fc1.weight", "fc2.weight", "sometimes.weight", "embed.weight"} <= set(checked)
    stats = compressor.stats()
    assert stats["compression_ratio"] > 5 and stats["residual_norm"] > 0


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20])
def test_timeline_shows_allgather_and_no_allreduce_for_compressed_tensors(bucket_bytes):
    """Per tensor: one allgather per compressed tensor. Bucketed: the compressed tensors' payloads travel in their
    bucket's one allgather, and no tensor has one of its own."""
    path = hvd.broadcast_object(tempfile.mktemp(suffix=".json", prefix="topk-timeline-"), root_rank=0)
    compressor = TopKEF(ratio=0.01, bucket_bytes=bucket_bytes)
    hvd.start_timeline(path)
    train(compressor, steps=3)
    hvd.stop_timeline()
    hvd.barrier()
    compressed = sorted(n for n, r in compressor.registry.records.items() if r.residual is not None)
    dense = sorted(n for n, r in compressor.registry.records.items() if r.residual is None)
    problems = []
    if hvd.rank() == 0:  # only rank 0 writes the timeline; its verdict is shared so every rank passes or fails
        events = timeline_activities(path)
        os.unlink(path)
        if bucket_bytes:
            (members,) = compressor.bucket_table.buckets
            bucket = bucket_collective_name([m for m in members if m in compressed])
            if "ALLGATHER" not in events.get(f"allgather.{bucket}", set()):
                problems.append(f"no ALLGATHER of the bucket {bucket}: {sorted(events)}")
        for name in compressed:
            own = "ALLGATHER" in events.get(f"allgather.topk.{name}", set())
            if own == bool(bucket_bytes):
                problems.append(f"{name}: {'an' if own else 'no'} ALLGATHER of its own payload")
            if f"allreduce.{name}" in events:
                problems.append(f"{name}: also went through an allreduce: {events[f'allreduce.{name}']}")
        for name in dense:
            if "ALLREDUCE" not in events.get(f"allreduce.{name}", set()):
                problems.append(f"{name}: dense tensor without ALLREDUCE")
    problems = hvd.broadcast_object(problems, root_rank=0)
    assert problems == []
    assert {"fc1.weight", "fc2.weight", "sometimes.weight", "embed.weight"} <= set(compressed)
    assert "head.bias" in dense


def test_topkef_sends_fewer_bytes_and_still_trains():
    compressor = TopKEF(ratio=0.01, min_numel=1024)
    initial = train(hvd.Compression.none, steps=0)
    trained = train(compressor, steps=6)
    stats = compressor.stats()
    assert stats["steps"] == 6
    assert stats["bytes_sent"] < stats["bytes_dense"] / 5
    assert differs(trained, initial)
    assert all(torch.isfinite(p).all() for p in trained.values())


def test_warmup_starts_dense_and_ends_sparse():
    compressor = TopKEF(ratio=0.01, warmup_steps=4)
    bytes_per_step = []

    def sent_bytes(model):
        bytes_per_step.append(compressor.stats()["bytes_sent"])

    train(compressor, steps=7, on_synchronized=sent_bytes)
    per_step = [b - a for a, b in zip([0] + bytes_per_step, bytes_per_step)]
    dense = compressor.stats()["bytes_dense"] // 7
    assert per_step[0] == dense, "step 0 runs at ratio 1: dense is cheaper, so everything goes dense"
    assert all(a >= b for a, b in zip(per_step, per_step[1:])), per_step
    assert per_step[-1] < dense / 5


def test_momentum_correction_trains_and_refuses_optimizer_momentum():
    compressor = TopKEF(ratio=0.01, momentum=0.9)
    initial = train(hvd.Compression.none, steps=0)
    trained = train(compressor, steps=4, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
    record = compressor.registry.records["fc1.weight"]
    assert record.momentum is not None and int((record.momentum == 0).sum()) >= 21  # masked where sent
    assert differs(trained, initial) and all(torch.isfinite(p).all() for p in trained.values())
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="momentum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=model.named_parameters(), compression=compressor)


def test_sampled_selector_trains_exactly_like_exact_top_k():
    """The sampled selector picks the exact top-k set, so training follows the exact selector step for step."""
    exact = train(TopKEF(ratio=0.01, selector="exact"), steps=6)
    sampled = train(TopKEF(ratio=0.01, selector="sampled"), steps=6)
    assert_same_params(sampled, exact)


@pytest.mark.parametrize("options", [{}, {"selector": "exact"}, {"index_bits": 16, "value_dtype": "float8"}])
def test_grad_holds_this_ranks_gradient_until_synchronize(options):
    """Horovod's semantics: between backward() and synchronize() a parameter's .grad is this rank's own gradient
    (code that logs gradient norms or checks frozen layers reads it there); synchronize() then writes the average."""
    import copy

    from .torch_harness import Net, batch

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    compressor = TopKEF(ratio=0.01, **options)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compressor)
    x, tokens, y = batch(0)
    torch.nn.functional.cross_entropy(model(x, tokens, True), y).backward()
    own = torch.autograd.grad(torch.nn.functional.cross_entropy(reference(x, tokens, True), y),
                              list(reference.parameters()))
    # (a dense tensor's .grad is reduced in place by Horovod's own allreduce meanwhile, as without TopKEF)
    compressed = [name for name, record in compressor.registry if record.residual is not None]
    assert {"fc1.weight", "fc2.weight", "sometimes.weight"} <= set(compressed)
    for (name, p), g in zip(model.named_parameters(), own):
        if name in compressed:
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, msg=lambda m: f"{name} before synchronize: {m}")
    opt.synchronize()
    averaged = model.fc1.weight.grad
    assert int((averaged != 0).sum()) <= hvd.size() * -(-averaged.numel() // 100)
    assert not torch.equal(averaged, own[1])
