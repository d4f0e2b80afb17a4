#!/usr/bin/env python
"""How evenly a rank's Top-K entries fall into the P regions of the sparse allreduce (core.exchange), for three
ways to split the index space: contiguous blocks, interleave (i mod P) and the multiplicative hash in use.

Real gradients, one process: the digits CNN of examples/ (trained on its data) and the character GRU language
model's embedding (random tokens), ratio 0.01 with error feedback (residual kept) over 20 steps. Reported: the
largest region's share of a rank's k selected entries in units of k / P (1.0 = perfectly even), mean and worst
over steps, and the fraction of the k entries that overflow the phase-1 capacity (core.exchange.capacity).

    python benchmarks/region_balance.py
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from horovod_topk.core.exchange import capacity  # noqa: E402
from horovod_topk.torch.sparse_allreduce import regions  # noqa: E402

SPLITS = {
    "contiguous": lambda idx, n, p: idx * p // n,
    "interleave": lambda idx, n, p: idx % p,
    "hash": lambda idx, n, p: regions(idx, p),
}
RATIO, STEPS = 0.01, 20


def gradients():
    """Per step: {name: flat gradient} of the digits CNN's and a GRU LM's weights (>= 1024 entries)."""
    from digits_data import load_split
    from digits_torch import DigitsCNN

    torch.manual_seed(0)
    x, y, _, _ = (torch.from_numpy(a) for a in load_split(0, 0, 1))
    x = x[:, None]
    cnn = DigitsCNN()
    embed, gru, head = nn.Embedding(256, 64), nn.GRU(64, 128, batch_first=True), nn.Linear(128, 256)
    lm = nn.ModuleDict({"embed": embed, "gru": gru, "head": head})
    opt = torch.optim.SGD(list(cnn.parameters()) + list(lm.parameters()), lr=0.05)
    text = torch.randint(32, 127, (STEPS * 16 + 1, 65))  # ASCII-like tokens: a skewed vocabulary use
    for step in range(STEPS):
        opt.zero_grad()
        batch = slice(32 * step, 32 * step + 32)
        nn.functional.cross_entropy(cnn(x[batch]), y[batch]).backward()
        tokens = text[16 * step : 16 * step + 16]
        out, _ = gru(embed(tokens[:, :-1]))
        nn.functional.cross_entropy(head(out).reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        grads = {f"cnn.{n}": p.grad.reshape(-1).clone() for n, p in cnn.named_parameters() if p.numel() >= 1024}
        grads.update({f"lm.{n}": p.grad.reshape(-1).clone() for n, p in lm.named_parameters() if p.numel() >= 1024})
        opt.step()
        yield grads


def main() -> None:
    worlds = (4, 8, 32)
    stats = {}  # (split, P) -> list of (max share, overflow fraction)
    residuals = {}
    for grads in gradients():
        for name, g in grads.items():
            r = residuals.setdefault(name, torch.zeros_like(g))
            r.add_(g)
            k = max(1, math.ceil(RATIO * g.numel()))
            idx = torch.topk(r.abs(), k).indices
            r[idx] = 0
            for p in worlds:
                for split, fn in SPLITS.items():
                    counts = torch.bincount(fn(idx, g.numel(), p), minlength=p).float()
                    over = float((counts - capacity(k, p)).clamp(min=0).sum()) / k
                    stats.setdefault((split, p, name), []).append((float(counts.max()) / (k / p), over))
    names = sorted({key[2] for key in stats})
    print(f"largest region / (k/P), mean over {STEPS} steps [worst]; overflow beyond capacity (% of k)\n")
    print("| tensor (numel) | split | " + " | ".join(f"P = {p}" for p in worlds) + " |")
    print("|---|---|" + "---|" * len(worlds))
    for name in names:
        for split in SPLITS:
            cells = []
            for p in worlds:
                rows = stats[(split, p, name)]
                share = sum(s for s, _ in rows) / len(rows)
                over = sum(o for _, o in rows) / len(rows)
                cells.append(f"{share:.2f} [{max(s for s, _ in rows):.2f}], {100 * over:.1f}%")
            print(f"| {name} | {split} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
