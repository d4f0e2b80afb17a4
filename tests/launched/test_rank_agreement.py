"""Ranks configured differently fail on the first step, on every rank, with an error naming the tensor and the
difference -- never a hang (2 Horovod workers launched by the test)."""
import horovod

from . import workers


def test_disagreeing_ranks_raise_on_every_rank_naming_tensor_and_field():
    per_rank = horovod.run(workers.rank_agreement_cases, num_proc=2, use_gloo=True)
    assert per_rank[0] == per_rank[1], "both ranks must report the same disagreement"
    results = per_rank[0]
    assert results["none"] == "no error"
    expected = {
        "dense_vs_topk": ["min_numel (rank 0: 1024, rank 1: 100000)"],
        "ratio": ["ratio (rank 0: 0.01, rank 1: 0.05)"],
        "shape": ["shape (rank 0: (4, 64), rank 1: (4, 128))", "numel (rank 0: 256, rank 1: 512)"],
        "step": ["step (rank 0: 0, rank 1: 5)"],
        "target": ["target (rank 0: 'gradient', rank 1: 'update')"],
        "second_moment": ["second_moment (rank 0: 'shared', rank 1: 'local')"],
        "bucket_bytes": ["bucket_bytes (rank 0: 1048576, rank 1: 0)"],
    }
    for case, fragments in expected.items():
        message = results[case]
        assert message.startswith("horovod-topk: ranks disagree about tensor"), (case, message)
        assert f"'{case}." in message, (case, message)
        for fragment in fragments:
            assert fragment in message, (case, fragment, message)


def test_tensorflow_ranks_that_disagree_raise_while_tracing():
    per_rank = horovod.run(workers.tf_rank_agreement_case, num_proc=2, use_gloo=True)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0].startswith("horovod-topk: ranks disagree about tensor")
    assert "min_numel (rank 0: 1024, rank 1: 100000)" in per_rank[0]
    assert "decision (rank 0: 41, rank 1: dense)" in per_rank[0]
