"""core.bucket_plan: one plan per bucket, each member planned as on its own."""
from __future__ import annotations

import pytest

from horovod_topk.core import TopKConfig
from horovod_topk.core.bucket_plan import bucket_fingerprint, plan_bucket
from horovod_topk.core.consistency import mismatch_message
from horovod_topk.core.policy import plan_tensor

MEMBERS = [("fc2.weight", 65536), ("fc2.bias", 256), ("fc1.weight", 8192), ("fc1.bias", 256)]


def plan(config=None, members=MEMBERS, step=0, world_size=2):
    return plan_bucket(members, config or TopKConfig(ratio=0.01), is_floating=True, world_size=world_size,
                       step=step, value_itemsize=4, grad_itemsize=4)


def test_members_keep_their_own_plan_and_lie_end_to_end():
    config = TopKConfig(ratio=0.01)
    p = plan(config)
    assert [m.offset for m in p.members] == [0, 65536, 65792, 73984] and p.numel == 74240
    for m, (name, numel) in zip(p.members, MEMBERS):
        alone = plan_tensor(name, numel, True, config, world_size=2, step=0, value_itemsize=4, grad_itemsize=4)
        assert m.plan.k == alone.k
    assert [m.name for m in p.compressed] == ["fc2.weight", "fc1.weight"]  # biases are under min_numel
    assert [m.name for m in p.dense] == ["fc2.bias", "fc1.bias"]
    assert p.exchange == "allgather" and not p.compressed_contiguous
    layout = p.payload
    assert layout.members == ("fc2.weight", "fc1.weight")
    assert layout.nbytes == (656 * 8, 82 * 8)  # k = ceil(0.01 N) entries of 4-byte index + 4-byte value


def test_ratio_one_is_dense_everywhere():
    p = plan(TopKConfig(ratio=1.0, min_numel=0))
    assert not p.compressed and p.exchange == "dense" and p.payload is None


def test_warm_up_changes_k_with_the_step():
    config = TopKConfig(ratio=0.01, warmup_steps=10, min_numel=0)
    ks = [sum(m.plan.k or 0 for m in plan(config, step=t).compressed) for t in (0, 5, 10)]
    assert ks[0] == 0 or ks[0] > ks[1] > ks[2]  # dense (or nearly) first, then fewer entries


def test_a_steady_bucket_plans_once_and_the_warm_up_still_moves_k():
    """plan_bucket hands back the same plan while its inputs stay the same (a bucket in steady state), and a
    step inside the warm-up, another configuration, world size or membership still gets its own plan."""
    config = TopKConfig(ratio=0.01, warmup_steps=10, min_numel=0)
    assert plan(config, step=12) is plan(config, step=50) is plan(config, step=10)
    assert plan(config, step=3) is not plan(config, step=4)
    assert [m.plan.k for m in plan(config, step=3).members] != [m.plan.k for m in plan(config, step=4).members]
    assert plan(TopKConfig(ratio=0.01), step=5) is plan(TopKConfig(ratio=0.01), step=0)  # no warm-up: one plan
    assert plan(TopKConfig(ratio=0.01)) is not plan(TopKConfig(ratio=0.02))
    assert plan(world_size=2) is not plan(world_size=4)
    assert [m.name for m in plan(members=MEMBERS[:2]).members] == ["fc2.weight", "fc2.bias"]


def test_names_are_deterministic_and_tell_buckets_apart():
    a, b = plan(), plan(members=MEMBERS[::-1])
    assert a.name == plan().name and a.name != b.name
    assert a.name.startswith("bucket.fc2.weight..fc1.bias.4.")


def test_fingerprints_name_a_rank_configured_otherwise():
    rows = [bucket_fingerprint(TopKConfig(ratio=r), plan(TopKConfig(ratio=r)), "float32", 0) for r in (0.01, 0.02)]
    message = mismatch_message("bucket", rows)
    assert message is not None and "ratio" in message
    same = [bucket_fingerprint(TopKConfig(), plan(), "float32", 0)] * 2
    assert mismatch_message("bucket", same) is None


def test_fingerprints_differ_when_members_differ():
    config = TopKConfig()
    rows = [bucket_fingerprint(config, plan(config), "float32", 0),
            bucket_fingerprint(config, plan(config, members=MEMBERS[:3] + [("fc1.bias", 128)]), "float32", 0)]
    assert mismatch_message("bucket", rows) is not None


def test_an_empty_bucket_is_refused():
    with pytest.raises(ValueError, match="at least one member"):
        plan(members=[])


def test_held_routes_send_every_floating_member_in_float16_or_in_bytes():
    """ratio="auto" holding fp16 or int8 (config None): every floating member takes that route, however small; a
    bucket of integers stays dense; the three routes' members never overlap."""
    from horovod_topk.core.exchange import DENSE, DENSE_HALF, DENSE_INT8

    for held, route in ((DENSE_HALF, "halved"), (DENSE_INT8, "bytewise"), (DENSE, "dense")):
        p = plan_bucket(MEMBERS, None, is_floating=True, world_size=2, step=0, value_itemsize=4, grad_itemsize=4,
                        held=held)
        assert [m.name for m in getattr(p, route)] == [name for name, _ in MEMBERS], held
        assert sum(len(getattr(p, r)) for r in ("halved", "bytewise", "dense")) == len(MEMBERS)
        assert not p.compressed and p.exchange == "dense"
        integers = plan_bucket(MEMBERS, None, is_floating=False, world_size=2, step=0, value_itemsize=4,
                               grad_itemsize=4, held=held)
        assert len(integers.dense) == len(MEMBERS)
