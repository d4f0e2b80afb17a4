"""A few TopKEF training steps, run by tests/test_testbed.py on hosts made by scripts/testbed.sh."""
import sys

import horovod.torch as hvd
import torch

from horovod_topk.torch import TopKEF

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
compressor = TopKEF(ratio=0.01)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression=compressor)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(hvd.rank())
for step in range(5):
    opt.zero_grad()
    x, y = torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
# every rank must hold the same parameters after the steps
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
spread = (hvd.allreduce(flat, op=hvd.Max, name="check.max") - hvd.allreduce(flat, op=hvd.Min, name="check.min")).abs()
reports = hvd.allgather_object((hvd.rank(), hvd.size(), compressor.stats(), float(spread.max())))
if hvd.rank() == 0:  # one printer, so that the lines of the two ranks cannot interleave
    sys.stdout.write(f"TESTBED controller={'gloo' if hvd.gloo_enabled() and not hvd.mpi_enabled() else 'mpi'}\n")
    for rank, size, stats, spread in reports:
        # one write per line: print() writes the text and the newline separately, and mpirun's output tagging
        # can then land between them
        sys.stdout.write(f"TESTBED rank={rank} size={size} steps={stats['steps']} bytes_sent={stats['bytes_sent']} "
                         f"bytes_dense={stats['bytes_dense']} max_param_spread={spread:.3g}\n")
        sys.stdout.flush()
