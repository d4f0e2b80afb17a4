"""A selected value beyond the wire dtype's range (float16: 65504) travels clamped to it, on every CPU backend: no Inf
is sent that no rank had, none enters a residual, and the excess stays in the residual and goes out on later steps
(error feedback stays exact). Cast as it was, a residual that grew past 65504 or a gradient under an AMP loss scale
travelled as an Inf and left value - Inf = -Inf in the residual, which every later step sent again."""
import pytest
import torch

from horovod_topk.core import PayloadLayout
from horovod_topk.core.policy import sample_size
from horovod_topk.torch import ops, selection

BACKENDS = {"reference": selection._REFERENCE, "device": selection._DEVICE, "fused": selection._fused()}
WIRE_MAX = {torch.float16: 65504.0, torch.bfloat16: 3.3895313892515355e38}
#: A float32 value beyond each wire's range (float32's own largest is 3.4028e38).
BEYOND = {torch.float16: 70000.0, torch.bfloat16: 3.4e38}


def _backend(name: str) -> selection.Backend:
    backend = BACKENDS[name]
    if name == "fused" and not isinstance(backend, selection.FusedBackend):
        pytest.skip("the fused kernel could not be built here")
    return backend


def _step(backend, grad, residual, k, wire):
    layout = PayloadLayout(k, torch.empty(0, dtype=wire).element_size())
    payload, nonfinite = backend.compress(grad.clone(), residual, None, 0.0, layout, wire,
                                          sample_size(k, grad.numel()), 0)
    indices, values = ops.unpack(payload, 1, layout, wire)
    return indices.reshape(-1).long(), values.reshape(-1), nonfinite


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_value_beyond_the_wire_range_travels_clamped_and_the_excess_stays(name, wire):
    backend = _backend(name)
    n, k, big = 4000, 40, float(torch.tensor(BEYOND[wire]))  # as float32 holds it
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0))
    grad[7], grad[1234] = big, -big
    residual = torch.zeros(n)
    compensated = residual.double() + grad.double()

    indices, values, nonfinite = _step(backend, grad, residual, k, wire)
    assert int(nonfinite) == 0
    assert bool(torch.isfinite(values).all()), "a finite value must not travel as an Inf"
    assert bool(torch.isfinite(residual).all()), "nor leave one in the residual"
    sent = dict(zip(indices.tolist(), values.double().tolist()))
    assert sent[7] == WIRE_MAX[wire] and sent[1234] == -WIRE_MAX[wire]
    # error feedback: what travelled plus what stays is exactly what there was
    total = residual.double().index_add(0, indices, values.double())
    assert torch.equal(total, compensated)
    assert float(residual[7]) == big - WIRE_MAX[wire] and float(residual[1234]) == WIRE_MAX[wire] - big

    # the excess is now the largest entry of the residual: it goes out on the next step
    excess = residual.clone()
    indices, values, _ = _step(backend, torch.zeros(n), residual, k, wire)
    assert {7, 1234} <= set(indices.tolist())
    total = residual.double().index_add(0, indices, values.double())
    assert torch.equal(total, excess.double())


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_to_wire_clamps_finite_values_and_keeps_nan_and_inf(wire):
    limit = WIRE_MAX[wire]
    values = torch.tensor([1.5, -BEYOND[wire], BEYOND[wire], float("inf"), -float("inf"), float("nan")])
    out = ops.to_wire(values, wire).double()
    assert out[:3].tolist() == [1.5, -limit, limit]
    assert out[3] == float("inf") and out[4] == -float("inf") and torch.isnan(out[5])
    same = ops.to_wire(values, torch.float32)  # not narrower: as they are
    assert torch.equal(same[:5], values[:5]) and torch.isnan(same[5])
    wide = torch.tensor([1e39, -1e39], dtype=torch.float64)  # float64 gradients on a float32 wire
    assert ops.to_wire(wide, torch.float32).tolist() == [torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max]
