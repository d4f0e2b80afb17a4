"""A small model and training loop shared by the PyTorch multi-worker tests."""
from typing import Callable, Dict, List, Optional

import horovod.torch as hvd
import torch
from torch import nn


class Net(nn.Module):
    """Two compressible layers (2048 weights each), small dense ones, and a branch used only on some steps."""

    def __init__(self, sparse_embedding: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16, sparse=sparse_embedding)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.sometimes = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.relu(self.fc1(x + self.embed(tokens).repeat(1, 2)))
        h = torch.relu(self.fc2(h))
        if use_branch:
            h = h + torch.tanh(self.sometimes(h))
        return self.head(h)


def batch(step: int, dtype: torch.dtype = torch.float32):
    """Different data on every rank and step, the same across runs."""
    gen = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(16, 32, generator=gen).to(dtype)
    tokens = torch.randint(0, 100, (16,), generator=gen)
    y = torch.randint(0, 4, (16,), generator=gen)
    return x, tokens, y


def train(
    compression,
    steps: int = 4,
    *,
    dtype: torch.dtype = torch.float32,
    sparse_embedding: bool = False,
    named: bool = True,
    clip: Optional[float] = None,
    passes: int = 1,
    groups=None,
    optimizer_factory: Callable = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    on_synchronized: Optional[Callable[[nn.Module], None]] = None,
    **dist_kwargs,
) -> Dict[str, torch.Tensor]:
    """Train ``steps`` optimizer steps of Net on 2 workers; return the final parameters."""
    torch.manual_seed(0)
    model = Net(sparse_embedding).to(dtype)
    if groups == "list":
        groups = [[model.fc1.weight, model.fc2.weight], [model.head.weight, model.head.bias]]
    opt = hvd.DistributedOptimizer(
        optimizer_factory(model.parameters()),
        named_parameters=model.named_parameters() if named else None,
        compression=compression,
        backward_passes_per_step=passes,
        groups=groups,
        **dist_kwargs,
    )
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, tokens, y = batch(passes * step + micro, dtype)
            # The branch's gradients are None on some steps. Without groups this differs between ranks (Horovod
            # supports that); with groups Horovod itself hangs on rank-dependent graphs, so it is per step there.
            use_branch = (step + (hvd.rank() if groups is None else 0)) % 2 == 0
            loss = nn.functional.cross_entropy(model(x, tokens, use_branch).float(), y)
            loss.backward()
        if clip is not None or on_synchronized is not None:
            opt.synchronize()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if on_synchronized is not None:
                on_synchronized(model)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], **tol) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m: f"{name}: {m}", **tol)


def differs(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]
