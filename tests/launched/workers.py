"""Functions run on freshly launched Horovod workers by the tests of this package (``horovod.run``): each test
needs processes of its own (new processes after a checkpoint, collectives left unmatched on purpose, ...)."""
from typing import Dict

import torch
from torch import nn


def _one_step(net: nn.Module, forward: nn.Module, compressor) -> None:
    import horovod.torch as hvd

    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(), compression=compressor)
    forward(torch.randn(8, 64)).sum().backward()
    opt.step()


def rank_agreement_cases() -> Dict[str, str]:
    """Each case configures rank 1 differently from rank 0 and runs one step; returns case -> the error text
    (or "no error"). Each case's parameters carry the case's name: the collectives a disagreement leaves
    unmatched stay pending in Horovod and must not collide with the next case's."""
    import horovod.torch as hvd
    from horovod_topk.core import RankMismatch
    from horovod_topk.torch import TopKEF

    hvd.init()
    other = hvd.rank() == 1
    cases = {
        # rank 1 sends the hidden layer dense (allreduce), rank 0 Top-K (allgather): a hang without the check
        "dense_vs_topk": lambda: TopKEF(ratio=0.01, min_numel=100_000 if other else 1024),
        # both allgather, payloads of different sizes
        "ratio": lambda: TopKEF(ratio=0.05 if other else 0.01),
        # a wider hidden layer on rank 1: same names, other shapes
        "shape": lambda: TopKEF(ratio=0.01),
        # rank 1 resumed from a checkpoint at another step
        "step": lambda: TopKEF(ratio=0.01),
        "none": lambda: TopKEF(ratio=0.01),
    }
    results: Dict[str, str] = {}
    for case, make in cases.items():
        torch.manual_seed(0)
        width = 128 if (case == "shape" and other) else 64
        net = nn.ModuleDict({case: nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 4))})
        compressor = make()
        if case == "step" and other:
            source = TopKEF(ratio=0.01)
            for name, p in net.named_parameters():
                source.registry.record(name, tuple(p.shape)).steps = 5
            compressor.load_state_dict(source.state_dict())
        try:
            _one_step(net, net[case], compressor)
            results[case] = "no error"
        except RankMismatch as error:
            results[case] = str(error)
        hvd.allreduce(torch.tensor(1.0), name=f"after.{case}")  # every rank got past its error
    return results


def tf_rank_agreement_case() -> str:
    """TensorFlow: rank 1 would send w dense, rank 0 Top-K; returns the error text (or "no error")."""
    import os

    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from horovod_topk.core import RankMismatch
    from horovod_topk.tensorflow import TopKEF

    hvd.init()
    compressor = TopKEF(ratio=0.01, min_numel=100_000 if hvd.rank() == 1 else 1024)
    w = tf.Variable(tf.ones([64, 64]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x @ w)
        return hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [w])

    try:
        step(tf.ones([8, 64]))
        result = "no error"
    except RankMismatch as error:
        result = str(error)
    hvd.allreduce(tf.constant(1.0), name="after")
    return result
