import pytest
import torch

from horovod_topk.core import PayloadLayout
from horovod_topk.torch import ops


def _sent_dense(indices, values, numel, dtype):
    sent = torch.zeros(numel, dtype=dtype)
    sent[indices.long()] = values.to(dtype)
    return sent


@pytest.mark.parametrize("k", [1, 10, 1000])
def test_selection_keeps_the_k_largest_and_loses_no_mass(k):
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(1000, generator=gen)
    residual = torch.randn(1000, generator=gen) * 0.1
    compensated = residual + grad
    indices, values = ops.compensate_and_select(grad, residual, k, torch.float32)
    assert indices.dtype == torch.int32 and indices.shape == (k,) and values.shape == (k,)
    assert len(set(indices.tolist())) == k
    expected = set(torch.topk(compensated.abs(), k).indices.tolist())
    assert set(indices.tolist()) == expected
    torch.testing.assert_close(_sent_dense(indices, values, 1000, torch.float32) + residual, compensated)
    assert torch.all(residual[indices.long()] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rounding_stays_in_the_float32_residual(dtype):
    gen = torch.Generator().manual_seed(1)
    grad = (torch.randn(4096, generator=gen) * 3).to(dtype)
    residual = torch.randn(4096, generator=gen, dtype=torch.float32) * 1e-3
    compensated = residual + grad.float()
    indices, values = ops.compensate_and_select(grad, residual, 64, dtype)
    assert values.dtype == dtype and residual.dtype == torch.float32
    rounding = residual[indices.long()]
    assert rounding.abs().max() > 0, "float32 + small residual must round when sent in half precision"
    torch.testing.assert_close(_sent_dense(indices, values, 4096, torch.float32) + residual, compensated,
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_pack_unpack_round_trip_for_every_rank(dtype, k):
    layout = PayloadLayout(k, torch.tensor([], dtype=dtype).element_size())
    rows = []
    for rank in range(3):
        idx = torch.arange(k, dtype=torch.int32) * 7 + rank
        val = (torch.arange(k) + 100 * rank).to(dtype)
        buf = ops.pack(idx, val, layout)
        assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes
        rows.append((idx, val, buf))
    gathered = torch.cat([b for _, _, b in rows])
    indices, values = ops.unpack(gathered, 3, layout, dtype)
    for rank, (idx, val, _) in enumerate(rows):
        assert torch.equal(indices[rank], idx) and torch.equal(values[rank], val)


def test_scatter_sum_adds_entries_of_all_ranks_including_collisions():
    indices = torch.tensor([[0, 5], [5, 9]], dtype=torch.int32)
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    dense = ops.scatter_sum(indices, values, 10, torch.float32)
    expected = torch.zeros(10)
    expected[0], expected[5], expected[9] = 1.0, 5.0, 4.0
    assert torch.equal(dense, expected)


def test_residual_dtype():
    assert ops.residual_dtype(torch.float16) == torch.float32
    assert ops.residual_dtype(torch.bfloat16) == torch.float32
    assert ops.residual_dtype(torch.float64) == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_leftovers_sends_them_with_a_finite_tensor_and_keeps_them_otherwise(dtype):
    residual = torch.tensor([0.5, -0.25, 0.0, 1.0])
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype).view(2, 2)
    flag = ops.add_leftovers(grad, residual)
    assert flag.dtype == torch.int64 and int(flag) == 0
    assert torch.equal(grad, torch.tensor([[1.5, 1.75], [3.0, 5.0]], dtype=dtype)) and not residual.any()

    residual = torch.tensor([0.5, -0.25, 0.0, 1.0])
    bad = torch.tensor([1.0, float("nan"), 3.0, float("inf")], dtype=dtype)
    flag = ops.add_leftovers(bad, residual)
    assert int(flag) == 1
    assert torch.equal(residual, torch.tensor([0.5, -0.25, 0.0, 1.0]))  # kept for a later step
    assert bad[0] == 1.0 and bad[2] == 3.0  # nothing of the leftovers went into a non-finite step


def test_leftovers_travel_once_then_a_dense_tensor_costs_nothing():
    """On the CPU a tensor that goes dense sends its residual once and drops it: later dense steps leave the
    gradient as it is, a non-finite gradient keeps the residual, and a later compressed step starts from zeros."""
    from horovod_topk.torch.ddp import TopKEFState

    state = TopKEFState(ratio=0.5, min_numel=0)
    record = state.registry.record("w", (8,))
    record.residual = torch.arange(8.0)
    bad = torch.full((8,), float("nan"))
    state._send_leftovers(record, bad)
    assert torch.equal(record.residual, torch.arange(8.0)) and record.nonfinite_steps == 1
    first = torch.ones(8)
    state._send_leftovers(record, first)
    assert torch.equal(first, 1.0 + torch.arange(8.0)) and record.residual is None
    second = torch.ones(8)
    state._send_leftovers(record, second)
    assert torch.equal(second, torch.ones(8))
    residual, _ = state._state_buffers("w", record, torch.ones(8))
    assert torch.equal(residual, torch.zeros(8)) and record.residual is residual
