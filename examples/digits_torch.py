"""Train a small CNN on scikit-learn's handwritten digits with Horovod and TopKEF.

Real data, shipped with scikit-learn (1,797 8x8 images, no download). Each worker trains on its own shard of the
training split; rank 0 prints per-epoch loss, test accuracy and the bytes this rank handed to collectives versus
what a dense allreduce would have handed over.

    horovodrun -np 2 -H localhost:2 python examples/digits_torch.py               # TopKEF, ratio 0.01
    horovodrun -np 2 -H localhost:2 python examples/digits_torch.py --dense       # plain Horovod, for comparison
"""
from __future__ import annotations

import time

import horovod.torch as hvd
import torch
from digits_data import load_split, method_label, parse_args, summary_ratio, write_summary
from digits_model import DigitsCNN
from torch import nn

from horovod_topk.torch import TopKEF


def main() -> None:
    args = parse_args(__doc__)

    hvd.init()
    torch.manual_seed(args.seed)
    # each worker its own shard of the training set; images get a channel axis: (N, 1, 8, 8)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_split(args.seed, hvd.rank(), hvd.size()))
    x_train, x_test = x_train[:, None], x_test[:, None]

    model = DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvd.Compression.none if args.dense else TopKEF(ratio=args.ratio)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    n_params = sum(p.numel() for p in model.parameters())
    if hvd.rank() == 0:
        method = method_label(args)
        print(f"digits CNN: {n_params} parameters, {hvd.size()} workers, {method}, "
              f"{len(x_train)} training images per worker, {len(x_test)} test images", flush=True)

    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dense_bytes, history = 0, []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=gen)
        # the same number of steps on every worker, or one of them would wait for the other's gradients forever
        steps = hvd.allreduce(torch.tensor(len(order) // args.batch_size), op=hvd.Min, name="steps").item()
        total_loss = 0.0
        epoch_start = time.perf_counter()
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
            dense_bytes += gradient_bytes  # what plain Horovod hands its allreduces per step
        train_s = time.perf_counter() - epoch_start
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        mean_loss = hvd.allreduce(torch.tensor(total_loss / steps), name="loss").item()
        history.append({"epoch": epoch, "loss": mean_loss, "accuracy": accuracy, "train_s": train_s,
                        "steps": steps})
        if hvd.rank() == 0:
            line = f"epoch {epoch:2d}  loss {mean_loss:.4f}  test accuracy {accuracy:.4f}"
            if not args.dense:
                s = compression.stats()
                line += (f"  sent {s['bytes_sent'] / 1e6:.2f} MB vs dense {s['bytes_dense'] / 1e6:.2f} MB"
                         f" ({s['compression_ratio']:.1f}x less)")
            print(line, flush=True)
    wall = time.perf_counter() - start
    if hvd.rank() == 0:
        print(f"done in {wall:.1f} s; final test accuracy {accuracy:.4f}", flush=True)
        sent = dense_bytes if args.dense else compression.stats()["bytes_sent"]
        method = method_label(args)
        write_summary(args.summary, "PyTorch", method, history, sent, dense_bytes, wall,
                      ratio=summary_ratio(args, compression), tensors=[p.numel() for p in model.parameters()])


if __name__ == "__main__":
    main()
