import math

import pytest

from horovod_topk.core import STATE_FORMAT, ErrorFeedbackRegistry, TopKConfig, TopKEFBase


class ListCompressor(TopKEFBase[list]):
    """A framework-free stand-in whose residuals are Python lists."""

    def _alias(self, tensor):
        return type("Alias", (), {"value": tensor})()

    def _export_residual(self, residual):
        return list(residual)

    def _import_residual(self, name, value):
        return list(value)

    def _residual_squared_norm(self, residual):
        return float(sum(x * x for x in residual))


def test_record_is_created_once_and_shape_is_enforced():
    reg = ErrorFeedbackRegistry()
    rec = reg.record("w", (2, 3))
    assert reg.record("w", (2, 3)) is rec and rec.numel == 6
    rec.residual = [0.0] * 6
    with pytest.raises(ValueError, match="'w' has shape \\(3, 2\\)"):
        reg.record("w", (3, 2))


@pytest.mark.parametrize("state", ["residual", "momentum"])
def test_only_a_record_with_state_refuses_another_shape(state):
    reg = ErrorFeedbackRegistry()
    dense = reg.record("weight", (10, 1, 1, 1))  # went dense: nothing that a new shape could corrupt
    dense.steps, dense.verified = 3, True
    assert reg.record("weight", (1, 10, 1, 1)) is dense
    assert dense.shape == (1, 10, 1, 1) and dense.steps == 3 and not dense.verified  # checked again by the ranks
    setattr(dense, state, [0.0] * 10)
    with pytest.raises(ValueError, match="error-feedback state has shape \\(1, 10, 1, 1\\)"):
        reg.record("weight", (10, 1, 1, 1))


def test_state_round_trip_and_stats():
    comp = ListCompressor(ratio=0.1)
    rec = comp.registry.record("w", (2,))
    rec.residual, rec.steps, rec.bytes_sent, rec.bytes_dense = [3.0, 4.0], 5, 80, 800
    comp.registry.record("b", (1,)).steps = 5
    state = comp.state_dict()
    assert state["format"] == STATE_FORMAT and state["config"]["ratio"] == 0.1

    other = ListCompressor()
    other.load_state_dict(state)
    assert other.registry.records["w"].residual == [3.0, 4.0]
    s = other.stats()
    assert s["steps"] == 5 and s["bytes_sent"] == 80 and s["bytes_dense"] == 800
    assert s["compression_ratio"] == 10.0 and math.isclose(s["residual_norm"], 5.0)
    assert s["tensors_compressed"] == 1 and s["tensors_dense"] == 1


def test_load_refuses_foreign_state():
    with pytest.raises(ValueError, match="not a TopKEF state_dict"):
        ListCompressor().load_state_dict({"state": {}, "param_groups": []})


def test_class_methods_act_on_a_shared_default_instance():
    default = ListCompressor.default()
    assert ListCompressor.default() is default
    assert ListCompressor.stats() == default.stats()
    default.registry.record("x", (1,)).steps = 2
    assert ListCompressor.stats()["steps"] == 2
    ListCompressor.reset()
    assert ListCompressor.stats()["steps"] == 0


def test_options_and_config_are_exclusive():
    assert ListCompressor(config=TopKConfig(k=3)).config.k == 3
    assert ListCompressor(k=3).config == TopKConfig(k=3)
    with pytest.raises(ValueError, match="not both"):
        ListCompressor(ratio=0.1, config=TopKConfig())
    with pytest.raises(ValueError, match="ratio"):
        ListCompressor(ratio=2)


def test_compress_marks_an_alias_and_decompress_warns_when_nothing_routed_it():
    from horovod_topk.core import pending_of

    comp = ListCompressor()
    tensor = type("T", (), {"dtype": "float32", "shape": (3,)})()
    alias, ctx = comp.compress(tensor)
    assert pending_of(alias) is ctx and pending_of(tensor) is None
    assert ctx.compressor is comp and ctx.shape == (3,) and ctx.route == "unrouted"
    with pytest.warns(UserWarning, match="reduced dense"):
        assert comp.decompress(alias, ctx) is alias


def test_reduction_scale():
    from horovod_topk.core import reduction_scale

    assert reduction_scale("average", 1.0, 1.0, 4) == 0.25
    assert reduction_scale("average", 0.5, 2.0, 2) == 0.5
    assert reduction_scale("sum", 1.0, 1.0, 4) == 1.0
    with pytest.raises(ValueError, match="Average and op=hvd.Sum"):
        reduction_scale("max", 1.0, 1.0, 2)
