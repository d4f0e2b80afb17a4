"""Functions run on freshly launched Horovod workers by the tests of this package (``horovod.run``): each test
needs processes of its own (new processes after a checkpoint, collectives left unmatched on purpose, ...)."""
from typing import Dict

import torch
from torch import nn


def _one_step(net: nn.Module, forward: nn.Module, compressor) -> None:
    import horovod.torch as hvd

    # Adam: the one optimizer every mode takes (update mode's shared second moment computes Adam/AdamW only)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.1),
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
    # gradient mode named (target="auto" would exchange Adam's updates), except where the case is the mode
    cases = {
        # rank 1 sends the hidden layer dense (allreduce), rank 0 Top-K (allgather): a hang without the check
        "dense_vs_topk": lambda: TopKEF(ratio=0.01, min_numel=100_000 if other else 1024, target="gradient"),
        # both allgather, payloads of different sizes
        "ratio": lambda: TopKEF(ratio=0.05 if other else 0.01, target="gradient"),
        # a wider hidden layer on rank 1: same names, other shapes
        "shape": lambda: TopKEF(ratio=0.01, target="gradient"),
        # rank 1 resumed from a checkpoint at another step
        "step": lambda: TopKEF(ratio=0.01, target="gradient"),
        "none": lambda: TopKEF(ratio=0.01, target="gradient"),
        # rank 1 holds its gradients and exchanges updates after its step; rank 0 allgathers gradients
        "target": lambda: (TopKEF(ratio=0.01, target="update", second_moment="local") if other
                           else TopKEF(ratio=0.01, target="gradient")),
        # both in update mode, with different second moments
        "second_moment": lambda: TopKEF(ratio=0.01, target="update", second_moment="local" if other else "shared"),
        # rank 0 holds its payload for its bucket's one allgather, rank 1 sends it on its own
        "bucket_bytes": lambda: TopKEF(ratio=0.01, bucket_bytes=0 if other else 1 << 20, target="gradient"),
    }
    results: Dict[str, str] = {}
    for case, make in cases.items():
        torch.manual_seed(0)
        width = 128 if (case == "shape" and other) else 64
        net = nn.ModuleDict({case: nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 4))})
        compressor = make()
        if case == "step" and other:
            source = TopKEF(ratio=0.01, target="gradient")
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


def _resume_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4))


def _resume_batch(step: int):
    import horovod.torch as hvd

    gen = torch.Generator().manual_seed(7919 * hvd.rank() + step)
    return torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def resume_run(path: str, start: int, stop: int, save: bool, load: bool, options: dict) -> Dict[str, list]:
    """Train steps [start, stop) of a small MLP with SGD + momentum and TopKEF; optionally restore everything from
    ``path`` first and save everything to it at the end. Returns the final parameters (as lists) and what this
    rank restored."""
    import horovod.torch as hvd
    from horovod_topk.torch import TopKEF, gather_state, restore_state

    hvd.init()
    model = _resume_model()
    options = dict(options)
    adamw = options.pop("optimizer", "sgd") == "adamw"
    compressor = TopKEF(**options)
    # Horovod's DistributedOptimizer is a new optimizer object over the same parameters: its state (the momentum
    # buffers) is what is saved and loaded, not the state of the optimizer it was made from.
    base = (torch.optim.AdamW(model.parameters(), lr=0.01) if adamw
            else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compressor)
    # update mode's "local" and "calibrated" second moments keep each rank's own optimizer state: saved per rank
    own_optimizer = options.get("target") == "update" and options.get("second_moment") in ("local", "calibrated")
    own_path = f"{path}.optimizer{hvd.rank()}"
    restored = {}
    if load:
        ckpt = torch.load(path) if hvd.rank() == 0 else None
        # model and optimizer states are the same on every rank: rank 0's copy goes to all
        # (named: broadcast_object's default name is the object's type, which differs between root and the others)
        model_state, opt_state = hvd.broadcast_object(None if ckpt is None else (ckpt["model"], ckpt["optimizer"]),
                                                      name="resume.model_and_optimizer")
        model.load_state_dict(model_state)
        opt.load_state_dict(torch.load(own_path) if own_optimizer else opt_state)
        restore_state(compressor, None if ckpt is None else ckpt["topk"])
        restored = {name: rec.residual.tolist() for name, rec in compressor.registry if rec.residual is not None}
        restored.update({"first_moment." + name: rec.momentum.tolist() for name, rec in compressor.registry
                         if rec.momentum is not None})
    for step in range(start, stop):
        x, y = _resume_batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if save:
        if own_optimizer:
            torch.save(opt.state_dict(), own_path)
        topk = gather_state(compressor)
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "topk": topk,
                        "world_size": hvd.size()}, path)
    return {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()], "restored": restored}
