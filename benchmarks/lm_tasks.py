"""The language-model tasks of the convergence study, shared by benchmarks/convergence.py (real Horovod workers) and
benchmarks/compression_sim.py (workers simulated in one process): data, model, the user's optimizer and schedule,
batches and validation, defined once so that both measure the same thing.

Data: the Python standard library's own source files (the *.py files of this interpreter's stdlib directory,
sorted, first 2 MB; the last 10% held out): real text that every machine with Python has, no download.

  charlm  a byte-level GRU (64-d embedding, 256 hidden; 0.33M parameters), Adam at 3e-3, constant rate
  gptlm   a small decoder-only transformer (byte vocabulary, 4 layers, d=128, 4 heads, causal attention, context
          64; 0.87M parameters), AdamW (weight decay 0.1 on matrices) with linear warm-up over 5% of the steps
          and cosine decay to 10% of the peak rate: how language models are trained today, in miniature
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

__all__ = ["LMTask", "make_task", "corpus", "TASKS"]

TASKS = ("charlm", "gptlm", "charlm-sgd")
#: charlm-sgd's learning rate (SGD, momentum 0.9): the best of 0.5 / 1 / 2 / 4 for dense at 400 steps on 2
#: simulated workers, seed 0 (validation loss 1.568 / 1.511 / 12.6 / 21.9; 2026-11-28).
SGD_LR = 1.0


def corpus(size: int = 2_000_000) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """The text, and where it came from. HOROVOD_TOPK_CORPUS names a file to read instead: another Python's stdlib
    holds other text, so a run on another machine (a GPU host) reads this machine's text saved to a file
    (``python benchmarks/lm_tasks.py --save FILE``) to measure the same task."""
    saved = os.environ.get("HOROVOD_TOPK_CORPUS")
    if saved:
        text = Path(saved).read_bytes()[:size]
        source = f"{saved} (a saved corpus, first {len(text)} bytes)"
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        text = b"".join(p.read_bytes() for p in sorted(stdlib.glob("*.py")))[:size]
        source = f"{stdlib}/*.py (first {len(text)} bytes)"
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:], source


class CharGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.gru = nn.GRU(64, 256, batch_first=True)
        self.out = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gru(self.embed(x))[0])


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d: int = 128, layers: int = 4, heads: int = 4, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.out(self.ln(self.blocks(h)))


@dataclass
class LMTask:
    name: str
    batch_size: int = 16
    seq: int = 128
    eval_every: int = 50
    valid_windows: int = 64
    weight_decay: float = 0.1
    #: The optimizer's learning rate times this (a diagnosis: is a method's gain only a larger step?).
    lr_scale: float = 1.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.train, self.valid, self.source = corpus()
        vgen = torch.Generator().manual_seed(12345)
        starts = torch.randint(0, len(self.valid) - self.seq - 1, (self.valid_windows,), generator=vgen)
        self.vx = torch.stack([self.valid[i:i + self.seq] for i in starts])
        self.vy = torch.stack([self.valid[i + 1:i + self.seq + 1] for i in starts])
        self.vx, self.vy = self.vx.to(self.device), self.vy.to(self.device)

    def model(self) -> nn.Module:
        return CharGRU() if self.name.startswith("charlm") else TinyGPT(context=self.seq)

    def optimizer(self, model: nn.Module, steps: int) -> Tuple[torch.optim.Optimizer, Optional[Any]]:
        """The user's optimizer (and schedule, stepped once per step); the same for every method."""
        if self.name == "charlm":
            return torch.optim.Adam(model.parameters(), lr=3e-3 * self.lr_scale), None
        if self.name == "charlm-sgd":  # the same GRU under SGD with momentum: what the optimizer alone changes
            return torch.optim.SGD(model.parameters(), lr=SGD_LR * self.lr_scale, momentum=0.9), None
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                                lr=3e-3 * self.lr_scale, betas=(0.9, 0.95))
        warm = max(1, steps // 20)

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(1, steps - warm))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)

    def build(self, seed: int, steps: int) -> Tuple[nn.Module, torch.optim.Optimizer, Optional[Any]]:
        torch.manual_seed(seed)
        model = self.model().to(self.device)  # initialised on the CPU: the same weights on every device
        opt, sched = self.optimizer(model, steps)
        return model, opt, sched

    def batch(self, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.seq - 1, (self.batch_size,), generator=gen)
        x = torch.stack([self.train[i:i + self.seq] for i in starts])
        y = torch.stack([self.train[i + 1:i + self.seq + 1] for i in starts])
        return x.to(self.device), y.to(self.device)

    @staticmethod
    def loss(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    def validate(self, model: nn.Module) -> float:
        with torch.no_grad():
            return self.loss(model, (self.vx, self.vy)).item()


def make_task(name: str, **options: Any) -> LMTask:
    """``options``: LMTask fields (device, weight_decay) for the simulator's diagnoses; the study uses none."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; one of {TASKS}")
    # the transformer sees shorter windows: a step costs about what a GRU step costs on one core
    return LMTask(name, **options) if name.startswith("charlm") else LMTask(name, seq=64, **options)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="save the corpus this machine's tasks read to a file")
    parser.add_argument("--save", required=True)
    args = parser.parse_args()
    train, valid, source = corpus()
    Path(args.save).write_bytes(bytes(torch.cat([train, valid]).to(torch.uint8).tolist()))
    print(f"saved {len(train) + len(valid)} bytes of {source} to {args.save}")
