"""Checkpoint and restart of the error-feedback state with real, freshly launched Horovod workers."""
import os

import horovod
import pytest
import torch

from . import workers

STEPS = 6  # S: the straight run trains 2S steps, the resumed one S, then S more in new processes


def _run(tmp_path, num_proc, start, stop, *, save=False, load=False, **options):
    options = {"ratio": 0.02, **options}
    path = str(tmp_path / "ckpt.pt")
    return horovod.run(workers.resume_run, args=(path, start, stop, save, load, options), num_proc=num_proc,
                       use_gloo=True)


@pytest.mark.parametrize("options", [{}, {"value_dtype": "float16", "warmup_steps": 4},
                                     {"exchange": "sparse_allreduce", "value_dtype": "float16"},
                                     {"target": "update", "optimizer": "adamw", "second_moment": "shared"},
                                     {"target": "update", "optimizer": "adamw", "second_moment": "calibrated"}])
def test_resume_in_new_processes_is_exact(tmp_path, options):
    straight = _run(tmp_path, 2, 0, 2 * STEPS, **options)
    _run(tmp_path, 2, 0, STEPS, save=True, **options)
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed = _run(tmp_path, 2, STEPS, 2 * STEPS, load=True, **options)
    for rank in range(2):
        assert resumed[rank]["params"] == straight[rank]["params"], f"rank {rank} diverged after the resume"
        # each rank got back its own residuals, which differ between ranks
        for name, residual in resumed[rank]["restored"].items():
            moment = name.startswith("first_moment.")
            field, tensor = ("momentum", name[len("first_moment."):]) if moment else ("residual", name)
            assert residual == saved["topk"]["ranks"][rank]["tensors"][tensor][field].tolist()
    names = list(resumed[0]["restored"])
    assert names and any(resumed[0]["restored"][n] != resumed[1]["restored"][n] for n in names)


def test_resume_on_another_number_of_workers_keeps_the_owed_mass(tmp_path):
    _run(tmp_path, 2, 0, STEPS, save=True)
    saved = torch.load(tmp_path / "ckpt.pt")["topk"]
    assert saved["world_size"] == 2
    (one,) = _run(tmp_path, 1, STEPS, STEPS, load=True)  # restore only, on a single worker
    assert one["restored"]
    for name, residual in one["restored"].items():
        old = [r["tensors"][name]["residual"].clone() for r in saved["ranks"]]
        owed_before = sum(old) / len(old)           # what an Average update still owes: (1/P) sum of residuals
        owed_after = torch.tensor(residual) / 1     # (1/P') sum over the P' = 1 new rank
        torch.testing.assert_close(owed_after, owed_before, rtol=1e-6, atol=1e-7)
    assert os.path.exists(tmp_path / "ckpt.pt")


def test_update_mode_on_another_number_of_workers_keeps_the_averaged_first_moment(tmp_path):
    """Update mode's first moments are each rank's own: a new world gets their mean, which is what the averaged
    update is made of (and the owed residual mass, as in gradient mode)."""
    options = {"target": "update", "optimizer": "adamw", "second_moment": "shared"}
    _run(tmp_path, 2, 0, STEPS, save=True, **options)
    saved = torch.load(tmp_path / "ckpt.pt")["topk"]
    (one,) = _run(tmp_path, 1, STEPS, STEPS, load=True, **options)
    moments = {n[len("first_moment."):]: v for n, v in one["restored"].items() if n.startswith("first_moment.")}
    assert moments
    for name, moment in moments.items():
        old = [r["tensors"][name]["momentum"].clone() for r in saved["ranks"]]
        torch.testing.assert_close(torch.tensor(moment), sum(old) / len(old), rtol=1e-6, atol=1e-8)
