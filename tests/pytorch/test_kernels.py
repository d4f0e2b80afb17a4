"""The fused kernel against the exact reference (ops.compensate_and_select), on one process."""
import math

import pytest
import torch

from horovod_topk.core import PayloadLayout
from horovod_topk.torch import kernels, ops

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="the fused kernels could not be built here")


def test_compress_only_reads_the_gradient():
    """Until decompress writes the average, .grad holds this rank's gradient (Horovod's semantics)."""
    grad, residual = torch.randn(5000), torch.zeros(5000)
    original = grad.clone()
    _compress(residual, grad, 50)
    assert torch.equal(grad, original)
    assert torch.equal(torch.count_nonzero(residual), torch.tensor(5000 - 50))
    assert torch.all((residual == 0) | (residual == original))


def _compress(residual, grad, k, wire=torch.float32, momentum_buffer=None, momentum=0.0, seed=1):
    layout = PayloadLayout(k, torch.empty(0, dtype=wire).element_size())
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    info = K.compress(residual, grad, momentum_buffer, momentum, k, layout.values_offset, payload,
                      torch.empty(0, dtype=wire), max(2048, 100 * grad.numel() // k), seed)
    indices, values = ops.unpack(payload, 1, layout, wire)
    return indices[0], values[0], info


def _gradient(kind, n, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen)
    if kind == "heavy-tailed":  # Student-t with 2 degrees of freedom: a few entries dominate
        chi2 = torch.randn(n, generator=gen) ** 2 + torch.randn(n, generator=gen) ** 2
        g = g / torch.sqrt(chi2 / 2)
    return g


@pytest.mark.parametrize("kind", ["gaussian", "heavy-tailed"])
@pytest.mark.parametrize("ratio", [0.1, 0.01, 0.001])
def test_exactly_k_no_mass_lost_and_the_exact_top_k(kind, ratio):
    n = 200_000
    k = math.ceil(ratio * n)
    grad = _gradient(kind, n, 0)
    residual = _gradient(kind, n, 1) * 0.1
    compensated = residual + grad
    indices, values, info = _compress(residual, grad.clone(), k)
    assert indices.numel() == k and len(set(indices.tolist())) == k
    assert torch.all(indices[1:] > indices[:-1]), "indices are ascending"
    sent = torch.zeros(n)
    sent[indices.long()] = values
    torch.testing.assert_close(sent + residual, compensated, rtol=0, atol=0)
    exact = set(torch.topk(compensated.abs(), k).indices.tolist())
    overlap = len(exact & set(indices.tolist())) / k
    # the sampled threshold only finds candidates; the final k are the k largest of them, which contain the
    # exact top-k whenever the threshold is below the k-th magnitude (always, after the rescans)
    assert overlap == 1.0, overlap
    assert info[2] >= 1


def test_a_misleading_sample_rescans_and_puts_the_unsent_candidates_back():
    """Large values exactly where the kernel samples (runs of 16 at a fixed stride): the first threshold is far too
    high, the rescan finds ~2k candidates for k = 1000, and the ~1k candidates not sent go back to the residual."""
    n, k, sample, seed = 100_000, 1000, 2048, 1
    runs = sample // 16
    stride = (n // runs) // 16 * 16
    start = (seed % (stride // 16)) * 16
    grad = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-3
    sampled = torch.cat([torch.arange(b, min(b + 16, n)) for b in range(start, n, stride)])
    grad[sampled] = 10.0 + torch.rand(sampled.numel(), generator=torch.Generator().manual_seed(4))
    residual = torch.zeros(n)
    layout = PayloadLayout(k, 4)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    info = K.compress(residual, grad.clone(), None, 0.0, k, layout.values_offset, payload, torch.empty(0), sample,
                      seed)
    assert info[2] >= 2, f"no rescan happened ({info}): the test no longer covers that path"
    indices, values = (t[0] for t in ops.unpack(payload, 1, layout, torch.float32))
    assert indices.numel() == k and torch.all(indices[1:] > indices[:-1])
    sent = torch.zeros(n)
    sent[indices.long()] = values
    torch.testing.assert_close(sent + residual, grad, rtol=0, atol=0)
    assert set(indices.tolist()) == set(torch.topk(grad.abs(), k).indices.tolist())


def test_a_sample_that_sets_the_threshold_too_low_makes_every_entry_a_candidate_and_k_still_leave():
    """The opposite of a misleading high sample: tiny values exactly where the kernel samples, large ones elsewhere,
    so the threshold is near zero and nearly every entry is a candidate: the candidate list grows far past its
    first capacity (2k + 64) during the pass, and exactly the k largest leave, the others back in the residual."""
    n, k, sample, seed = 100_000, 1000, 2048, 1
    runs = sample // 16
    stride = (n // runs) // 16 * 16
    start = (seed % (stride // 16)) * 16
    grad = 1.0 + torch.rand(n, generator=torch.Generator().manual_seed(6))
    grad[::3] *= -1.0
    sampled = torch.cat([torch.arange(b, min(b + 16, n)) for b in range(start, n, stride)])
    grad[sampled] = 1e-6
    residual = torch.zeros(n)
    layout = PayloadLayout(k, 4)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    info = K.compress(residual, grad.clone(), None, 0.0, k, layout.values_offset, payload, torch.empty(0), sample,
                      seed)
    assert info[0] > 50 * k, f"the first scan found only {info[0]} candidates: the test no longer covers the growth"
    indices, values = (t[0] for t in ops.unpack(payload, 1, layout, torch.float32))
    assert indices.numel() == k and torch.all(indices[1:] > indices[:-1])
    sent = torch.zeros(n)
    sent[indices.long()] = values
    torch.testing.assert_close(sent + residual, grad, rtol=0, atol=0)
    assert set(indices.tolist()) == set(torch.topk(grad.abs(), k).indices.tolist())


@pytest.mark.parametrize("distinct", [1, 3, 700])
def test_ties_at_the_kth_magnitude_give_exactly_k(distinct):
    """Few distinct magnitudes (e.g. quantized gradients): the radix selection ends on a bucket of equal keys."""
    n, k = 20_000, 500
    levels = torch.arange(1, distinct + 1, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    grad = levels[torch.randint(0, distinct, (n,), generator=gen)] * torch.where(
        torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    residual = torch.zeros(n)
    indices, values, _ = _compress(residual, grad.clone(), k)
    assert indices.numel() == k and len(set(indices.tolist())) == k
    sent = torch.zeros(n)
    sent[indices.long()] = values
    torch.testing.assert_close(sent + residual, grad, rtol=0, atol=0)
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[indices.long()] = True
    assert grad.abs()[chosen].min() >= grad.abs()[~chosen].max()


def test_float16_wire_keeps_the_rounding_in_the_residual():
    n, k = 50_000, 500
    grad = torch.randn(n) * 3
    residual = torch.randn(n) * 1e-3
    compensated = residual + grad
    indices, values, _ = _compress(residual, grad.clone(), k, wire=torch.float16)
    assert values.dtype == torch.float16
    assert residual[indices.long()].abs().max() > 0
    sent = torch.zeros(n)
    sent[indices.long()] = values.float()
    torch.testing.assert_close(sent + residual, compensated, rtol=0, atol=1e-7)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_gradient_dtypes(grad_dtype):
    n, k = 10_000, 100
    grad = torch.randn(n).to(grad_dtype)
    residual = torch.zeros(n, dtype=ops.residual_dtype(grad_dtype))
    indices, values, _ = _compress(residual, grad.clone(), k, wire=grad_dtype)
    magnitude = grad.to(residual.dtype).abs()
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[indices.long()] = True
    assert chosen.sum() == k
    assert magnitude[chosen].min() >= magnitude[~chosen].max()  # a top-k set (bf16 has ties at the k-th)


def test_momentum_correction_matches_the_reference_and_masks():
    n, k, m = 20_000, 200, 0.9
    r1, u1 = torch.zeros(n), torch.zeros(n)
    r2, u2 = torch.zeros(n), torch.zeros(n)
    for step in range(3):
        grad = _gradient("gaussian", n, 10 + step)
        idx_fused, val_fused, _ = _compress(r1, grad.clone(), k, momentum_buffer=u1, momentum=m, seed=step)
        idx_ref, val_ref = ops.compensate_and_select(grad.clone(), r2, k, torch.float32, u2, m)
        assert torch.equal(idx_fused, idx_ref) and torch.equal(val_fused, val_ref)
        torch.testing.assert_close(r1, r2) and torch.testing.assert_close(u1, u2)
        assert torch.all(u1[idx_fused.long()] == 0) and torch.all(r1[idx_fused.long()] == 0)


@pytest.mark.parametrize("world,n,offset", [(1, 30_000, 0), (2, 30_000, 0), (5, 30_000, 0),
                                             (2, 700_001, 0), (2, 700_001, 3)],
                         ids=["P1", "P2", "P5", "P2-streamed", "P2-streamed-unaligned"])
def test_decompress_equals_the_reference_scatter(world, n, offset):
    """Above 1 MiB the output is written with streaming stores (an unaligned start and an odd tail included)."""
    k = n // 100
    layout = PayloadLayout(k, 4)
    payloads = []
    for rank in range(world):
        residual = torch.zeros(n)
        grad = _gradient("gaussian", n, 100 + rank)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        K.compress(residual, grad, None, 0.0, k, layout.values_offset, payload, torch.empty(0), 4096, rank)
        payloads.append(payload)
    gathered = torch.cat(payloads)
    # the gradient buffer still holds this rank's gradient: decompress overwrites it (a view at ``offset`` into a
    # larger buffer, whose other elements must stay as they are)
    whole = torch.randn(n + offset + 5)
    out = whole[offset:offset + n]
    before = whole.clone()
    K.decompress(gathered, world, k, layout.values_offset, layout.nbytes, torch.empty(0), 0.5, out)
    indices, values = ops.unpack(gathered, world, layout, torch.float32)
    expected = ops.scatter_sum(indices, values, n, torch.float32) * 0.5
    torch.testing.assert_close(out, expected)
    assert torch.equal(whole[:offset], before[:offset]) and torch.equal(whole[offset + n:], before[offset + n:])


def _reference_decompress(out, indices, values, scale):
    """What decompress computes, entry by entry in payload order: out = 0, then out[i] = O(float(out[i]) +
    float(scale * double(v))) for each payload's entries in turn; a float64 output sums in float64."""
    if out.dtype == torch.float64:
        expected = torch.zeros(out.numel(), dtype=torch.float64)
        for idx, val in zip(indices, values):
            for i, c in zip(idx.tolist(), (val.double() * scale).tolist()):
                expected[i] += c
        return expected
    expected = torch.zeros(out.numel(), dtype=torch.float32)
    for idx, val in zip(indices, values):
        contribution = (val.double() * scale).float()
        if idx.unique().numel() == idx.numel():
            expected[idx.long()] = (expected[idx.long()].to(out.dtype).float() + contribution).to(out.dtype).float()
        else:
            for i, c in zip(idx.tolist(), contribution):
                expected[i] = (expected[i] + c).to(out.dtype).float()  # a float32 sum, rounded to the output's type
    return expected.to(out.dtype)


@pytest.mark.parametrize("order", ["ascending", "repeats", "descending"])
@pytest.mark.parametrize("out_dtype,wire", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                            (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                            (torch.float64, torch.float32)],
                         ids=["f32", "f32-wire16", "f16", "bf16", "f64"])
@pytest.mark.parametrize("n,offset", [(10_000, 0), (600_007, 1)], ids=["cached", "streamed-unaligned"])
def test_decompress_is_the_payload_order_sum_bit_for_bit(order, out_dtype, wire, n, offset):
    """The output is composed block by block from ascending payloads (duplicates included); other orders take
    the zero-then-scatter path. Both give, bit for bit, the payloads added in order. 600,007 elements are above
    the 1 MiB where the writes stream for 2-byte outputs too, and an odd offset leaves an unaligned head."""
    world, k = 3, n // 50
    gen = torch.Generator().manual_seed(n + world)
    layout = PayloadLayout(k, torch.empty(0, dtype=wire).element_size())
    indices, values, payloads = [], [], []
    for rank in range(world):
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        if order == "repeats":  # ascending with runs of the same index, as at a block's edge
            idx = idx.repeat_interleave(2)[:k]
        elif order == "descending" and rank == 1:
            idx = idx.flip(0)
        idx[-1] = n - 1 if order != "descending" or rank != 1 else idx[-1]  # the last block's last element
        val = torch.randn(k, generator=gen).to(wire)
        indices.append(idx.to(torch.int32))
        values.append(val)
        payloads.append(ops.pack(idx.to(torch.int32), val, layout))
    whole = torch.randn(n + offset + 3).to(out_dtype)
    out = whole[offset:offset + n]
    before = whole.clone()
    K.decompress(torch.cat(payloads), world, k, layout.values_offset, layout.nbytes, torch.empty(0, dtype=wire),
                 1 / world, out)
    assert torch.equal(out, _reference_decompress(out, indices, values, 1 / world))
    assert torch.equal(whole[:offset], before[:offset]) and torch.equal(whole[offset + n:], before[offset + n:])


def test_decompress_refuses_out_of_range_indices():
    layout = PayloadLayout(1, 4)
    bad = ops.pack(torch.tensor([10], dtype=torch.int32), torch.tensor([1.0]), layout)
    with pytest.raises(RuntimeError, match="out of range"):
        K.decompress(bad, 1, 1, layout.values_offset, layout.nbytes, torch.empty(0), 1.0, torch.zeros(5))


def _nonfinite_gradient(bad, n=10_000):
    grad = torch.randn(n, generator=torch.Generator().manual_seed(8))
    grad[[17, 5000]] = bad
    return grad


def _check_nonfinite_step(bad, grad, residual, before, momentum_buffer, momentum_before, indices, values, k):
    finite = torch.isfinite(grad)
    expected_u = torch.where(finite, momentum_before * 0.9 + torch.where(finite, grad, 0), momentum_before)
    torch.testing.assert_close(momentum_buffer, expected_u, rtol=0, atol=0)
    torch.testing.assert_close(residual, torch.where(finite, before + expected_u, before), rtol=0, atol=0)
    assert torch.isfinite(residual).all() and torch.isfinite(momentum_buffer).all()
    assert indices[:2].tolist() == [17, 5000] and set(indices.tolist()) == {17, 5000} and indices.numel() == k
    assert not torch.isfinite(values.float()).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("wire", [torch.float32, torch.float16])
def test_nonfinite_gradient_entries_are_sent_and_never_enter_the_residual(bad, wire):
    n, k = 10_000, 100
    grad = _nonfinite_gradient(bad, n)
    residual, momentum_buffer = torch.randn(n), torch.randn(n)
    before, momentum_before = residual.clone(), momentum_buffer.clone()
    buffer = grad.clone()
    indices, values, info = _compress(residual, buffer, k, wire=wire, momentum_buffer=momentum_buffer, momentum=0.9)
    assert info[0] == -1 and info[1] == 2
    torch.testing.assert_close(buffer, grad, rtol=0, atol=0, equal_nan=True)  # only read
    _check_nonfinite_step(bad, grad, residual, before, momentum_buffer, momentum_before, indices, values, k)
    out = buffer
    layout = PayloadLayout(k, torch.empty(0, dtype=wire).element_size())
    K.decompress(ops.pack(indices, values, layout), 1, k, layout.values_offset, layout.nbytes,
                 torch.empty(0, dtype=wire), 1.0, out)
    assert not torch.isfinite(out[[17, 5000]]).any() and torch.count_nonzero(out) == 2  # the rest zeroed


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_simd_path_leaves_the_residual_untouched_at_nonfinite_entries(bad):
    """No momentum: float32 goes through the vector loop, which hands a block with NaN/Inf to the scalar step."""
    n, k = 10_000, 100
    grad = _nonfinite_gradient(bad, n)
    residual = torch.randn(n)
    before = residual.clone()
    indices, values, info = _compress(residual, grad.clone(), k)
    finite = torch.isfinite(grad)
    assert info[0] == -1
    torch.testing.assert_close(residual, torch.where(finite, before + torch.where(finite, grad, 0), before),
                               rtol=0, atol=0)
    assert set(indices.tolist()) == {17, 5000}


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_the_reference_path_handles_nonfinite_entries_like_the_kernel(bad):
    n, k = 10_000, 100
    grad = _nonfinite_gradient(bad, n)
    residual, momentum_buffer = torch.randn(n), torch.randn(n)
    before, momentum_before = residual.clone(), momentum_buffer.clone()
    indices, values = ops.compensate_nonfinite(grad, residual, k, torch.float32, momentum_buffer, 0.9)
    _check_nonfinite_step(bad, grad, residual, before, momentum_buffer, momentum_before, indices, values, k)
    untouched = residual.clone()
    assert ops.compensate_nonfinite(torch.randn(n), residual, k, torch.float32) is None
    assert torch.equal(residual, untouched)
    few = ops.compensate_nonfinite(grad, residual, 1, torch.float32)
    assert few[0].tolist() == [17]


def test_a_build_lock_left_by_a_killed_compile_is_removed_and_a_fresh_one_kept(tmp_path):
    import os
    import time
    import warnings

    from horovod_topk.torch.kernels import STALE_LOCK_SECONDS, remove_stale_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not remove_stale_lock(str(tmp_path)) and lock.exists()  # a compile may be running: wait for it
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert remove_stale_lock(str(tmp_path))
    assert not lock.exists() and "build lock" in str(caught[0].message)
    assert not remove_stale_lock(str(tmp_path))  # nothing there: nothing to do


def _members(seed, sizes=(5000, 1, 3000, 70_000), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    residuals = [0.1 * torch.randn(n, generator=gen).to(dtype) for n in sizes]
    ks = [max(1, n // 100) for n in sizes]
    return grads, residuals, ks


@pytest.mark.parametrize("dtype,wire,momentum", [(torch.float32, torch.float32, 0.0),
                                                 (torch.float64, torch.float64, 0.0),
                                                 (torch.float32, torch.float16, 0.0),
                                                 (torch.float32, torch.float32, 0.9)])
def test_a_group_writes_what_each_member_alone_writes(dtype, wire, momentum):
    """compress_group / decompress_group (one call for a bucket) give every member the bytes, residual, momentum
    buffer and averaged gradient compress / decompress give it alone, bit for bit; a NaN in one member's gradient
    stays that member's (its bucket-mates select as usual)."""
    grads, residuals, ks = _members(3, dtype=dtype)
    grads[2][17] = float("nan")
    wire_size = torch.empty(0, dtype=wire).element_size()
    layouts = [PayloadLayout(k, wire_size) for k in ks]
    samples = [max(2048, 100 * g.numel() // k) for g, k in zip(grads, ks)]
    momenta = [torch.randn(g.numel(), dtype=dtype) for g in grads] if momentum else []
    alone_r, alone_u = [r.clone() for r in residuals], [u.clone() for u in momenta]
    payloads, flags = [], []
    for i, (g, layout) in enumerate(zip(grads, layouts)):
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        info = K.compress(alone_r[i], g, alone_u[i] if momenta else None, momentum, layout.k, layout.values_offset,
                          payload, torch.empty(0, dtype=wire), samples[i], 5 + i)
        payloads.append(payload)
        flags.append(info[0] < 0)
    group = torch.empty(sum(layout.nbytes for layout in layouts), dtype=torch.uint8)
    first = K.compress_group(residuals, grads, momenta, momentum, ks, [layout.values_offset for layout in layouts],
                             [layout.nbytes for layout in layouts], group, torch.empty(0, dtype=wire), samples,
                             [5 + i for i in range(len(grads))])
    assert [f < 0 for f in first] == flags == [False, False, True, False]
    assert torch.equal(group, torch.cat(payloads))
    for mine, theirs in zip(residuals + momenta, alone_r + alone_u):
        assert torch.equal(mine, theirs)
    # two ranks' payloads: the second rank's made from other gradients; rows are a view into a longer buffer
    other_grads, other_residuals, _ = _members(4, dtype=dtype)
    other = torch.empty_like(group)
    K.compress_group(other_residuals, other_grads, [u.clone() for u in momenta], momentum, ks,
                     [layout.values_offset for layout in layouts], [layout.nbytes for layout in layouts], other,
                     torch.empty(0, dtype=wire), samples, [0] * len(grads))
    gathered = torch.zeros(2, group.numel() + 24, dtype=torch.uint8)
    gathered[0, :group.numel()], gathered[1, :group.numel()] = group, other
    rows = gathered[:, :group.numel()]
    outs = [torch.full_like(g, 7.0) for g in grads]
    K.decompress_group(rows, ks, [layout.values_offset for layout in layouts], [layout.nbytes for layout in layouts],
                       torch.empty(0, dtype=wire), 0.5, outs)
    start = 0
    for i, layout in enumerate(layouts):
        end = start + layout.nbytes
        alone = torch.full_like(grads[i], 7.0)
        K.decompress(rows[:, start:end].contiguous().view(-1), 2, layout.k, layout.values_offset, layout.nbytes,
                     torch.empty(0, dtype=wire), 0.5, alone)
        assert torch.equal(outs[i], alone) or (torch.isnan(outs[i]).any() and torch.equal(
            torch.nan_to_num(outs[i], nan=1.5), torch.nan_to_num(alone, nan=1.5)))
        start = end


def test_a_bad_payload_in_one_member_leaves_every_gradient_of_the_group_unwritten():
    grads, residuals, ks = _members(5)
    layouts = [PayloadLayout(k, 4) for k in ks]
    group = torch.empty(sum(layout.nbytes for layout in layouts), dtype=torch.uint8)
    K.compress_group(residuals, grads, [], 0.0, ks, [layout.values_offset for layout in layouts],
                     [layout.nbytes for layout in layouts], group, torch.empty(0), [2048] * 4, [0] * 4)
    rows = torch.stack([group, group.clone()])
    last = sum(layout.nbytes for layout in layouts[:3])
    rows[1, last:last + 4].view(torch.int32)[0] = 10 ** 9  # the last member's first index, on the second rank
    outs = [g.clone() for g in grads]
    with pytest.raises(RuntimeError, match="out of range for a tensor of 70000 elements"):
        K.decompress_group(rows, ks, [layout.values_offset for layout in layouts],
                           [layout.nbytes for layout in layouts], torch.empty(0), 0.5, outs)
    for out, g in zip(outs, grads):
        assert torch.equal(out, g)


def test_a_group_call_names_what_does_not_fit():
    grads, residuals, ks = _members(6)
    layouts = [PayloadLayout(k, 4) for k in ks]
    short = torch.empty(sum(layout.nbytes for layout in layouts) - 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="payload of .* bytes for members of"):
        K.compress_group(residuals, grads, [], 0.0, ks, [layout.values_offset for layout in layouts],
                         [layout.nbytes for layout in layouts], short, torch.empty(0), [2048] * 4, [0] * 4)
    with pytest.raises(RuntimeError, match="one entry per member"):
        K.compress_group(residuals, grads[:3], [], 0.0, ks, [layout.values_offset for layout in layouts],
                         [layout.nbytes for layout in layouts], short, torch.empty(0), [2048] * 4, [0] * 4)


def _group_refused(residuals, grads, ks, layouts, match):
    """compress_group over ``layouts`` raises ``match``, and no member's residual changed."""
    payload = torch.empty(sum(layout.nbytes for layout in layouts), dtype=torch.uint8)
    before = [r.clone() for r in residuals]
    with pytest.raises(RuntimeError, match=match):
        K.compress_group(residuals, grads, [], 0.0, ks, [layout.values_offset for layout in layouts],
                         [layout.nbytes for layout in layouts], payload, torch.empty(0), [2048] * 4, [0] * 4)
    assert all(torch.equal(r, b) for r, b in zip(residuals, before))
    return payload


def test_a_layout_too_small_for_its_values_is_refused_before_anything_is_written():
    """A payload layout made for another value size (2-byte values, float32 on the wire) would write past its
    member: compress, a group and decompress refuse it by name, and a group touches no member's residual."""
    grads, residuals, ks = _members(7)
    narrow = [PayloadLayout(k, 2) for k in ks]
    payload = _group_refused(residuals, grads, ks, narrow, "cannot hold")
    with pytest.raises(RuntimeError, match="cannot hold"):
        K.compress(residuals[0], grads[0], None, 0.0, ks[0], narrow[0].values_offset,
                   torch.empty(narrow[0].nbytes, dtype=torch.uint8), torch.empty(0), 2048, 0)
    rows = torch.zeros(2, payload.numel(), dtype=torch.uint8)
    outs = [g.clone() for g in grads]
    with pytest.raises(RuntimeError, match="cannot hold"):
        K.decompress_group(rows, ks, [layout.values_offset for layout in narrow], [layout.nbytes for layout in narrow],
                           torch.empty(0), 0.5, outs)
    assert all(torch.equal(o, g) for o, g in zip(outs, grads))


def test_a_group_with_one_member_it_cannot_take_touches_none():
    """The last member's gradient is of a dtype the kernel does not take: the call raises before the first
    member's entries leave its residual (its payload would be dropped with them)."""
    grads, residuals, ks = _members(8)
    grads[-1] = grads[-1].to(torch.int32)
    _group_refused(residuals, grads, ks, [PayloadLayout(k, 4) for k in ks], "unsupported gradient dtype")
