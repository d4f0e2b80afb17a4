"""Buckets in TensorFlow on real Horovod workers: a bucketed step equals the per-tensor step bit for bit (tape and
Keras, under the options that change what a member sends), one allgather (the sparse allreduce: one alltoall and
one allgather) carries a bucket's compressed members,
the user's groups are the buckets, and ranks that disagree about bucket_bytes raise instead of hanging."""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core import RankMismatch
from horovod_topk.tensorflow import TopKEF

from tests.tf_allgathers import record_allgathers, record_alltoalls, topk_exchanges

from .tf_harness import train_tape

BUCKETED = {"bucket_bytes": 1 << 20}
PER_TENSOR = {"bucket_bytes": 0}


@pytest.fixture
def allgathers(monkeypatch):
    """The names of the allgathers built while tracing."""
    return record_allgathers(monkeypatch)


@pytest.fixture
def alltoalls(monkeypatch):
    """The names of the alltoalls built while tracing."""
    return record_alltoalls(monkeypatch)


_exchanges = topk_exchanges


def _residuals(compressor):
    return {name: np.array(record.residual.numpy()) for name, record in compressor.registry
            if record.residual is not None}


@pytest.mark.parametrize("options", [
    {"ratio": 0.05, "min_numel": 0},
    {"ratio": 0.05, "min_numel": 0, "selector": "exact"},
    {"ratio": 0.05, "min_numel": 0, "value_dtype": "float16"},
    {"ratio": 0.05, "min_numel": 0, "index_bits": 16, "value_dtype": "float8"},
    {"ratio": 0.05, "min_numel": 0, "momentum": 0.9},
    {"ratio": 0.05, "min_numel": 0, "spike_guard": 2.0},
    {"ratio": 0.05, "min_numel": 0, "warmup_steps": 2},
    {"ratio": 0.05, "min_numel": 0, "exchange": "sparse_allreduce"},
    {"ratio": 0.05, "min_numel": 0, "exchange": "sparse_allreduce", "warmup_steps": 2},
])
def test_a_bucketed_tape_step_equals_the_per_tensor_step(options, allgathers, alltoalls):
    bucketed = TopKEF(**options, **BUCKETED)
    ours = train_tape(bucketed, steps=4)
    built_bucketed, alltoalls_bucketed = _exchanges(allgathers), sorted(set(alltoalls))
    allgathers.clear()
    alltoalls.clear()
    per_tensor = TopKEF(**options, **PER_TENSOR)
    theirs = train_tape(per_tensor, steps=4)
    built_per_tensor, alltoalls_per_tensor = _exchanges(allgathers), sorted(set(alltoalls))
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    mine, others = _residuals(bucketed), _residuals(per_tensor)
    assert mine.keys() == others.keys() and mine
    for name in mine:
        np.testing.assert_array_equal(mine[name], others[name], err_msg=name)
    assert bucketed.stats()["bytes_sent"] == per_tensor.stats()["bytes_sent"]
    compressed = [n for n in built_per_tensor if not n.startswith("topk.bucket.")]
    if "exchange" in options:  # the four compressed tensors' alltoalls and owners' allgathers: one each
        assert len(alltoalls_per_tensor) == 4 and not alltoalls_per_tensor[0].startswith("topk-sar1.topk.bucket.")
        assert len(alltoalls_bucketed) == 1 and alltoalls_bucketed[0].startswith("topk-sar1.topk.bucket.")
        owners = sorted({n for n in allgathers if n and n.startswith("topk-sar2.")})
        assert len(owners) == 4
    else:  # the four compressed tensors (w1, w2, head, b1) in one allgather instead of one each (with a warm-up:
        # in its compressed branch, while its dense steps take Horovod's allreduce per tensor)
        assert len(compressed) == 4
        assert len(built_bucketed) == 1 and built_bucketed[0].startswith("topk.bucket.")
        assert ".4." in built_bucketed[0]  # the name counts the members


def test_identical_on_every_rank_and_sends_what_it_selects():
    """Bucketed at 5%: every rank holds the same variables after training, and the bytes are the payloads'."""
    compressor = TopKEF(ratio=0.05, min_numel=0)
    ours = train_tape(compressor, steps=3)
    for name, value in ours.items():
        every = hvd.allgather(tf.constant(value)[tf.newaxis], name=f"test.bucket.same.{name}").numpy()
        assert all(np.array_equal(every[0], every[r]) for r in range(1, every.shape[0])), name
    stats = compressor.stats()
    assert 0 < stats["bytes_sent"] < stats["bytes_dense"] / 4


def test_the_users_groups_are_the_buckets(allgathers):
    """groups=2 (Horovod splits the sorted variables b1, emb, head | w1, w2): each group's compressed members
    share one allgather, bit for bit as per tensor. (sparse_as_dense: Horovod 0.28.1's grouped allreduce fails on
    IndexedSlices that follow other tensors in a group, with or without horovod-topk.)"""
    options = {"ratio": 0.05, "min_numel": 0}
    grouped = TopKEF(**options)
    ours = train_tape(grouped, steps=3, groups=2, sparse_as_dense=True)
    built = _exchanges(allgathers)
    per_tensor = TopKEF(**options, **PER_TENSOR)
    theirs = train_tape(per_tensor, steps=3, groups=2, sparse_as_dense=True)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert len(built) == 2 and all(n.startswith("topk.bucket.") for n in built)
    assert sorted(n.split(".")[-2] for n in built) == ["2", "3"]  # members per bucket, from the names


def _keras_fit(compression, groups=None):
    """Horovod's Keras wrapper (Keras 2), SGD with momentum; ``groups(model)``: the user's groups."""
    import horovod.tensorflow.keras as hvd_keras

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu", input_shape=(32,)),
                                 tf.keras.layers.Dense(32, activation="relu"), tf.keras.layers.Dense(4)])
    optimizer = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=compression,
                                               groups=groups(model) if groups else None)
    model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(hvd.rank())
    x, y = rng.randn(64, 32).astype(np.float32), rng.randint(0, 4, 64)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize("groups", [None, lambda model: [model.weights[:2], model.weights[2:]]],
                         ids=["asked", "users"])
def test_keras_fit_bucketed_equals_per_tensor(groups, allgathers):
    """Every compressed kernel and bias of the model in one bucket, or one per user group (the first layer's
    kernel and bias | the rest)."""
    bucketed = TopKEF(ratio=0.05, min_numel=0)
    ours = _keras_fit(bucketed, groups)
    built = _exchanges(allgathers)
    per_tensor = TopKEF(ratio=0.05, min_numel=0, **PER_TENSOR)
    theirs = _keras_fit(per_tensor, groups)
    for mine, other in zip(ours, theirs):
        np.testing.assert_array_equal(mine, other)
    assert built and all(n.startswith("topk.bucket.") for n in built)
    assert len(built) == (1 if groups is None else 2)


def test_ranks_that_disagree_about_bucket_bytes_raise_on_every_rank():
    options = BUCKETED if hvd.rank() == 0 else PER_TENSOR
    with pytest.raises(RankMismatch, match="bucket_bytes|configuration"):
        train_tape(TopKEF(ratio=0.05, min_numel=0, **options), steps=1)


def _train_with_a_nan(compressor, steps=3):
    """train_tape's model and SGD, with rank 1's w1 gradient all NaN at the last step (a term of the loss that only
    w1's gradient sees; the last, so that no later forward pass spreads w1's NaN to the other gradients)."""
    from .tf_harness import apply, batch, loss_fn, make_variables

    v = make_variables()
    names = sorted(v)

    @tf.function
    def step(x, tokens, y, poison):
        with tf.GradientTape() as tape:
            loss = loss_fn(v, x, tokens, y) + tf.reduce_sum(v["w1"]) * poison
        reduced = hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [v[n] for n in names])
        apply(v, names, reduced)

    for s in range(steps):
        poison = float("nan") if (s == steps - 1 and hvd.rank() == 1) else 0.0
        step(*batch(s), tf.constant(poison))
    return {n: v[n].numpy() for n in names}


def test_a_nan_in_one_member_leaves_its_bucket_mates_as_per_tensor():
    """Rank 1's w1 gradient is NaN for one step: w1's average is NaN (NaN entries are sent, never kept), while its
    bucket-mates' values and every residual are those of the per-tensor exchange, and no residual holds NaN."""
    bucketed = TopKEF(ratio=0.05, min_numel=0, **BUCKETED)
    ours = _train_with_a_nan(bucketed)
    per_tensor = TopKEF(ratio=0.05, min_numel=0, **PER_TENSOR)
    theirs = _train_with_a_nan(per_tensor)
    for name in ours:  # NaN where per tensor has NaN (w1), the same bytes elsewhere
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert np.isnan(ours["w1"]).any() and all(np.isfinite(ours[n]).all() for n in ("w2", "head", "b1"))
    mine, others = _residuals(bucketed), _residuals(per_tensor)
    assert mine.keys() == others.keys()
    for name in mine:
        np.testing.assert_array_equal(mine[name], others[name], err_msg=name)
        assert np.isfinite(mine[name]).all(), name
    assert bucketed.stats()["nonfinite_steps"] == (1 if hvd.rank() == 1 else 0)


@pytest.mark.parametrize("saved_by, loaded_by", [(PER_TENSOR, BUCKETED), (BUCKETED, PER_TENSOR)],
                         ids=["per-tensor-to-buckets", "buckets-to-per-tensor"])
def test_a_state_loads_whatever_the_bucket_layout_and_trains_on_bit_for_bit(saved_by, loaded_by):
    """Residuals and counters are keyed by tensor name, not by bucket: a state saved by a job with one layout
    continues in a job with the other exactly as in one with the saving job's layout."""
    import copy

    options = {"ratio": 0.05, "min_numel": 0}
    saving = TopKEF(**options, **saved_by)
    train_tape(saving, steps=2)
    state = saving.state_dict()
    runs = []
    for layout in (loaded_by, saved_by):
        compressor = TopKEF(**options, **layout)
        compressor.load_state_dict(copy.deepcopy(state))
        runs.append((train_tape(compressor, steps=2), _residuals(compressor), compressor.stats()["steps"]))
    (params, residuals, steps), (params0, residuals0, steps0) = runs
    for name in params:
        np.testing.assert_array_equal(params[name], params0[name], err_msg=name)
    assert residuals.keys() == residuals0.keys() and len(residuals) == 4
    for name in residuals:
        np.testing.assert_array_equal(residuals[name], residuals0[name], err_msg=name)
    assert steps == steps0 == 4  # the loaded counters went on
