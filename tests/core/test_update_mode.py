"""Update mode's framework-free decisions: its options, its moments buffer, the optimizers the shared second moment
reproduces, and the agreement fingerprint that covers the mode."""
import pytest

from horovod_topk.core import TopKConfig, fingerprint, mismatch_message
from horovod_topk.core.update_mode import (
    AUTO_UPDATE_OPTIMIZERS,
    resolve_target,
    block_count,
    moments_layout,
    KERAS_CALIBRATED,
    resolve_keras_second_moment,
    resolve_second_moment,
    row_sign,
    shared_moment_hyperparameters,
    sketch_layout,
    sketch_salt,
    update_tensor_name,
    update_tensor_names,
)


ADAM, ADAMW = "torch.optim.adam.Adam", "torch.optim.adamw.AdamW"


@pytest.mark.parametrize("options, fragment", [
    ({"target": "updates"}, "target must be one of"),
    ({"target": "update", "second_moment": "global"}, "second_moment must be one of"),
    ({"target": "update", "second_moment": "calibrate"}, "second_moment must be one of"),
    ({"target": "update", "second_moment_block": 0}, "second_moment_block must be a positive integer"),
    ({"target": "update", "second_moment_block": True}, "second_moment_block must be a positive integer"),
    ({"target": "gradient", "second_moment": "shared"}, "apply to target='update' only"),
    ({"target": "gradient", "second_moment_block": 64}, "apply to target='update' only"),
    ({"target": "gradient", "second_moment": "calibrated"}, "apply to target='update' only"),
    ({"target": "gradient", "second_moment_sketch": 32}, "apply to target='update' only"),
    ({"target": "update", "second_moment_sketch": 0}, "second_moment_sketch must be a positive integer"),
    ({"target": "update", "second_moment_sketch": 1.5}, "second_moment_sketch must be a positive integer"),
    ({"target": "update", "momentum": 0.9}, "momentum"),
    ({"target": "update", "spike_guard": 10.0}, "spike_guard"),
])
def test_update_mode_options_are_validated_by_name(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        TopKConfig(**options)


def test_update_mode_options_round_trip_and_show_in_the_description():
    config = TopKConfig(target="update", second_moment="shared", second_moment_block=64)
    assert TopKConfig.from_dict(config.to_dict()) == config
    assert "target='update'" in config.describe() and "second_moment='shared'" in config.describe()
    assert "target" not in TopKConfig().describe()


def test_moments_layout_gives_each_tensor_its_blocks():
    layout = moments_layout([1000, 10, 256, 257], block=256)
    assert layout.spans == ((0, 4), (4, 1), (5, 1), (6, 2))
    assert layout.numel == 8
    assert [block_count(n, 256) for n in (0, 1, 256, 257)] == [0, 1, 1, 2]


def test_shared_second_moment_reads_adam_and_adamw_and_refuses_the_rest_by_name():
    group = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False}
    assert shared_moment_hyperparameters(ADAMW, group) == (0.01, 0.9, 0.95, 1e-8, 0.1, True)
    assert shared_moment_hyperparameters(ADAM, group)[-1] is False
    assert shared_moment_hyperparameters(ADAM, dict(group, decoupled_weight_decay=True))[-1] is True
    with pytest.raises(ValueError, match="SGD.*second_moment='local'"):
        shared_moment_hyperparameters("torch.optim.sgd.SGD", {"lr": 0.1})
    with pytest.raises(ValueError, match="transformers.optimization.AdamW"):  # another library's AdamW
        shared_moment_hyperparameters("transformers.optimization.AdamW", group)
    for option in ("amsgrad", "maximize", "differentiable"):
        with pytest.raises(ValueError, match=option):
            shared_moment_hyperparameters(ADAM, dict(group, **{option: True}))


def test_update_residuals_have_names_of_their_own():
    assert update_tensor_name("fc.weight") == "update.fc.weight" != "fc.weight"


def test_the_agreement_covers_the_mode_and_the_second_moment():
    def row(config):
        return fingerprint(config, (64, 64), "float32", 0, 41, "allgather")

    gradient, update = TopKConfig(target="gradient"), TopKConfig(target="update", second_moment="shared")
    message = mismatch_message("fc.weight", [row(gradient), row(update)])
    assert "target (rank 0: 'gradient', rank 1: 'update')" in message
    local = TopKConfig(target="update", second_moment="local")
    assert "second_moment (rank 0: 'shared', rank 1: 'local')" in mismatch_message("w", [row(update), row(local)])
    blocks = TopKConfig(target="update", second_moment_block=64)
    assert "second_moment_block (rank 0: 256, rank 1: 64)" in mismatch_message("w", [row(update), row(blocks)])
    calibrated = TopKConfig(target="update", second_moment="calibrated")
    wider = TopKConfig(target="update", second_moment="calibrated", second_moment_sketch=128)
    assert "second_moment (rank 0: 'local', rank 1: 'calibrated')" in mismatch_message("w", [row(local), row(calibrated)])
    assert "second_moment_sketch (rank 0: 64, rank 1: 128)" in mismatch_message("w", [row(calibrated), row(wider)])


def test_the_sketch_layout_and_salts_are_the_same_on_every_rank_and_differ_per_step_and_tensor():
    layout = sketch_layout(tensors=3, width=64)
    assert layout.numel == 3 * 65
    assert [layout.rows(n) for n in (0, 1, 64, 65, 6400)] == [1, 1, 1, 2, 100]
    with pytest.raises(ValueError, match="at least one bucket"):
        sketch_layout(3, 0)
    salts = {sketch_salt(step, position) for step in range(200) for position in range(50)}
    assert len(salts) == 200 * 50  # no two (step, tensor) pairs share their signs
    assert all(0 <= s < 2**31 for s in salts)
    assert sketch_salt(7, 3) == 638656911  # pinned: a resumed job draws the signs the saved one would have


def test_the_shared_second_moment_is_checked_against_the_optimizer():
    adam = [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}]
    assert resolve_second_moment("shared", ADAMW, adam) == "shared"
    assert resolve_second_moment("local", ADAM, adam) == "local"
    assert resolve_second_moment("local", "torch.optim.sgd.SGD", [{"lr": 0.1}]) == "local"
    with pytest.raises(ValueError, match="amsgrad"):
        resolve_second_moment("shared", ADAM, [dict(adam[0], amsgrad=True)])
    with pytest.raises(ValueError, match="Lion"):
        resolve_second_moment("shared", "Lion", [{"lr": 0.1}])
    assert resolve_second_moment("calibrated", ADAMW, adam) == "calibrated"
    assert resolve_second_moment("auto", ADAMW, adam) == "calibrated"
    assert resolve_second_moment("auto", ADAM, [dict(adam[0], amsgrad=True)]) == "local"  # trains, as the user's own
    assert resolve_second_moment("auto", "torch.optim.sgd.SGD", [{"lr": 0.1}]) == "local"
    assert TopKConfig(target="update").second_moment == "auto"
    with pytest.raises(ValueError, match="second_moment='calibrated'.*SGD"):
        resolve_second_moment("calibrated", "torch.optim.sgd.SGD", [{"lr": 0.1}])


def test_update_tensor_names_keep_repeated_names_apart_with_valid_op_name_characters():
    import re

    keys = update_tensor_names(["a", "dense_kernel", "b", "dense_kernel"])
    assert keys == ["update.a", "update.dense_kernel.dup0", "update.b", "update.dense_kernel.dup1"]
    assert all(re.fullmatch(r"[A-Za-z0-9.][A-Za-z0-9_.\-/>]*", k) for k in keys)  # TensorFlow's op-name rule
    assert update_tensor_names(["x", "y"]) == ["update.x", "update.y"]


def test_keras_optimizers_get_the_calibrated_second_moment_where_their_velocity_can_be_moved():
    adam = "keras.src.optimizers.adam.Adam"
    assert adam in KERAS_CALIBRATED and "tf_keras.src.optimizers.adamw.AdamW" in KERAS_CALIBRATED
    assert resolve_keras_second_moment("auto", adam, 0.999, None) == "calibrated"
    assert resolve_keras_second_moment("calibrated", adam, 0.95, 1) == "calibrated"
    assert resolve_keras_second_moment("local", adam, 0.999, None) == "local"
    # "auto" falls back to each rank's own where it cannot calibrate; an explicit "calibrated" is refused by name
    cannot = [("keras.src.optimizers.sgd.SGD", 0.999, None, "SGD"),
              ("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer", None, None, "loss-scale"),
              ("tf_keras.src.optimizers.legacy.adam.Adam", 0.999, None, "legacy"),
              (adam, 1.0, None, "beta_2 as a number in \\(0, 1\\), got 1.0"),
              (adam, lambda: 0.9, None, "beta_2"),
              (adam, 0.999, 4, "gradient_accumulation_steps=4")]
    for class_name, beta_2, accumulation, reason in cannot:
        assert resolve_keras_second_moment("auto", class_name, beta_2, accumulation) == "local"
        with pytest.raises(ValueError, match=f"second_moment='calibrated'.*{reason}.*second_moment='local'"):
            resolve_keras_second_moment("calibrated", class_name, beta_2, accumulation)
    with pytest.raises(ValueError, match="second_moment='shared'.*PyTorch's"):
        resolve_keras_second_moment("shared", adam, 0.999, None)


def test_row_sign_is_balanced_and_independent_across_salts():
    rows = 20_000
    a = [row_sign(r, sketch_salt(1, 0)) for r in range(rows)]
    b = [row_sign(r, sketch_salt(2, 0)) for r in range(rows)]
    assert set(a) == {-1, 1}
    for statistic in (sum(a), sum(x * y for x, y in zip(a, b)), sum(x * y for x, y in zip(a[1:], a[:-1]))):
        assert abs(statistic) < 5 * rows ** 0.5  # 5 sigma of iid signs


def test_target_auto_exchanges_updates_for_the_adam_family_only():
    assert TopKConfig().target == "auto"
    auto = TopKConfig()
    for adam in (ADAM, ADAMW, "keras.src.optimizers.adamw.AdamW", "tf_keras.src.optimizers.adam.Adam"):
        assert adam in AUTO_UPDATE_OPTIMIZERS and resolve_target(auto, adam) == "update"
    for other in ("torch.optim.sgd.SGD", "keras.src.optimizers.sgd.SGD", "torch.optim.rmsprop.RMSprop", None):
        assert resolve_target(auto, other) == "gradient"
    assert resolve_target(auto, ADAM, ["op=hvd.Sum"]) == "gradient"  # what the front end cannot do keeps gradients
    assert resolve_target(TopKConfig(momentum=0.9), ADAM) == "gradient"  # gradient mode's own options
    assert resolve_target(TopKConfig(spike_guard=3.0), ADAM) == "gradient"
    assert resolve_target(TopKConfig(target="gradient"), ADAM) == "gradient"
    assert resolve_target(TopKConfig(target="update"), "torch.optim.sgd.SGD") == "update"  # named: as asked
    assert resolve_target(TopKConfig(second_moment="local"), ADAM) == "update"  # update options with auto


def test_route_step_follows_what_auto_holds_and_keeps_the_scopes():
    """The route of an update-mode step under ratio="auto": entering when auto first holds dense or fp16, on the
    route while it holds, leaving at the first density; a resync once after an elastic reset, only on the route."""
    from horovod_topk.core.autodensity import HALF, AutoDensity
    from horovod_topk.core.config import TopKConfig
    from horovod_topk.core.update_mode import RouteStep, route_step

    auto = AutoDensity(TopKConfig(ratio="auto"), half=True)
    seen = []
    for ratio in (None, None, HALF, 0.01, 0.01, HALF):
        auto.ratio = ratio
        seen.append(route_step(auto, "opt"))
    assert seen == [RouteStep.ENTER, RouteStep.ROUTE, RouteStep.ROUTE, RouteStep.LEAVE, RouteStep.LOCAL,
                    RouteStep.ENTER]
    assert auto.shared_scopes == ["opt"] and route_step(auto, "other") == RouteStep.ENTER
    auto.resync_scopes = ["opt"]
    assert route_step(auto, "opt") == RouteStep.RESYNC and auto.resync_scopes == []
    assert route_step(auto, "opt") == RouteStep.ROUTE
    auto.resync_scopes, auto.ratio = ["opt"], 0.03
    assert route_step(auto, "opt") == RouteStep.LEAVE and auto.resync_scopes == []
    assert auto.shared_scopes == ["other"]
