"""Worker functions for the sparse allreduce on freshly launched Horovod workers (``horovod.run``)."""
from typing import Dict, List


def ef_invariant(ratio: float = 0.05, steps: int = 3) -> Dict[str, object]:
    """Reduce random conv/embedding/vector gradients with exchange="sparse_allreduce" through the routed optimizer
    path; per step and tensor, the largest |sum over ranks of (new residual + applied) - sum of (old residual +
    gradient)|, whether every rank applied the same update, and how many entries were applied."""
    import horovod.torch as hvd
    import torch
    from horovod.torch import optimizer as hvd_optimizer

    from horovod_topk.torch import TopKEF
    from horovod_topk.torch import routing

    hvd.init()
    routing.install()
    compressor = TopKEF(ratio=ratio, min_numel=0, exchange="sparse_allreduce")
    shapes = {"conv": (32, 16, 3, 3), "embed": (1000, 16), "fc": (5000,)}
    gen = torch.Generator().manual_seed(hvd.rank())
    errors: List[float] = []
    same: List[bool] = []
    applied_counts: List[int] = []
    for step in range(steps):
        grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        before = {}
        for n, g in grads.items():
            record = compressor.registry.records.get(n)
            old = record.residual.double() if record is not None and record.residual is not None else 0.0
            before[n] = old + g.reshape(-1).double()
        handles = {}
        for n, g in grads.items():
            alias, ctx = routing.ScopedCompression(compressor, "").compress(g.clone())  # as a wrapped optimizer does
            handles[n] = hvd_optimizer.allreduce_async_(alias, name=n, op=hvd.Average)
        outputs = {n: hvd_optimizer.synchronize(h) for n, h in handles.items()}
        for n in shapes:
            applied = outputs[n].reshape(-1).double() * hvd.size()
            total_before = hvd.allreduce(before[n], op=hvd.Sum, name=f"before.{n}.{step}")
            residual = compressor.registry.records[n].residual.double()
            total_after = hvd.allreduce(residual, op=hvd.Sum, name=f"after.{n}.{step}") + applied
            errors.append(float((total_after - total_before).abs().max()))
            rows = hvd.allgather(applied.unsqueeze(0), name=f"applied.{n}.{step}")
            same.append(all(torch.equal(rows[0], row) for row in rows))
            applied_counts.append(int((applied != 0).sum()))
    return {"errors": errors, "same": same, "applied": applied_counts, "size": hvd.size(),
            "bytes_sent": compressor.stats()["bytes_sent"]}


def exchange_disagreement() -> str:
    """Rank 0 asks for the sparse allreduce, the others for the allgather: the error text (or "no error")."""
    import horovod.torch as hvd
    import torch
    from torch import nn

    from horovod_topk.core import RankMismatch
    from horovod_topk.torch import TopKEF

    hvd.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    exchange = "sparse_allreduce" if hvd.rank() == 0 else "allgather"
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                   compression=TopKEF(ratio=0.01, dense_fallback=False, exchange=exchange))
    net(torch.randn(8, 64)).sum().backward()
    try:
        opt.step()
        message = "no error"
    except RankMismatch as error:
        message = str(error)
    hvd.allreduce(torch.tensor(1.0), name="after.exchange")  # every rank got past its error before any exits
    return message


def tf_ef_invariant(ratio: float = 0.05, steps: int = 2) -> Dict[str, object]:
    """ef_invariant for TensorFlow, with exchange="auto" choosing by bytes alone (collective_latency_bytes=0; the
    default 128 KiB per collective keeps tensors this small on the allgather): at P >= 3 core's cost model then
    picks the sparse allreduce for these tensors, which ``sparse`` reports (every compressed tensor's bytes_sent is the sparse allreduce's)."""
    import math
    import os

    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    from horovod_topk.core.exchange import SparseAllreduceLayouts
    from horovod_topk.tensorflow import TopKEF

    hvd.init()
    compressor = TopKEF(ratio=ratio, min_numel=0, collective_latency_bytes=0)
    shapes = [(32, 16, 3, 3), (1000, 16), (5000,)]
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]

    @tf.function
    def reduce(grads):
        with tf.GradientTape() as tape:  # the gradient of sum(v * g) with respect to v is g
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        return hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, variables)

    def residuals() -> Dict[tuple, np.ndarray]:
        return {tuple(r.shape): r.residual.numpy().astype(np.float64).copy()
                for _, r in compressor.registry if r.residual is not None}

    rng = np.random.RandomState(hvd.rank())
    old = {s: np.zeros(int(np.prod(s))) for s in shapes}
    errors: List[float] = []
    same: List[bool] = []
    applied_counts: List[int] = []
    for step in range(steps):
        grads = [rng.randn(*s).astype(np.float32) for s in shapes]
        out = [o.numpy() for o in reduce([tf.constant(g) for g in grads])]
        new = residuals()
        for i, s in enumerate(shapes):
            applied = out[i].reshape(-1).astype(np.float64) * hvd.size()
            before = hvd.allreduce(tf.constant(old[s] + grads[i].reshape(-1)), op=hvd.Sum, name=f"tf.before.{i}.{step}")
            after = hvd.allreduce(tf.constant(new[s]), op=hvd.Sum, name=f"tf.after.{i}.{step}").numpy() + applied
            errors.append(float(np.abs(after - before.numpy()).max()))
            rows = hvd.allgather(tf.constant(applied[None]), name=f"tf.applied.{i}.{step}").numpy()
            same.append(all(np.array_equal(rows[0], row) for row in rows))
            applied_counts.append(int(np.count_nonzero(applied)))
        old = new
    compressor.stats()  # reads the counter variables back into the records
    sparse = all(
        r.bytes_sent == r.steps * SparseAllreduceLayouts(math.ceil(ratio * int(np.prod(r.shape))), hvd.size(), 4,
                                                         int(np.prod(r.shape))).sent_nbytes and r.steps == steps
        for _, r in compressor.registry if r.residual is not None)
    return {"errors": errors, "same": same, "applied": applied_counts, "size": hvd.size(), "sparse": sparse}
