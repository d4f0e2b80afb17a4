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
            alias, ctx = compressor.compress(g.clone())
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
