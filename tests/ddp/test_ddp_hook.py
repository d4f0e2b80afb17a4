"""The DDP communication hook on real torch.distributed workers (Gloo, CPU): parity with DDP's own allreduce at
ratio 1, the error-feedback invariant through bucket rebuilds and no_sync, bucket-layout independence, exact
resume, resume on another world size, rank disagreement, non-finite gradients."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from horovod_topk.core.checkpoint import redistribution_factor
from horovod_topk.torch.ddp import TopKEFState

from . import harness, workers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("ddp_options,micro_batches", [
    ({}, 1),
    ({"bucket_cap_mb": 0.1, "gradient_as_bucket_view": True}, 1),
    ({"bucket_cap_mb": 0.1}, 3),  # gradient accumulation under no_sync()
])
def test_ratio_one_matches_ddp_bit_for_bit(world_size, ddp_options, micro_batches):
    results = harness.run(workers.parity, world_size, ddp_options, micro_batches)
    for r in results:
        assert torch.equal(r["plain"], r["hooked"])
        assert r["bytes_sent"] == r["bytes_dense"] > 0
    assert all(torch.equal(results[0]["hooked"], r["hooked"]) for r in results)


def _check_invariant(results, world_size):
    """Per member and bucket call: sum over ranks of (gradient + old residual) == P * average + sum of new
    residuals; the average is the same on every rank (exactly, to float rounding, but where ratio="auto"'s fp16
    carried a member: within the float16 sum's rounding). Returns the member checks made under fp16."""
    calls = len(results[0]["log"])
    assert calls > 0 and all(len(r["log"]) == calls for r in results)
    compressed = halves = 0
    for i in range(calls):
        entries = [r["log"][i] for r in results]
        assert all(e["names"] == entries[0]["names"] for e in entries)
        for j, name in enumerate(entries[0]["names"]):
            owed = sum(e["grads"][j] + e["before"][j] for e in entries)
            kept = sum(e["after"][j] for e in entries)
            out = entries[0]["out"][j]
            assert all(torch.equal(out, e["out"][j]) for e in entries), name
            if entries[0].get("half") and entries[0]["half"][j]:
                # ratio="auto"'s fp16: each rank's rounding is in its residual; the float16 sum's own rounding is
                # not (at most P - 1 roundings of 2**-11 of a partial sum, P x that in units of the average)
                bound = world_size * (world_size - 1) * 2 ** -10 * out.abs() + world_size * 2 ** -24
                assert bool(((world_size * out + kept - owed).abs() <= bound + 1e-6).all()), name
                halves += 1
            else:
                torch.testing.assert_close(world_size * out + kept, owed, rtol=1e-5, atol=1e-6)  # as for Horovod's
            compressed += bool(kept.abs().sum() > 0)
    assert compressed > 0  # the residuals did hold something: the invariant was not checked on dense steps only
    return halves


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("exchange", ["allgather", "sparse_allreduce"])
def test_error_feedback_invariant_through_a_bucket_rebuild(world_size, exchange):
    results = harness.run(workers.invariant, world_size, 0.05, 1, 4, {"bucket_cap_mb": 0.3},
                          {"exchange": exchange})
    _check_invariant(results, world_size)
    assert all(r["same"] for r in results)
    layouts = [tuple(e["names"]) for e in results[0]["log"]]
    ends = results[0]["ends"]
    # DDP rebuilt its buckets after the first iteration (Net's gradients arrive out of registration order): the
    # members of the buckets changed, and the residuals still followed their parameters (invariant above)
    assert set(layouts[:ends[0]]) != set(layouts[ends[-2]:])
    stats = results[0]["stats"]
    assert stats["buckets"]["compressed"] > 0 and stats["exchanges"].get(exchange, 0) >= 3


@pytest.mark.parametrize("options", [
    {"index_bits": 16, "value_dtype": "float8"},  # the compact encoding: float8's rounding stays in the residual
    {"warmup_steps": 3},  # dense first, then fewer entries each step
    {"value_dtype": "float16", "selector": "exact", "log_every": 1},
])
def test_error_feedback_invariant_with_options(options):
    results = harness.run(workers.invariant, 2, 0.05, 1, 4, {"bucket_cap_mb": 0.3}, options)
    _check_invariant(results, 2)
    assert all(r["same"] for r in results)
    stats = results[0]["stats"]
    assert stats["compression_ratio"] > (1.5 if "warmup_steps" in options else 5)


def test_error_feedback_invariant_with_no_sync_accumulation():
    results = harness.run(workers.invariant, 2, 0.05, 3, 3, {})
    _check_invariant(results, 2)
    assert all(r["same"] for r in results)


def test_parameters_do_not_depend_on_the_bucket_layout():
    configurations = [{}, {"bucket_cap_mb": 0.05}, {"bucket_cap_mb": 0.05, "gradient_as_bucket_view": True},
                      {"static_graph": True}]
    results = harness.run(workers.bucket_layouts, 2, configurations)
    for r in results:
        assert all(torch.equal(r["params"][0], p) for p in r["params"][1:])
    assert torch.equal(results[0]["params"][0], results[1]["params"][0])


def test_grouped_kernels_train_exactly_as_member_by_member(monkeypatch):
    """The GPU path of a bucket (one run of the grouped Triton kernels for its allgather members, torch.bucket_select),
    on real workers: here the kernels run under Triton's interpreter on CPU tensors. Small buckets: several per
    step, rebuilt after the first, and a collective's callback adding one bucket's payloads while the hook selects
    the next."""
    monkeypatch.setenv("HOROVOD_TOPK_SELECTION", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = harness.run(workers.grouped_against_alone, 2, 0.3)
    for r in results:
        assert r["grouped"]["same"] and r["alone"]["same"]
        assert torch.equal(r["grouped"]["params"], r["alone"]["params"])
        assert r["grouped"]["buckets"]["grouped"] >= 4 and r["alone"]["buckets"]["grouped"] == 0
    assert torch.equal(results[0]["grouped"]["params"], results[1]["grouped"]["params"])


@pytest.mark.parametrize("ddp_options", [{}, {"gradient_as_bucket_view": True}], ids=["default", "bucket-view"])
def test_whole_bucket_graphs_train_exactly_as_the_usual_path(ddp_options, monkeypatch):
    """HOROVOD_TOPK_CUDA_GRAPHS=bucket (torch.bucket_graph): a steady bucket's selection, collectives and adding
    back replayed as one recorded unit, its host bookkeeping outside it, on real workers. Without a GPU the
    recording is stood in for by re-running the recorded work (collectives included) over the tensors it was
    recorded with, as a graph replays its recorded addresses; the kernels run under Triton's interpreter.
    Parameters, counters and residuals equal the usual path's bit for bit, through rebuilt buckets and a load."""
    monkeypatch.setenv("HOROVOD_TOPK_SELECTION", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = harness.run(workers.whole_bucket_graphs, 2, 0.3, 5, ddp_options)
    for r in results:
        whole, usual = r["whole"], r["usual"]
        assert whole["same"] and usual["same"]
        assert torch.equal(whole["params"], usual["params"])
        assert whole["counters"] == usual["counters"] and whole["residuals"].keys() == usual["residuals"].keys()
        assert all(torch.equal(whole["residuals"][n], usual["residuals"][n]) for n in whole["residuals"])
        assert whole["buckets"] == usual["buckets"]
        # steps 2-4 and 6-8 are steady (step 0 full, 1 after the rebuild full, 5 after the load full); each
        # steady bucket runs eagerly once, is recorded the next step, and replays after: at least one replay per
        # graph, new graphs after the load
        assert whole["graphs"] >= 2 and whole["replays"] >= whole["graphs"]
        assert usual["graphs"] == 0


@pytest.mark.parametrize("named", [False, True])
def test_checkpoint_resumes_exactly(named):
    results = harness.run(workers.resume, 2, named)
    for r in results:
        assert torch.equal(r["straight"], r["resumed"])
        assert r["names"] and all(("." in n) == named for n in r["names"])


def test_checkpoint_of_4_ranks_resumes_on_2(tmp_path):
    path = str(tmp_path / "topk.pt")
    saved = harness.run(workers.save_all_ranks, 4, path)
    loaded = harness.run(workers.load_all_ranks, 2, path)
    factor = redistribution_factor("average", 4, 2)
    for name, _ in saved[0]["residuals"].items():
        mean = sum(s["residuals"][name].double() for s in saved) / 4
        for r in loaded:
            torch.testing.assert_close(r["loaded"][name].double(), mean * factor, rtol=1e-6, atol=1e-9)
    assert all(r["same"] for r in loaded)


def test_ranks_that_disagree_raise_together_naming_the_field():
    messages = harness.run(workers.mismatch, 2)
    for message in messages:
        assert "RankMismatch" in message or "ranks disagree" in message, message
        assert "ratio" in message, message


def test_a_nan_on_one_rank_stays_out_of_every_residual():
    results = harness.run(workers.nonfinite, 2)
    for r in results:
        assert torch.isnan(r["grads"]["c.weight"]).any()  # sent as such: the step is visibly bad everywhere
        assert all(torch.isfinite(v).all() for v in r["residuals"].values())
        assert torch.isfinite(r["grads"]["b.weight"]).all() and r["residuals"]["b.weight"].abs().sum() > 0
    assert results[1]["nonfinite_steps"] >= 1 and results[0]["nonfinite_steps"] == 0


@pytest.mark.parametrize("options,field", [
    ({"ratio": 0}, "ratio"),
    ({"nonsense": 1}, "nonsense"),
])
def test_bad_options_are_refused_by_name(options, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        TopKEFState(**options)


def test_works_in_an_environment_without_horovod(tmp_path):
    """A DDP user has torch and horovod-topk only: a site-packages without Horovod (every other package of this
    environment, linked), the hook imported and run on 2 workers there."""
    import torch as torch_module

    site = Path(torch_module.__file__).resolve().parents[1]
    filtered = tmp_path / "site"
    filtered.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith("horovod"):
            (filtered / entry.name).symlink_to(entry)
    script = ("import importlib.util, sys\n"
              "assert importlib.util.find_spec('horovod') is None, 'Horovod is importable'\n"
              "from horovod_topk.torch import kernels\n"
              "assert kernels.load() is not None, 'the fused kernels did not build'\n"
              "from tests.ddp import harness, workers\n"
              "results = harness.run(workers.smoke, 2)\n"
              "assert all(r['same'] for r in results) and results[0]['ratio'] > 10, results\n"
              "assert not [m for m in sys.modules if m.split('.')[0] == 'horovod']\n"
              "print('ok', results[0]['ratio'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(filtered), str(ROOT)])
    # torch's headers are under the linked site here, so the kernels compile again (as on a user's first run): in a
    # cache of this test's own (the shared one would be rebuilt back and forth), before the workers start (the
    # harness's timeout is for a hang, not for a compiler)
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    done = subprocess.run([sys.executable, "-S", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr
