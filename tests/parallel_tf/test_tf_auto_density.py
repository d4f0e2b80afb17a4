"""ratio="auto" in TensorFlow on real Horovod workers: one traced graph serves every density, the same decision on
every rank at the same step, error feedback exact through every change of density, identical variables, exact
resume, and a named error instead of a hang when ranks disagree.

Where a test needs a given sequence of decisions it scripts the link the decisions are made from (the same script
on every rank, a function of the step); the collectives, the compressor, the traced graph and the planning are the
real ones.
"""
import copy

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core import RankMismatch
from horovod_topk.core.autodensity import HALF, auto_schedule, choice_index
from horovod_topk.core.policy import tensor_payload_layout
from horovod_topk.tensorflow import TopKEF, auto_density

from tests.tf_allgathers import record_allgathers, topk_exchanges
from tests.auto_links import (CHECK_STEPS, FIRST_DECISION, FOURTH_DECISION, SECOND_DECISION, THIRD_DECISION,
                               fast_link, much_slower_link, script, slow_link, sparse_slower_than_dense)

from .tf_harness import apply, batch, loss_fn, make_variables

COMPRESSIBLE = ("w1", "w2")  # 2048 entries each, of two shapes; the others are under min_numel or IndexedSlices


def run(compressor, steps, *, state=None, on_step=None):
    """SGD through hvd.DistributedGradientTape in one traced step; ``on_step(step, names, local, reduced, v)``
    sees this rank's gradients next to the reduced ones. Returns the final variables."""
    v = make_variables()
    names = sorted(v)
    if state is not None:
        for name in names:
            v[name].assign(state["variables"][name])
        compressor.load_state_dict(state["topk"])

    @tf.function
    def step(x, tokens, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(v, x, tokens, y)
        local = tape.gradient(loss, [v[n] for n in names])
        reduced = hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [v[n] for n in names])
        apply(v, names, reduced)
        return local, reduced

    for s in steps:
        local, reduced = step(*batch(s))
        if on_step is not None:
            on_step(s, names, local, reduced, v)
    return {n: v[n].numpy() for n in names}


def test_measured_decisions_are_the_same_on_every_rank_and_variables_stay_identical():
    """No script: the real probes, graph stamps and selection timing decide; every rank must hold the same
    history, and the first window is dense."""
    compressor = TopKEF(ratio="auto", auto_every=6)
    history = []
    params = run(compressor, range(FIRST_DECISION + 20),
                 on_step=lambda *args: history.append(compressor.auto.ratio))
    stats = compressor.stats()["auto"]
    everyone = hvd.allgather_object((history, stats["decisions"], stats["last"].get("ratio"), params),
                                    name="tf.auto.measured")
    assert stats["decisions"] >= 2
    assert all(e[:3] == everyone[0][:3] for e in everyone)
    for name in params:
        np.testing.assert_array_equal(everyone[0][3][name], everyone[1][3][name])
    assert history[:FIRST_DECISION] == [None] * FIRST_DECISION
    assert stats["last"]["compute_s"] > 0 and stats["last"]["measured_step_s"] > 0


def test_each_density_sends_its_k_and_error_feedback_stays_exact_through_every_change(monkeypatch):
    """Per step and compressed tensor: exactly the k and payload bytes of core's plan at the density in force
    (dense while dense), and over the ranks sum of new residuals + P * reduced == sum of old residuals +
    gradients, across dense -> sparse -> dense (leftovers flushed into the dense step) -> sparse; the variables
    stay identical on every rank."""
    measured = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
    decided = script(monkeypatch, auto_density, lambda step: measured.get(step, much_slower_link))
    compressor = TopKEF(ratio="auto", auto_every=CHECK_STEPS)
    compressor.auto.half = False  # the script's sequence is dense <-> sparse; fp16 has its own test below
    previous, ratios = {}, []

    def check(step, names, local, reduced, v):
        ratio = compressor.auto.ratio
        ratios.append(ratio)
        compressor.stats()  # reads the counter variables back into the records
        records = {tuple(r.shape): (key, r) for key, r in compressor.registry.records.items()}
        for name, g, out in zip(names, local, reduced):
            if name not in COMPRESSIBLE:
                continue
            key, record = records[tuple(g.shape)]
            numel = int(np.prod(g.shape))
            schedule = auto_schedule(key, numel, True, compressor.config, world_size=hvd.size(), value_itemsize=4,
                                     grad_itemsize=4, sparse_available=True)
            position = choice_index(ratio)
            k = schedule.count[position] if schedule.routes[schedule.phase[position]] != "dense" else None
            r0, sent_before = previous.get(name, (np.zeros(numel, np.float32), 0))
            r1, sent_bytes = record.residual.numpy().copy(), record.bytes_sent
            sent = r0 + g.numpy().reshape(-1) - r1
            if k is None:
                np.testing.assert_array_equal(r1, 0)
                assert sent_bytes - sent_before == numel * 4, (name, step)
            else:
                assert np.count_nonzero(np.abs(sent) > 1e-7) == k, (name, step, ratio)
                assert sent_bytes - sent_before == tensor_payload_layout(compressor.config, k, numel, 4).nbytes
            total = hvd.allreduce(tf.constant(np.stack([r0 + g.numpy().reshape(-1), r1])), op=hvd.Sum,
                                  name=f"tf.auto.ef.{name}.{step}").numpy()
            np.testing.assert_allclose(total[1] + hvd.size() * out.numpy().reshape(-1), total[0], rtol=0, atol=1e-5)
            previous[name] = (r1, sent_bytes)

    params = run(compressor, range(FOURTH_DECISION), on_step=check)
    changes = [(i, r) for i, r in enumerate(ratios) if i and r != ratios[i - 1]]
    assert ratios[0] is None and len(changes) >= 3, (changes, decided)
    assert any(r is None for _, r in changes[1:]), changes  # went back to dense at least once
    assert compressor.stats()["exchanges"]
    gathered = hvd.allgather_object(params, name="tf.auto.ef.params")
    for name in params:
        np.testing.assert_array_equal(gathered[0][name], gathered[1][name])


def test_buckets_train_as_the_per_tensor_exchange_through_every_change(monkeypatch):
    """The compressed tensors in one bucket (one allgather in each compressed branch) or each on its own: across
    dense -> sparse -> dense -> sparse the variables, residuals and bytes are the same bit for bit."""
    measured = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
    runs = []
    for bucket_bytes in (1 << 20, 0):
        script(monkeypatch, auto_density, lambda step: measured.get(step, much_slower_link))
        built = record_allgathers(monkeypatch)
        compressor = TopKEF(ratio="auto", auto_every=CHECK_STEPS, min_numel=0, bucket_bytes=bucket_bytes)
        compressor.auto.half = False
        ratios = []
        params = run(compressor, range(FOURTH_DECISION), on_step=lambda *args: ratios.append(compressor.auto.ratio))
        residuals = {key: record.residual.numpy().copy() for key, record in compressor.registry.records.items()
                     if record.residual is not None}
        runs.append((params, residuals, ratios, compressor.stats()["bytes_sent"], topk_exchanges(built)))
    (params, residuals, ratios, sent, built), (params0, residuals0, ratios0, sent0, built0) = runs
    assert ratios == ratios0 and len({r for r in ratios}) >= 2
    for name in params:
        np.testing.assert_array_equal(params[name], params0[name], err_msg=name)
    assert residuals.keys() == residuals0.keys() and residuals
    for key in residuals:
        np.testing.assert_array_equal(residuals[key], residuals0[key], err_msg=key)
    assert sent == sent0
    assert len(built0) == 4 and not any(n.startswith("topk.bucket.") for n in built0), (built0, built)
    assert len(built) == 1 and built[0].startswith("topk.bucket.") and ".4." in built[0]


def test_checkpoint_resumes_exactly_with_the_density_in_force(monkeypatch):
    script(monkeypatch, auto_density, lambda step: slow_link if step < SECOND_DECISION else sparse_slower_than_dense)
    save_at = FIRST_DECISION + 3
    saved = {}

    def keep(step, names, local, reduced, v):
        if step == save_at:
            saved.update(copy.deepcopy({"variables": {n: v[n].numpy() for n in names},
                                        "topk": compressor.state_dict()}))

    compressor = TopKEF(ratio="auto", auto_every=5)
    straight = run(compressor, range(THIRD_DECISION), on_step=keep)
    assert saved["topk"]["auto"]["ratio"] is not None  # saved while sparse
    resumed_compressor = TopKEF(ratio="auto", auto_every=5)
    resumed = run(resumed_compressor, range(save_at + 1, THIRD_DECISION), state=saved)
    for name in straight:
        np.testing.assert_array_equal(straight[name], resumed[name], err_msg=name)
    assert resumed_compressor.auto.ratio == compressor.auto.ratio


def test_ranks_that_loaded_different_densities_raise_instead_of_exchanging(monkeypatch):
    """Two checkpoints of the same step, one saved while dense and one while sparse (decided on other links),
    loaded one per rank: every tensor's trace-time check agrees (same step, same configuration), so the tick's own
    agreement check must name the density."""
    link = {"now": slow_link}
    script(monkeypatch, auto_density, lambda step: link["now"])
    states = []
    for measured in (slow_link, fast_link):
        link["now"] = measured
        donor = TopKEF(ratio="auto", auto_every=5)
        run(donor, range(FIRST_DECISION + 1))
        states.append(donor.state_dict())
    assert states[0]["auto"]["ratio"] is not None and states[1]["auto"]["ratio"] is None
    compressor = TopKEF(ratio="auto", auto_every=5)
    compressor.load_state_dict(states[hvd.rank() % 2])
    with pytest.raises(Exception, match="ranks disagree about ratio='auto'") as raised:
        run(compressor, range(FIRST_DECISION + 1, FIRST_DECISION + 2))
    assert isinstance(raised.value, (RankMismatch, tf.errors.OpError))
    hvd.allreduce(tf.zeros([1]), name="tf.auto.disagree.done")


def test_a_checkpoint_loaded_on_one_rank_only_is_named_instead_of_hanging(monkeypatch):
    script(monkeypatch, auto_density, lambda step: slow_link)
    donor = TopKEF(ratio="auto", auto_every=5)
    run(donor, range(FIRST_DECISION + 1))
    compressor = TopKEF(ratio="auto", auto_every=5)
    if hvd.rank() == 0:
        compressor.load_state_dict(donor.state_dict())
    with pytest.raises(RankMismatch, match="ranks disagree"):
        run(compressor, range(1))
    hvd.allreduce(tf.zeros([1]), name="tf.auto.one.rank.done")


def test_fp16_keeps_error_feedback_exact_and_variables_identical_through_its_changes(monkeypatch):
    """ratio="auto"'s fp16 in a traced graph: dense -> sparse -> fp16 (the sparse residuals' leftovers go out in
    float16) -> dense (fp16's residual goes out dense), one graph for all of them. Per tensor, over all ranks and
    steps: sum of raw gradients == P * sum of averaged gradients + sum of residuals, within the float16 sums' own
    rounding on fp16 steps; on each fp16 step each rank's residual holds its own rounding (non-zero, at most half a
    float16 step of gradient + residual); the small tensors go in float16 too; identical variables; fp16 steps send
    2 bytes an entry."""
    links = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
    decided = script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=CHECK_STEPS)
    world = hvd.size()
    raw, sent, bound, ratios, step_bytes, before, half_steps = {}, {}, {}, [], [0], {}, [0]

    def record(step, names, local, reduced, v):
        half = compressor.auto.ratio == HALF
        half_steps[0] += half
        records = {tuple(r.shape): r for r in compressor.registry.records.values()}
        for name, g, out in zip(names, local, reduced):
            if isinstance(g, tf.IndexedSlices):  # the embedding: Horovod's allgather of slices, not compressed
                continue
            residual = records[tuple(g.shape)].residual
            now = np.zeros(g.shape, np.float64) if residual is None else \
                residual.numpy().reshape(g.shape).astype(np.float64)
            if half:  # this rank's own rounding stays, and nothing more (nothing is clamped at these values)
                acc = g.numpy().astype(np.float64) + before.get(name, 0)
                assert np.count_nonzero(now) > 0, (name, step)
                assert (np.abs(now) <= np.abs(acc) * 2 ** -11 / (1 - 2 ** -11) + 2 ** -24 * world).all(), (name, step)
            before[name] = now
            g, out = g.numpy().astype(np.float64), out.numpy().astype(np.float64)
            raw[name] = raw.get(name, 0) + g
            sent[name] = sent.get(name, 0) + out
            # the float16 sum's rounding: at most P - 1 roundings of 2**-11, in units of P x the average
            bound[name] = bound.get(name, 0) + (world * (world - 1) * 2 ** -10 * np.abs(out) + 2 ** -22
                                                if half else 0)
        ratios.append(compressor.auto.ratio)
        step_bytes.append(compressor.stats()["bytes_sent"])

    params = run(compressor, range(FOURTH_DECISION), on_step=record)
    assert isinstance(ratios[FIRST_DECISION], float), (ratios, decided)
    assert ratios[SECOND_DECISION] == HALF and ratios[-1] is None and half_steps[0] > 0, (ratios, decided)
    records = {tuple(r.shape): r for r in compressor.registry.records.values()}
    assert len(records) == len(raw)  # every tensor has a shape of its own here
    assert {name: records[raw[name].shape].residual is not None for name in raw} == {name: True for name in raw}
    for name in sorted(raw):
        residual = records[raw[name].shape].residual.numpy().reshape(raw[name].shape).astype(np.float64)
        totals = hvd.allreduce(tf.constant(np.stack([raw[name], residual])), op=hvd.Sum,
                               name=f"tf.auto.half.{name}").numpy()
        gap = np.abs(world * sent[name] + totals[1] - totals[0])
        assert (gap <= bound[name] + 1e-5).all(), (name, gap.max())
    per_step = [b - a for a, b in zip(step_bytes, step_bytes[1:])]
    assert all(b == per_step[0] // 2 for b, r in zip(per_step, ratios) if r == HALF), (per_step, ratios)
    assert compressor.stats()["exchanges"].get("dense_fp16", 0) > 0
    gathered = hvd.allgather_object(params, name="tf.auto.half.params")
    for name in params:
        np.testing.assert_array_equal(gathered[0][name], gathered[1][name])


def test_with_momentum_only_the_tensors_auto_may_select_get_a_momentum_buffer(monkeypatch):
    """DGC momentum under ratio="auto" with fp16 offered: the small tensors (dense or fp16 only) get a residual for
    fp16's rounding but no momentum buffer; through dense -> 0.01 -> fp16 the variables stay identical on every rank."""
    links = {FIRST_DECISION: slow_link, SECOND_DECISION: sparse_slower_than_dense}
    script(monkeypatch, auto_density, lambda step: links.get(step, fast_link))
    compressor = TopKEF(ratio="auto", min_numel=256, auto_every=CHECK_STEPS, momentum=0.9)
    ratios = []
    params = run(compressor, range(THIRD_DECISION), on_step=lambda *args: ratios.append(compressor.auto.ratio))
    assert HALF in ratios and any(isinstance(r, float) for r in ratios), ratios
    sizes = {key: int(np.prod(record.shape)) for key, record in compressor.registry.records.items()}
    assert set(compressor._residual_vars) == set(sizes)
    assert {key for key in compressor._momentum_vars} == {key for key, n in sizes.items() if n >= 256}
    gathered = hvd.allgather_object(params, name="tf.auto.momentum.params")
    for name in params:
        np.testing.assert_array_equal(gathered[0][name], gathered[1][name])


def test_a_different_budget_on_one_rank_is_named_instead_of_hanging():
    compressor = TopKEF(ratio="auto", budget=0.1 if hvd.rank() == 0 else 0.2)
    with pytest.raises(RankMismatch, match="budget"):
        run(compressor, range(1))
    hvd.allreduce(tf.zeros([1]), name="tf.auto.budget.done")
