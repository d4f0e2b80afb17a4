"""A bucket's allgather members selected by one run of the grouped Triton kernels (torch.bucket_select) against the
same members selected one by one by the Triton backend: the same payload bytes, residuals and averaged gradients,
step after step, through a NaN, a checkpoint load and rebuilt buckets.

Two ranks are simulated in one process (each its own TopKEFState; their payloads concatenated as the allgather
would). Without a GPU the kernels run under Triton's interpreter, as in test_triton_select; on a GPU machine
(scripts/gpu_check.sh) on CUDA."""
import pickle

import pytest
import torch

from .test_triton_select import DEVICE  # noqa: F401  (sets TRITON_INTERPRET=1 before Triton is imported)
from horovod_topk.torch import bucket_select, steady_bucket  # noqa: E402
from horovod_topk.torch.bucket_step import BucketStep  # noqa: E402
from horovod_topk.torch.ddp import TopKEFState  # noqa: E402

WORLD = 2
# a 10-element bias between weights: it goes dense (min_numel), so the compressed members do not lie back to back
SPLIT = [("w1", 3000), ("bias", 10), ("w2", 5000), ("w3", 2000)]
ADJACENT = [("w1", 3000), ("w2", 5000), ("w3", 2000)]


def _run(members, grouped, monkeypatch, options, steps=4, nan_at=None, load_at=None, rebuild_at=None,
         fixed=False, steady=False, pickle_at=None, dense_steps=False):
    """``steps`` steps of two ranks; returns per step the payloads, the residuals and the averaged buffers.
    ``fixed``: each rank's gradients arrive in the same buffer every step (as DDP's bucket buffers do);
    ``steady``: each buffer has a slot where its steps keep what the next can reuse (as the DDP hook gives);
    ``dense_steps``: steps whose members all go dense (a warm-up's first) are allowed, with an empty payload."""
    monkeypatch.setenv("HOROVOD_TOPK_SELECTION", "triton")
    if not grouped:
        monkeypatch.setattr(bucket_select, "groupable", lambda *args: False)
    states = [TopKEFState(**options) for _ in range(WORLD)]
    gen = torch.Generator().manual_seed(0)
    fixed_buffers = {}
    slots = {}
    history = []
    for step in range(steps):
        layout = members if rebuild_at is None or step < rebuild_at else list(reversed(members))
        numel = sum(n for _, n in layout)
        buffers = [torch.randn(numel, generator=gen).to(DEVICE) for _ in range(WORLD)]
        if fixed:
            kept = fixed_buffers.setdefault(numel, [torch.empty_like(b) for b in buffers])
            buffers = [k.copy_(b) for k, b in zip(kept, buffers)]
        if step == nan_at:
            buffers[1][layout[0][1] + 7] = float("nan")  # entry 7 of the second member, on rank 1
        if step == load_at:
            for s in states:
                s.load_state_dict(s.state_dict())
        if step == pickle_at:  # the whole state through plain pickle (torch.save keeps storage sharing; pickle not)
            states = [pickle.loads(pickle.dumps(s)) for s in states]
        work = []
        for rank, (state, buffer) in enumerate(zip(states, buffers)):
            plan = state.plan(layout, buffer, WORLD)
            slot = slots.setdefault((rank, buffer.data_ptr()), {}) if steady else None
            work.append(BucketStep(state, plan, buffer, [(n,) for _, n in layout], WORLD, slot))
        if dense_steps and all(w.selection is None for w in work):
            dense = sum(w.dense for w in work)
            outputs = [w.finish(None, w.dense.copy_(dense)) for w in work]
            history.append((torch.empty(0, dtype=torch.uint8), [{} for _ in states], [o.clone() for o in outputs]))
            continue
        assert all(w.selection is not None and w.selection.grouped == grouped for w in work)
        gathered = torch.cat([w.payload for w in work])
        dense = sum(w.dense for w in work) if work[0].dense is not None else None
        # as the collectives do it: each rank's allgather lands where its step asks (the group's own buffer under
        # CUDA graphs), and the dense sum is written over the step's own dense tensor (an in-place allreduce)
        outputs = [w.finish(w.gathered_buffer().copy_(gathered), w.dense.copy_(dense) if dense is not None else None)
                   for w in work]
        residuals = [{name: s.registry.records[name].residual.clone() for name, _ in layout
                      if s.registry.records[name].residual is not None} for s in states]
        history.append((gathered.clone(), residuals, [o.clone() for o in outputs]))
    return history, states


def _count_steady_runs(monkeypatch):
    runs = []
    original = steady_bucket.SteadyBucket.run
    monkeypatch.setattr(steady_bucket.SteadyBucket, "run", lambda self, *a: runs.append(1) or original(self, *a))
    return runs


def _assert_same(a, b):
    for (payload_a, res_a, out_a), (payload_b, res_b, out_b) in zip(a, b):
        assert torch.equal(payload_a, payload_b)
        for ra, rb in zip(res_a, res_b):
            assert ra.keys() == rb.keys() and all(torch.equal(ra[n], rb[n]) for n in ra)
        for oa, ob in zip(out_a, out_b):
            assert torch.equal(oa.nan_to_num(7.0), ob.nan_to_num(7.0)) and torch.equal(oa.isnan(), ob.isnan())


@pytest.mark.parametrize("members", [SPLIT, ADJACENT], ids=["dense-member-between", "back-to-back"])
@pytest.mark.parametrize("options", [{"ratio": 0.02}, {"ratio": 0.05, "value_dtype": "float16"}],
                         ids=["float32", "float16-wire"])
def test_grouped_equals_member_by_member(members, options, monkeypatch):
    grouped, states = _run(members, True, monkeypatch, options)
    alone, _ = _run(members, False, monkeypatch, options)
    _assert_same(grouped, alone)
    # the residuals are views of one buffer, and they did keep entries
    residuals = [states[0].registry.records[n].residual for n, numel in members if numel >= 1024]
    assert len({r.untyped_storage().data_ptr() for r in residuals}) == 1
    assert all(r.abs().sum() > 0 for r in residuals)


def test_a_nan_stays_out_of_the_residuals_and_reaches_every_rank(monkeypatch):
    grouped, states = _run(ADJACENT, True, monkeypatch, {"ratio": 0.02}, nan_at=1)
    alone, _ = _run(ADJACENT, False, monkeypatch, {"ratio": 0.02}, nan_at=1)
    _assert_same(grouped, alone)
    _, residuals, outputs = grouped[1]
    assert all(torch.isfinite(r).all() for rank in residuals for r in rank.values())
    at = ADJACENT[0][1] + 7
    assert all(o[at].isnan() and o.isnan().sum() == 1 for o in outputs)  # sent: every rank's average shows it
    assert [int(s.registry.records["w2"].nonfinite_steps) for s in states] == [0, 1]
    assert int(states[1].registry.records["w1"].nonfinite_steps) == 0  # its bucket-mates went on as usual


def test_a_load_and_rebuilt_buckets_keep_every_residual(monkeypatch):
    """A load replaces the records' residuals and rebuilt buckets regroup the members: each is adopted into its
    new place with its values, and the steps go on exactly as member by member."""
    grouped, states = _run(ADJACENT, True, monkeypatch, {"ratio": 0.02}, steps=5, nan_at=1, load_at=2,
                           rebuild_at=3)
    alone, alone_states = _run(ADJACENT, False, monkeypatch, {"ratio": 0.02}, steps=5, nan_at=1, load_at=2,
                               rebuild_at=3)
    _assert_same(grouped, alone)
    # the grouped path counts a bucket's non-finite flags on the device; each member's count survives the load and
    # the regrouping, and reads as a plain number in stats() and the state_dict
    counts = [[int(s.registry.records[n].nonfinite_steps) for n, _ in ADJACENT] for s in states]
    assert counts == [[int(s.registry.records[n].nonfinite_steps) for n, _ in ADJACENT] for s in alone_states]
    assert counts == [[0, 0, 0], [0, 1, 0]]
    assert [s.stats()["nonfinite_steps"] for s in states] == [0, 1]
    saved = states[1].state_dict()["tensors"]["w2"]["nonfinite_steps"]
    assert type(saved) is int and saved == 1


@pytest.mark.parametrize("members", [SPLIT, ADJACENT], ids=["dense-member-between", "back-to-back"])
def test_a_steady_bucket_repeats_the_full_step(members, monkeypatch):
    """A bucket whose plan, buffer, records and residuals did not change reuses its last step's work
    (torch.steady_bucket): the same payloads, residuals, averages and counts as member-by-member selection,
    through a NaN, a load (records replaced: the full step again) and rebuilt buckets."""
    runs = _count_steady_runs(monkeypatch)
    kept, states = _run(members, True, monkeypatch, {"ratio": 0.02}, steps=8, nan_at=2, load_at=4, rebuild_at=6,
                        fixed=True, steady=True)
    assert len(runs) == 2 * 5  # both ranks at steps 1, 2, 3, 5 (not 4: the load) and 7 (not 6: the rebuild)
    alone, alone_states = _run(members, False, monkeypatch, {"ratio": 0.02}, steps=8, nan_at=2, load_at=4,
                               rebuild_at=6, fixed=True, steady=True)
    _assert_same(kept, alone)
    for s, a in zip(states, alone_states):
        for name, _ in members:
            mine, theirs = s.registry.records[name], a.registry.records[name]
            assert (mine.steps, mine.bytes_sent, mine.bytes_dense, int(mine.nonfinite_steps)) == (
                theirs.steps, theirs.bytes_sent, theirs.bytes_dense, int(theirs.nonfinite_steps))


def test_a_pickled_state_goes_on_exactly(monkeypatch):
    """A state pickled and unpickled between steps: its records' residuals and counts, once views of the grouped
    buffers, arrive as copies; the next grouped step takes them back into new buffers and nothing is lost."""
    grouped, states = _run(SPLIT, True, monkeypatch, {"ratio": 0.02}, steps=6, nan_at=1, pickle_at=3, fixed=True,
                           steady=True)
    alone, alone_states = _run(SPLIT, False, monkeypatch, {"ratio": 0.02}, steps=6, nan_at=1, pickle_at=3,
                               fixed=True, steady=True)
    _assert_same(grouped, alone)
    assert ([[int(s.registry.records[n].nonfinite_steps) for n, _ in SPLIT] for s in states]
            == [[int(s.registry.records[n].nonfinite_steps) for n, _ in SPLIT] for s in alone_states])


def test_not_grouped_where_the_kernels_do_not_apply(monkeypatch):
    """The compact encoding (16-bit indices) is not the grouped kernels' layout: member by member."""
    monkeypatch.setenv("HOROVOD_TOPK_SELECTION", "triton")
    state = TopKEFState(ratio=0.02, index_bits=16, value_dtype="float8")
    buffer = torch.randn(sum(n for _, n in ADJACENT)).to(DEVICE)
    step = BucketStep(state, state.plan(ADJACENT, buffer, WORLD), buffer, [(n,) for _, n in ADJACENT], WORLD)
    assert step.selection is not None and not step.selection.grouped


def test_a_bucket_step_never_synchronises_the_host(monkeypatch):
    """Once its group layout exists, a bucket's selection, payload and adding back call nothing that would make
    the host wait for a GPU: checked on CUDA with torch's sync debug mode set to raise, and on the CPU by the aten
    ops recorded (tests/pytorch/sync_check.py)."""
    from .sync_check import recorded_ops, syncing

    monkeypatch.setenv("HOROVOD_TOPK_SELECTION", "triton")
    state = TopKEFState(ratio=0.02)

    # the gradients are made on the device before the checked region: a copy from pageable host memory is itself
    # a synchronising call, and a training step's gradients are born on the device
    buffers = [torch.randn(sum(n for _, n in SPLIT), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
               for seed in range(3)]

    def one_step(seed: int) -> None:
        buffer = buffers[seed]
        step = BucketStep(state, state.plan(SPLIT, buffer, WORLD), buffer, [(n,) for _, n in SPLIT], WORLD)
        assert step.selection is not None and step.selection.grouped
        step.finish(torch.cat([step.payload, step.payload]), step.dense * WORLD)

    one_step(0)  # first step: residuals and the group layout made, the agreement's tables copied to the device
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            one_step(1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    ops = recorded_ops(lambda: one_step(2))
    assert "aten.cat.default" in ops and not syncing(ops), syncing(ops)  # cat: the recording saw the step


class _RecordedWork:
    """A stand-in for a CUDA graph on the CPU: "recording" runs the work once (a capture runs nothing, but the
    replay that follows it does: that one is skipped), later replays run the recorded work again over the tensors
    it was recorded with and write its recorded outputs, as a graph does over its recorded addresses."""

    def __init__(self, work, outputs):
        self.work, self.outputs, self.recorded = work, outputs, True

    def replay(self):
        if self.recorded:
            self.recorded = False
            return
        for kept, new in zip(self.outputs, self.work()):
            kept.copy_(new)


@pytest.mark.parametrize("members", [SPLIT, ADJACENT], ids=["dense-member-between", "back-to-back"])
@pytest.mark.parametrize("steady", [False, True], ids=["full-steps", "steady-buckets"])
def test_graph_keys_name_everything_a_replay_reads(members, steady, monkeypatch):
    """The graphs' keys, on any machine: with recording replaced by :class:`_RecordedWork`, a replay under a key
    that missed something a step changed (a new dense sum, another buffer) would read the recorded tensors and
    the results would differ from member by member. The selections and addings back do replay."""
    from horovod_topk.torch import group_graphs

    def record(self, key, work, device):
        found = self._graphs[key] = (_RecordedWork(work, work()), None)
        found = self._graphs[key] = (found[0], found[0].outputs)
        return found

    monkeypatch.setattr(group_graphs, "enabled", lambda device: True)
    monkeypatch.setattr(group_graphs.GroupGraphs, "_record", record)
    graphed, states = _run(members, True, monkeypatch, {"ratio": 0.02}, steps=9, nan_at=3, load_at=4,
                           rebuild_at=5, fixed=True, steady=steady)
    monkeypatch.setattr(group_graphs, "enabled", lambda device: False)
    alone, alone_states = _run(members, False, monkeypatch, {"ratio": 0.02}, steps=9, nan_at=3, load_at=4,
                               rebuild_at=5, fixed=True, steady=steady)
    _assert_same(graphed, alone)
    assert all(s._group_selection().replays() > 0 for s in states)
    assert all(s._group_selection().finish_replays() > 0 for s in states)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("members", [SPLIT, ADJACENT], ids=["dense-member-between", "back-to-back"])
@pytest.mark.parametrize("steady", [False, True], ids=["full-steps", "steady-buckets"])
def test_cuda_graphs_replay_the_same_steps(members, steady, monkeypatch):
    """HOROVOD_TOPK_CUDA_GRAPHS=1: each bucket's grouped selection and its adding back recorded once and replayed;
    the payloads, residuals, averages and non-finite counts are those of member-by-member selection, through a NaN,
    a load and rebuilt buckets."""
    monkeypatch.setenv("HOROVOD_TOPK_CUDA_GRAPHS", "1")
    # four steps after the rebuild: a steady bucket's work (its dense members ride along) is keyed apart from a
    # full step's, so after a full step it is seen once, recorded, then replayed
    graphed, states = _run(members, True, monkeypatch, {"ratio": 0.02}, steps=9, nan_at=3, load_at=4,
                           rebuild_at=5, fixed=True, steady=steady)
    alone, alone_states = _run(members, False, monkeypatch, {"ratio": 0.02}, steps=9, nan_at=3, load_at=4,
                               rebuild_at=5, fixed=True, steady=steady)
    _assert_same(graphed, alone)
    assert all(s._group_selection().replays() > 0 for s in states)
    assert all(s._group_selection().finish_replays() > 0 for s in states)
    assert ([[int(s.registry.records[n].nonfinite_steps) for n, _ in members] for s in states]
            == [[int(s.registry.records[n].nonfinite_steps) for n, _ in members] for s in alone_states])


def test_a_warmup_moving_k_keeps_one_group_per_bucket(monkeypatch):
    """A sparsity warm-up plans the bucket under new k's phase after phase: each phase's group takes the same
    residual buffer and the earlier phases' groups are dropped (a model with many buckets would otherwise hold one
    group per bucket and phase), and the steps are member by member's."""
    options = {"ratio": 0.02, "warmup_steps": 6}
    grouped, states = _run(ADJACENT, True, monkeypatch, options, steps=9, fixed=True, steady=True, dense_steps=True)
    alone, _ = _run(ADJACENT, False, monkeypatch, options, steps=9, fixed=True, steady=True, dense_steps=True)
    _assert_same(grouped, alone)
    sizes = [payload.numel() for payload, _, _ in grouped if payload.numel()]
    assert len(set(sizes)) >= 3  # the warm-up did move k through several compressed phases
    assert all(len(s._group_selection()._groups) == 1 for s in states)
