"""The compact wire encoding (16-bit segmented indices, float8 values): round trips and exact error feedback."""
import pytest
import torch

from horovod_topk.core.payload import SEGMENT_BITS, payload_layout
from horovod_topk.torch import encoding, ops


def _pairs(numel, k, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randperm(numel, generator=gen)[:k].to(torch.int32)
    values = (torch.randn(k, generator=gen) * torch.rand(k, generator=gen).pow(4) * 10).to(dtype)
    return indices, values


@pytest.mark.parametrize("numel", [70_000, 3 * (1 << SEGMENT_BITS) + 5, 200_000])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_16_bit_indices_round_trip_for_every_rank(numel, value_dtype):
    k = 700
    layout = payload_layout(k, numel, torch.tensor([], dtype=value_dtype).element_size(), index_bits=16)
    assert layout.compact and layout.segments == -(-numel // (1 << SEGMENT_BITS))
    sent = []
    for rank in range(3):
        indices, values = _pairs(numel, k, rank, value_dtype)
        residual = torch.zeros(numel)
        payload = encoding.encode(indices, values, residual, layout)
        assert payload.dtype == torch.uint8 and payload.numel() == layout.nbytes
        assert torch.count_nonzero(residual) == 0  # nothing rounds: the residual is untouched
        sent.append((indices, values, payload))
    got_indices, got_values = encoding.decode(torch.cat([p for _, _, p in sent]), 3, layout, value_dtype)
    for rank, (indices, values, _) in enumerate(sent):
        order = torch.argsort(indices.long())
        assert torch.equal(got_indices[rank], indices.long()[order])
        assert torch.equal(got_values[rank], values[order])


def test_16_bit_indices_cost_two_bytes_per_entry_plus_a_count_per_segment():
    plain = payload_layout(1000, 1 << 20, 4)
    compact = payload_layout(1000, 1 << 20, 4, index_bits=16)
    assert plain.nbytes == 8000
    assert compact.nbytes == 16 * 4 + 1000 * 2 + 1000 * 4
    both = payload_layout(1000, 1 << 20, 1, index_bits=16, scaled=True)
    assert both.nbytes == 8 + 16 * 4 + 1000 * 3  # 3 bytes per entry where the plain layout needs 8


def test_float8_rounding_goes_back_into_the_residual():
    numel, k = 100_000, 1000
    indices, values = _pairs(numel, k, 7)
    residual = torch.randn(numel) * 1e-3
    before = residual.clone()
    layout = payload_layout(k, numel, 1, index_bits=16, scaled=True)
    payload = encoding.encode(indices, values, residual, layout)
    got_indices, got_values = encoding.decode(payload, 1, layout, torch.float32)
    sent = ops.scatter_sum(got_indices, got_values, numel, torch.float32)
    exact = before.clone()
    exact.index_add_(0, indices.long(), values)
    # error feedback: what was sent plus what stayed is what there was
    torch.testing.assert_close(sent + residual, exact, rtol=2**-22, atol=1e-6)  # one float32 rounding of the sum
    relative = (got_values[0] - values[torch.argsort(indices.long())]).abs() / values.abs().max()
    assert 0 < relative.max() <= 2 ** -4  # e4m3: 3 mantissa bits, relative to the payload's scale at worst
    assert got_values[0].abs().max() == pytest.approx(values.abs().max().item(), rel=1e-6)  # the largest is exact


def test_float8_sends_non_finite_values_as_nan_and_keeps_them_out_of_the_residual():
    numel, k = 5000, 10
    indices = torch.arange(k, dtype=torch.int32) * 3
    values = torch.linspace(-1, 1, k)
    values[2], values[5] = float("inf"), float("nan")
    residual = torch.zeros(numel)
    layout = payload_layout(k, numel, 1, index_bits=32, scaled=True)
    _, got = encoding.decode(encoding.encode(indices, values, residual, layout), 1, layout, torch.float32)
    assert torch.isnan(got[0, 2]) and torch.isnan(got[0, 5])
    assert torch.isfinite(residual).all()
    assert torch.isfinite(got[0, [0, 1, 3, 4, 6, 7, 8, 9]]).all()


def test_float8_of_an_all_zero_selection_is_zero_not_nan():
    layout = payload_layout(4, 100, 1, index_bits=16, scaled=True)
    residual = torch.zeros(100)
    payload = encoding.encode(torch.arange(4, dtype=torch.int32), torch.zeros(4), residual, layout)
    _, got = encoding.decode(payload, 1, layout, torch.float32)
    assert torch.equal(got, torch.zeros(1, 4)) and torch.equal(residual, torch.zeros(100))


def test_the_compact_encoding_calls_no_op_that_would_synchronise_on_a_gpu():
    from .sync_check import recorded_ops, syncing

    numel, k = 3 * (1 << SEGMENT_BITS) + 5, 500
    indices, values = _pairs(numel, k, 5)
    values[3] = float("nan")
    layout = payload_layout(k, numel, 1, index_bits=16, scaled=True)
    residual = torch.zeros(numel)

    def run():
        payload = encoding.encode(indices, values, residual, layout)
        encoding.decode(torch.cat([payload, payload]), 2, layout, torch.float32)

    ops_called = recorded_ops(run)
    assert "aten.searchsorted.Tensor" in ops_called and len(ops_called) > 20  # the recording works
    assert syncing(ops_called) == []
