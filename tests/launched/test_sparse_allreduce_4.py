"""The sparse allreduce on 4 launched workers (PyTorch, and TensorFlow's exchange="auto"): error feedback is exact over all ranks, every rank applies the same
<= ~k entries, and ranks that disagree about the exchange raise instead of hanging."""
import horovod

from . import sparse_workers


def test_error_feedback_is_exact_on_four_workers():
    per_rank = horovod.run(sparse_workers.ef_invariant, num_proc=4, use_gloo=True)
    for result in per_rank:
        assert result["size"] == 4
        assert max(result["errors"]) < 1e-4, result["errors"]
        assert all(result["same"])
        # k = 5% of each tensor; P * ceil(k / P) entries at most
        ks = [4608 * 0.05, 16000 * 0.05, 5000 * 0.05] * 3
        assert all(0 < n <= k + 4 for n, k in zip(result["applied"], ks)), result["applied"]
        assert result["bytes_sent"] > 0


def test_tensorflow_auto_takes_the_sparse_allreduce_and_keeps_error_feedback_exact_on_four_workers():
    per_rank = horovod.run(sparse_workers.tf_ef_invariant, num_proc=4, use_gloo=True)
    for result in per_rank:
        assert result["size"] == 4
        assert result["sparse"], "exchange='auto' must pick the sparse allreduce for these tensors at P = 4"
        assert max(result["errors"]) < 1e-4, result["errors"]
        assert all(result["same"])
        ks = [4608 * 0.05, 16000 * 0.05, 5000 * 0.05] * 2
        assert all(0 < n <= k + 4 for n, k in zip(result["applied"], ks)), result["applied"]


def test_disagreeing_exchange_raises_on_every_rank():
    messages = horovod.run(sparse_workers.exchange_disagreement, num_proc=2, use_gloo=True)
    assert messages[0] == messages[1]
    assert messages[0].startswith("horovod-topk: ranks disagree about tensor")
    assert "exchange (rank 0: 'sparse_allreduce', rank 1: 'allgather')" in messages[0]
