"""The sparse allreduce's arithmetic (torch.sparse_rounds) against a plain reference, P ranks simulated in one
process: the alltoall and the allgather are done by hand between the ranks' SparseRounds.

The real collectives are tested with real workers (tests/parallel_torch/test_torch_sparse_allreduce.py,
tests/launched/test_sparse_allreduce_4.py, tests/ddp); here the arithmetic is checked entry by entry, for buckets
of several members, mixed sizes, non-finite values and half-precision wire values.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
import torch

from horovod_topk.core.exchange import SparseAllreduceLayouts, region_of
from horovod_topk.core.payload import PayloadLayout
from horovod_topk.torch.exchange import ExchangeRequest
from horovod_topk.torch.sparse_rounds import SparseRounds


class _Record:
    bytes_sent = 0


def _request(name: str, numel: int, k: int, world_size: int, wire: torch.dtype, acc: torch.dtype,
             gen: torch.Generator, poison: bool = False) -> ExchangeRequest:
    """A payload of k distinct ascending indices with random values (the first one NaN when ``poison``)."""
    layout = PayloadLayout(k, torch.empty(0, dtype=wire).element_size())
    indices = torch.sort(torch.randperm(numel, generator=gen)[:k]).values.to(torch.int32)
    values = torch.randn(k, generator=gen, dtype=torch.float64).to(wire)
    if poison:
        values[0] = float("nan")
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8)
    payload[: 4 * k].view(torch.int32).copy_(indices)
    payload[layout.values_offset: layout.values_offset + k * layout.value_itemsize].view(wire).copy_(values)
    out = torch.randn(numel, generator=gen, dtype=torch.float64).to(acc if wire != torch.float16 else wire)
    residual = torch.randn(numel, generator=gen, dtype=torch.float64).to(acc)
    return ExchangeRequest(name, payload, layout, wire, out, (numel,), 1.0 / world_size, world_size, None, None,
                           residual, _Record())


def _ranks(world_size: int, sizes: List[int], ratio: float, wire: torch.dtype, acc: torch.dtype, seed: int,
           poison: bool = False) -> List[List[ExchangeRequest]]:
    gen = torch.Generator().manual_seed(seed)
    return [[_request(f"t{i}", n, max(1, int(n * ratio)), world_size, wire, acc, gen, poison and r == 1 and i == 0)
             for i, n in enumerate(sizes)] for r in range(world_size)]


def _payload_entries(request: ExchangeRequest) -> List[Tuple[int, float]]:
    layout = request.layout
    indices = request.payload[: 4 * layout.k].view(torch.int32).tolist()
    values = request.payload[layout.values_offset: layout.values_offset + layout.k * layout.value_itemsize]
    return list(zip(indices, values.view(request.wire_dtype).tolist()))


def _reference(ranks: List[List[ExchangeRequest]]):
    """Expected outputs and residuals, computed entry by entry (float64 sums: compared with a tolerance)."""
    P = len(ranks)
    outputs, residuals = [], [[r.residual.double().clone() for r in reqs] for reqs in ranks]
    for i in range(len(ranks[0])):
        numel, k = ranks[0][i].out.numel(), ranks[0][i].layout.k
        layouts = SparseAllreduceLayouts(k, P, ranks[0][i].layout.value_itemsize, numel)
        cap, kept = layouts.send.k, layouts.kept.k
        sent: List[Dict[int, float]] = []
        received: Dict[int, List[Tuple[int, float]]] = {o: [] for o in range(P)}
        for r in range(P):
            used = {o: 0 for o in range(P)}
            mine: Dict[int, float] = {}
            for index, value in _payload_entries(ranks[r][i]):
                owner = region_of(index, P)
                if used[owner] < cap:
                    used[owner] += 1
                    mine[index] = value
                    received[owner].append((index, value))
                elif math.isfinite(value):
                    residuals[r][i][index] += value
            sent.append(mine)
        applied: Dict[int, float] = {}
        wire = ranks[0][i].wire_dtype
        for owner in range(P):
            sums: Dict[int, float] = {}
            for index, value in received[owner]:
                sums[index] = sums.get(index, 0.0) + value
            order = sorted(sums, key=lambda j: (-(abs(sums[j]) if math.isfinite(sums[j]) else math.inf), j))
            for index in order[:kept]:
                rounded = torch.tensor(sums[index], dtype=torch.float64).to(wire).item()
                applied[index] = rounded
                if math.isfinite(sums[index]) and math.isfinite(rounded):
                    residuals[owner][i][index] += sums[index] - rounded
        for r in range(P):
            for index, value in sent[r].items():
                if index not in applied and math.isfinite(value):
                    residuals[r][i][index] += value
        out = torch.zeros(numel, dtype=torch.float64)
        for index, value in applied.items():
            out[index] = value / P
        outputs.append(out)
    return outputs, residuals


def _exchange(ranks: List[List[ExchangeRequest]]) -> List[List[torch.Tensor]]:
    """Every rank's three phases, the collectives done by hand; returns each rank's members' outputs."""
    P = len(ranks)
    rounds = [SparseRounds(reqs) for reqs in ranks]
    owned = [rounds[r].owned(torch.cat([rounds[s].send[r] for s in range(P)])) for r in range(P)]
    gathered = torch.cat(owned)
    return [[rounds[r].apply(i, rounds[r].gathered_rows(gathered.clone())).clone() for i in range(len(ranks[r]))]
            for r in range(P)]


def _nan_equal(a: torch.Tensor, b: torch.Tensor, **tol) -> None:
    torch.testing.assert_close(a.double(), b.double(), equal_nan=True, **tol)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("sizes,ratio", [([4000], 0.01), ([5000, 300, 70000, 17, 1], 0.01),
                                         ([900, 900, 900], 0.1), ([64, 2000], 1.0)])
def test_bucket_matches_the_reference(world_size, sizes, ratio):
    ranks = _ranks(world_size, sizes, ratio, torch.float32, torch.float32, seed=world_size)
    expected_out, expected_res = _reference(ranks)
    outputs = _exchange(ranks)
    for r in range(world_size):
        for i in range(len(sizes)):
            _nan_equal(outputs[r][i], expected_out[i], rtol=1e-6, atol=1e-6)
            _nan_equal(ranks[r][i].residual, expected_res[r][i], rtol=1e-6, atol=1e-6)


def test_a_member_in_a_bucket_equals_the_member_alone():
    """Bit for bit: a bucket changes how many collectives run, not what a member gets."""
    sizes = [3000, 40000, 129, 7000]
    bucket, alone = _ranks(4, sizes, 0.02, torch.float32, torch.float32, 5), _ranks(4, sizes, 0.02, torch.float32,
                                                                                  torch.float32, 5)
    together = _exchange(bucket)
    for i in range(len(sizes)):
        single = _exchange([[reqs[i]] for reqs in alone])
        for r in range(4):
            assert torch.equal(together[r][i], single[r][0])
            assert torch.equal(bucket[r][i].residual, alone[r][i].residual)


def test_error_feedback_is_exact_and_nan_never_enters_a_residual():
    """Sum over ranks of (new residual) + P * output == sum of (old residual + sent values), where finite; the
    poisoned entry reaches every rank's output as NaN and no residual."""
    P, sizes = 4, [6000, 500]
    ranks = _ranks(P, sizes, 0.05, torch.float32, torch.float64, seed=11, poison=True)
    before = [[r.residual.clone() for r in reqs] for reqs in ranks]
    sent = [[torch.zeros(n, dtype=torch.float64) for n in sizes] for _ in range(P)]
    for r in range(P):
        for i in range(len(sizes)):
            for index, value in _payload_entries(ranks[r][i]):
                sent[r][i][index] += value
    poisoned = _payload_entries(ranks[1][0])[0][0]
    outputs = _exchange(ranks)
    for i in range(len(sizes)):
        total_before = sum(before[r][i] + sent[r][i] for r in range(P))
        total_after = sum(ranks[r][i].residual for r in range(P)) + P * outputs[0][i].double()
        finite = torch.isfinite(total_before)
        torch.testing.assert_close(total_after[finite], total_before[finite], rtol=1e-9, atol=1e-9)
        for r in range(P):
            assert torch.isfinite(ranks[r][i].residual).all()
            _nan_equal(outputs[r][i], outputs[0][i], rtol=0, atol=0)  # every rank builds the same average
    for r in range(P):
        assert torch.isnan(outputs[r][0][poisoned])


def test_half_precision_wire_keeps_the_rounding_on_the_owner():
    ranks = _ranks(2, [3000, 800], 0.05, torch.float16, torch.float32, seed=3)
    expected_out, expected_res = _reference(ranks)
    outputs = _exchange(ranks)
    for r in range(2):
        for i in range(2):
            _nan_equal(outputs[r][i], expected_out[i], rtol=1e-3, atol=1e-3)
            _nan_equal(ranks[r][i].residual, expected_res[r][i], rtol=1e-5, atol=1e-5)


def _rounds_bytes(ranks: List[List[ExchangeRequest]]):
    """Every rank's alltoall rows, allgather row, outputs and residuals after the three phases."""
    P = len(ranks)
    rounds = [SparseRounds(reqs) for reqs in ranks]
    sends = [rounds[r].send.clone() for r in range(P)]
    owned = [rounds[r].owned(torch.cat([rounds[s].send[r] for s in range(P)])) for r in range(P)]
    gathered = torch.cat(owned)
    outputs = [[rounds[r].apply(i, rounds[r].gathered_rows(gathered.clone())).clone() for i in range(len(ranks[r]))]
               for r in range(P)]
    return sends, owned, outputs, [[q.residual.clone() for q in reqs] for reqs in ranks]


def _fused_kernels_or_skip():
    from horovod_topk.torch import kernels

    if kernels.load() is None:
        pytest.skip("the fused kernels could not be built here")


@pytest.mark.parametrize("world_size,sizes,ratio,poison", [
    (2, [4000], 0.01, False), (4, [5000, 300, 70000, 17, 1], 0.02, True), (3, [64, 2000], 1.0, True),
    (8, [900, 900, 900], 0.1, False)])
def test_fused_kernels_match_the_torch_operations_bit_for_bit(monkeypatch, world_size, sizes, ratio, poison):
    """The CPU kernels (csrc/sparse_rounds.cpp) against the torch operations (the device path, forced on the CPU by
    HOROVOD_TOPK_SELECTION=reference): the same bytes on the wire, outputs and residuals; with entries over an
    owner's capacity (ratio 1.0) and a NaN (poison)."""
    _fused_kernels_or_skip()
    from horovod_topk.torch import sparse_rounds

    fused_ranks = _ranks(world_size, sizes, ratio, torch.float32, torch.float32, 7, poison)
    torch_ranks = _ranks(world_size, sizes, ratio, torch.float32, torch.float32, 7, poison)
    assert all(isinstance(g, sparse_rounds._FusedGroup) for g in SparseRounds(fused_ranks[0])._groups)
    fused = _rounds_bytes(fused_ranks)
    monkeypatch.setenv("HOROVOD_TOPK_SELECTION", "reference")
    assert not any(isinstance(g, sparse_rounds._FusedGroup) for g in SparseRounds(torch_ranks[0])._groups)
    reference = _rounds_bytes(torch_ranks)
    for got, want in zip(fused[:2], reference[:2]):  # wire bytes
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    for got, want in zip(fused[2:], reference[2:]):  # outputs, residuals
        for a_rank, b_rank in zip(got, want):
            for a, b in zip(a_rank, b_rank):
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    if poison:
        assert any(torch.isnan(out).any() for out in fused[2][0])
        assert all(torch.isfinite(res).all() for rank in fused[3] for res in rank)


def test_fused_kernels_refuse_an_index_out_of_range_before_writing():
    """An alltoall row from a rank with another configuration (an index past the tensor) raises an error that names
    the index and the tensor's size, instead of writing out of bounds."""
    _fused_kernels_or_skip()
    ranks = _ranks(2, [1000], 0.05, torch.float32, torch.float32, 2)
    rounds = [SparseRounds(reqs) for reqs in ranks]
    received = torch.cat([rounds[0].send[0], rounds[1].send[0]]).clone()
    received[:4].view(torch.int32)[0] = 5000
    with pytest.raises(RuntimeError, match="index 5000 for a tensor of 1000 elements"):
        rounds[0].owned(received)


def test_fused_kernels_refuse_a_member_table_that_does_not_fit_the_rows():
    """The kernels are module functions: a member table whose fields lie past the rows it is given raises instead of
    writing past them."""
    _fused_kernels_or_skip()
    from horovod_topk.torch import kernels

    ranks = _ranks(2, [1000, 300], 0.05, torch.float32, torch.float32, 4)
    rounds = SparseRounds(ranks[0])
    group = rounds._groups[0]
    gathered = torch.zeros(2 * rounds.kept_offsets[-1], dtype=torch.uint8)
    narrow = rounds.kept_offsets[-1] - 8  # one field short of the real row
    with pytest.raises(RuntimeError, match="do not fit the sparse allreduce's rows"):
        kernels.load().sparse_apply_member(gathered, narrow, group.geometry.table, 1, ranks[0][1].out, 0.5, 2)
