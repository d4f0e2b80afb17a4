#!/usr/bin/env python
"""Screen gradient compressors on the language-model tasks quickly: P data-parallel workers simulated in one process.

Every worker's gradient is computed on its own batch from the same replica (what data-parallel training with
identical replicas computes), each worker compresses its own gradient with its own error-feedback residual, and the
average of what the workers sent is applied by the user's optimizer: the arithmetic of a P-worker Horovod job
without processes or collectives, so a method can be screened in a fraction of a real run's time. The real numbers
come from benchmarks/convergence.py (real Horovod workers, the real TopKEF); this script is for deciding what to
measure there.

    python benchmarks/compression_sim.py --task charlm --steps 400 --methods dense topk:0.01 block:16:2:1
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from lm_tasks import LMTask, make_task  # noqa: E402


# ---- compressors: (accumulated tensor) -> (sent tensor); the caller keeps acc - sent as the residual -------------
def topk(acc: torch.Tensor, ratio: float, value_bits: int) -> torch.Tensor:
    k = max(1, math.ceil(ratio * acc.numel()))
    idx = acc.abs().topk(k, sorted=False).indices
    sent = torch.zeros_like(acc)
    vals = acc[idx]
    sent[idx] = quantize(vals, value_bits)
    return sent


def quantize(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Values on the wire: 32 exact; 16 fp16; 1 sign x mean magnitude; else symmetric uniform with absmax scale."""
    if bits == 32 or values.numel() == 0:
        return values
    if bits == 16:  # clamped to float16's range: what does not fit stays in the residual, never an inf
        return values.clamp(-65504.0, 65504.0).half().float()
    if bits == 1:
        return values.sign() * values.abs().mean()
    if bits == 8:  # float8 e4m3 with a per-tensor scale that maps the largest magnitude to e4m3's largest (448)
        scale = values.abs().max() / 448.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all zero: any scale; no host sync on a GPU
        return (values / scale).to(torch.float8_e4m3fn).float() * scale
    levels = 2 ** (bits - 1) - 1  # e.g. 4 bits: symmetric uniform
    scale = values.abs().max() / levels
    if scale == 0:
        return values
    return torch.round(values / scale).clamp(-levels, levels) * scale


def block_topm(acc: torch.Tensor, block: int, m: int, value_bits: int) -> torch.Tensor:
    """Top-m magnitudes of every block of ``block`` consecutive entries (the tail padded)."""
    n = acc.numel()
    nb = -(-n // block)
    padded = acc.new_zeros(nb * block)
    padded[:n] = acc
    rows = padded.view(nb, block)
    idx = rows.abs().topk(m, dim=1, sorted=False).indices
    picked = rows.gather(1, idx)
    q = quantize(picked.reshape(-1), value_bits).view_as(picked)
    sent = torch.zeros_like(rows).scatter_(1, idx, q)
    return sent.view(-1)[:n]


def powersgd(accs: List[torch.Tensor], shape: torch.Size, rank: int, state: dict, key: int) -> torch.Tensor:
    """PowerSGD (Vogels et al. 2019), one power iteration with the previous Q warm-started: every worker's
    accumulator as a matrix M_w (rows = dim 0); P = mean_w M_w Q, orthonormalised; Q = mean_w M_w^T P; every worker
    applies P Q^T (the same for all) and keeps M_w - P Q^T. Two allreduces of r (n + m) numbers per matrix."""
    n = shape[0]
    m = accs[0].numel() // n
    r = min(rank, n, m)
    q = state.get(key)
    if q is None:
        q = torch.randn(m, r, generator=torch.Generator().manual_seed(key)).to(accs[0].device)
    mats = [a.view(n, m) for a in accs]
    p = sum(mw @ q for mw in mats) / len(mats)
    p, _ = torch.linalg.qr(p)
    q = sum(mw.t() @ p for mw in mats) / len(mats)
    state[key] = q
    return (p @ q.t()).reshape(-1)


def integer_sum(accs: List[torch.Tensor], key: int, state: dict, spread: float, bits: int,
                from_average: bool = False) -> Tuple[torch.Tensor, int]:
    """Every worker's accumulator rounded to an integer grid of step delta and summed as integers of BITS bits
    (a sum-allreduce of int8 for 8), in place: each worker's integers are clamped to +-L with
    L = (2^(BITS-1) - 1) // P so that the sum of P cannot overflow, delta = SPREAD x M / L, M being the workers'
    mean of their largest magnitude on the step before (one float per tensor and worker, which every worker holds
    after that step's exchange); what a worker's integers do not carry stays in its accumulator. A tensor's first
    step, or one whose M was 0, goes in float16 instead. ``from_average``: M is the largest magnitude of the average
    applied on the step before instead (no float to exchange). Returns (the applied average, bytes one worker hands
    over)."""
    workers = len(accs)
    limit = (2 ** (bits - 1) - 1) // workers
    if limit < 1:
        raise ValueError(f"{bits}-bit integers cannot hold the sum of {workers} workers")
    reference = state.get(key, 0.0)
    if not from_average:
        state[key] = sum(float(a.abs().max()) for a in accs) / workers
    if reference == 0.0:
        sent = [quantize(a, 16) for a in accs]
        nbytes = 2 * accs[0].numel() + 4
    else:
        delta = spread * reference / limit
        sent = [torch.round(a / delta).clamp(-limit, limit) * delta for a in accs]
        nbytes = bits * accs[0].numel() // 8 + 4
    for a, s_ in zip(accs, sent):
        a -= s_
    applied = sum(sent) / workers
    if from_average:
        state[key] = float(applied.abs().max())
    return applied, nbytes


def integer_sum_blocks(accs: List[torch.Tensor], key: int, state: dict, spread: float, bits: int, block: int,
                       floor: float) -> Tuple[torch.Tensor, int]:
    """integer_sum from the previous average, with a grid per block of ``block`` consecutive entries: each block's
    delta = SPREAD x M_b / L (each worker's values within +-SPREAD x M_b), M_b the block's largest magnitude in the
    average applied on the step before (every worker holds it: no bytes), at least ``floor`` x the tensor's
    largest, so that a block that was near zero still has a grid that reaches a tensor-sized value within a few
    steps. Why: most of a gradient's entries are far below its largest, and a per-tensor grid rounds them to zero
    step after step (they wait in the residual); a block's own grid would send them. Screened and not kept
    (docs/auto-density.md, "A grid per block"): a block's largest moves more between steps, so its grid clamps."""
    workers = len(accs)
    limit = (2 ** (bits - 1) - 1) // workers
    if limit < 1:
        raise ValueError(f"{bits}-bit integers cannot hold the sum of {workers} workers")
    numel = accs[0].numel()
    reference = state.get(key)
    if reference is None or float(reference.max()) == 0.0:
        sent = [quantize(a, 16) for a in accs]
        nbytes = 2 * numel + 4
    else:
        blocks = reference.clamp_min(floor * float(reference.max()))
        delta = (spread * blocks / limit).repeat_interleave(block)[:numel]
        sent = [torch.round(a / delta).clamp(-limit, limit) * delta for a in accs]
        nbytes = bits * numel // 8 + 4
    for a, s_ in zip(accs, sent):
        a -= s_
    applied = sum(sent) / workers
    pad = (-numel) % block
    padded = torch.nn.functional.pad(applied.abs(), (0, pad)) if pad else applied.abs()
    state[key] = padded.reshape(-1, block).amax(dim=1)
    return applied, nbytes


def cyclic(acc: torch.Tensor, period: int, ratio: float, step: List[int]) -> torch.Tensor:
    """Top-k (float8 values) plus, every step, every ``period``-th entry starting at step % period, in float8
    without indices (the slice is implied by the step): every coordinate reaches the optimizer at least once
    every ``period`` steps, however small its gradient."""
    sent = topk(acc, ratio, 8)
    rest = acc - sent
    offset = step[0] % period
    dense_slice = rest[offset::period]
    sent[offset::period] += quantize(dense_slice, 8)
    return sent


class Drip:
    """Receiver-side spreading, the same on every worker: what arrives for a coordinate goes into a buffer that is
    paid out at a constant rate over as many steps as the coordinate waited since its previous arrival (at most
    ``cap``). Adam divides by the root of the mean square of what it is given: a burst of L steps' gradient
    every L steps moves a coordinate ~sqrt(L) times the per-step amount where dense moves it L times; paid out
    at the coordinate's own rate, Adam sees ~the per-step gradient again. Nothing is lost: applied + buffer ==
    everything received."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buffers: Dict[int, torch.Tensor] = {}
        self.rates: Dict[int, torch.Tensor] = {}
        self.last: Dict[int, torch.Tensor] = {}

    def __call__(self, key: int, received: torch.Tensor, step: int) -> torch.Tensor:
        if key not in self.buffers:
            self.buffers[key] = torch.zeros_like(received)
            self.rates[key] = torch.zeros_like(received)
            self.last[key] = torch.zeros(received.numel(), dtype=torch.int64, device=received.device)
        buf, rate, last = self.buffers[key], self.rates[key], self.last[key]
        arrived = received != 0
        buf += received
        waited = (step - last[arrived]).clamp(1, self.cap).to(received.dtype)
        rate[arrived] = buf[arrived] / waited
        last[arrived] = step
        # pay out the rate, never more than what is left (the last payment empties the buffer)
        paid = torch.where(rate.abs() >= buf.abs(), buf, rate)
        buf -= paid
        rate[buf == 0] = 0
        return paid


def _rank_within_region(idx: torch.Tensor, magnitude: torch.Tensor, region: torch.Tensor, workers: int) -> torch.Tensor:
    """For each index, its place (0 = largest magnitude) among the indices of its own region: one sort by
    magnitude, a stable sort by region, no per-region loop (fewer launches and host waits on a GPU)."""
    by_size = torch.argsort(magnitude, descending=True, stable=True)
    by_region = by_size[torch.argsort(region[idx[by_size]], stable=True)]
    owners = region[idx[by_region]]
    counts = torch.bincount(owners, minlength=workers)
    place = torch.arange(idx.numel(), device=idx.device) - (torch.cumsum(counts, 0) - counts)[owners]
    out = torch.empty_like(place)
    out[by_region] = place
    return out


def sparse_allreduce(accs: List[torch.Tensor], ratio: float, keep_factor: float) -> Tuple[torch.Tensor, int]:
    """The sparse allreduce of core.exchange on P accumulators, in place: each worker's top-k, at most
    ``capacity`` per region owner (the hash split), each owner keeps the ceil(keep_factor * k / P) largest sums;
    every worker takes back into its accumulator only its entries that were applied. Returns the applied average
    and the bytes one worker hands to the two collectives (P capacity blocks and its kept sums, 8 bytes an entry,
    as SparseAllreduceLayouts.sent_nbytes; the other methods count what they hand over too)."""
    from horovod_topk.core.exchange import HASH_MULTIPLIER, capacity, kept_per_owner

    workers = len(accs)
    n = accs[0].numel()
    k = max(1, math.ceil(ratio * n))
    cap = capacity(k, workers, n)
    kept = min(n, math.ceil(keep_factor * kept_per_owner(k, workers)))
    region = ((torch.arange(n, dtype=torch.int64, device=accs[0].device) * HASH_MULTIPLIER) & 0xFFFFFFFF) * workers >> 32
    sums = accs[0].new_zeros(n)
    sent = []
    for a in accs:  # over capacity: the largest go, the rest wait in the residual
        idx = a.abs().topk(k, sorted=False).indices
        chosen = idx[_rank_within_region(idx, a[idx].abs(), region, workers) < cap]
        sums.index_add_(0, chosen, a[chosen])
        sent.append(chosen)
    applied_mask = torch.zeros(n, dtype=torch.bool, device=accs[0].device)
    summed = (sums != 0).nonzero().squeeze(1)  # each owner keeps its region's largest sums
    applied_mask[summed[_rank_within_region(summed, sums[summed].abs(), region, workers) < kept]] = True
    applied = torch.where(applied_mask, sums, sums.new_zeros(()))
    for a, chosen in zip(accs, sent):
        back = chosen[applied_mask[chosen]]
        a[back] = 0  # applied: leaves the residual
    return applied / workers, (workers * cap + kept) * 8


class LocalAdam:
    """Update mode: each worker steps its own Adam/AdamW (the task's hyperparameters and schedule, read from the
    task's optimizer every step) on its own gradient and hands over its update ``before - after``.

    VARIANT says where the second moment comes from: 'own' -- each worker's own (the user's optimizer stepped on each
    rank as is); 'oracle' -- one shared, from the square of the workers' averaged gradient (what dense Adam has; it
    would cost a dense allreduce); 'ranksq' -- one shared, from the workers' mean of their own squared gradients, per
    entry (a dense allreduce too: a diagnosis of 'mean of squares' against 'square of mean'); 'block:B' -- one
    shared value per block of B entries, from the workers' mean of their own squared gradients (an allreduce of
    numel / B floats: horovod_topk.torch.update_rule); two diagnoses of it: 'oblock:B' -- per block, from the square
    of the averaged gradient (is it the blocks or the mean of squares that costs?), 'rblock:B' -- 'block:B' times
    each tensor's ||mean_w g_w||^2 / mean_w ||g_w||^2 (would removing the workers' noise from it, per tensor, help?);
    'nown' -- each worker's own per-entry second moment, its squared gradient scaled by that same per-tensor share
    (exact here: the bound of what an estimate of the share from a few sampled coordinates could give; counted as
    one float per tensor and worker); 'sown:S' -- the same with the share estimated from S coordinates per tensor
    drawn afresh each step, the same on every worker (an allreduce of S + 1 floats per tensor); 'eown:S' -- 'sown:S'
    with the share's two sums averaged over steps (exponentially, 0.9) before their ratio is taken; 'kown:M' -- the
    share from a count sketch of M buckets per tensor (every coordinate hashed to a bucket with a random sign, the
    same on every worker): the sketch is linear, so the workers' mean sketch is the sketch of the mean gradient and
    ||sketch||^2 estimates ||mean g||^2 from every coordinate, not a sample (an allreduce of M floats per tensor).
    Two diagnoses of why an estimate loses what 'nown' gains: 'lown' -- the exact share of the step before (is it
    the share's correlation with this step's gradients that pays?), 'jown:PCT' -- the exact share times (1 + PCT%
    of an iid normal) (does an estimate's spread cost by itself?); 'cown:PCT' -- a constant PCT/100 in place of the
    share (is the gain only a larger step?); 'gown' -- one exact share for the whole model per step (would a single
    sketch of the whole gradient do?). Buildable around the user's optimizer: 'xown' -- each worker's own second
    moment as in 'own', its Adam step (not the decay) divided by sqrt of the tensor's exact share averaged over steps
    with Adam's beta2 (bias-corrected), the share clamped to [1/P, 1]; 'fown:M' -- the same with the share's
    numerator from a structured count sketch of M buckets per tensor (entry r * M + b in bucket b with row r's
    random sign; an allreduce of M + 1 floats per tensor); 'zown:M' -- that sketch's share scaling each worker's
    squared gradient inside its second moment, as 'kown:M' does with a hashed sketch (no index per entry to keep);
    'rown:M' -- 'zown:M' with the rows' signs drawn afresh each step; 'cal:M' -- what horovod-topk's
    second_moment="calibrated" computes (horovod_topk.torch.update_rule's sketch and clamped share, the signs from
    core.update_mode.sketch_salt): 'rown:M' with the share clamped to [1/P, 1]."""

    #: Variants in which each worker keeps its own second moment (the others share one).
    PER_WORKER = ("own", "nown", "sown", "eown", "kown", "lown", "jown", "cown", "gown", "xown", "fown", "zown", "rown",
                  "cal")
    #: Variants that keep each worker's own second moment and rescale its update by 1 / sqrt(the tensor's noise
    #: share, averaged over steps as Adam averages squares): buildable around the user's optimizer, unchanged.
    RESCALED = ("xown", "fown")
    #: Variants that scale each worker's own squared gradient by its tensor's noise share.
    SCALED = ("nown", "sown", "eown", "kown", "lown", "jown", "cown", "gown", "zown", "rown", "cal")

    def __init__(self, variant: str, opt: torch.optim.Optimizer, params: List[torch.Tensor], workers: int) -> None:
        from horovod_topk.torch import update_rule

        self.rule = update_rule
        kind, _, block = variant.partition(":")
        blocked = kind in ("block", "oblock", "rblock")
        sampled = kind in ("sown", "eown", "kown", "jown", "cown", "fown", "zown", "rown", "cal")
        if (kind not in self.PER_WORKER + ("oracle", "ranksq", "block", "oblock", "rblock")
                or (blocked or sampled) != bool(block)):
            raise ValueError(f"+update:{variant}: one of own, nown, lown, gown, sown:S, eown:S, kown:M, jown:PCT, "
                             f"cown:PCT, xown, fown:M, zown:M, rown:M, cal:M, oracle, "
                             f"ranksq, block:B, oblock:B, rblock:B")
        self.lagged: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.share_avg: Dict[int, torch.Tensor] = {}
        self.row_signs: Dict[int, torch.Tensor] = {}
        self.share_sums: Dict[int, List[torch.Tensor]] = {}
        self.sketches: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.kind = kind
        self.samples = int(block) if sampled else None
        self.sample_gen = torch.Generator().manual_seed(12345)
        block = block if blocked else ""
        self.block = int(block) if block else None
        self.decoupled = isinstance(opt, torch.optim.AdamW)
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError("+update: the task's optimizer must be Adam or AdamW")
        self.group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        self.params = params
        self.workers = workers
        self.m = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
        shared = workers if kind in self.PER_WORKER else 1
        self.v = [[torch.zeros(update_rule.block_count(p.numel(), self.block), device=p.device) if self.block
                   else torch.zeros_like(p) for p in params] for _ in range(shared)]

    def _share_sums(self, i: int, p: torch.Tensor, local: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(||mean_w g_w||^2, mean_w ||g_w||^2) of parameter ``i`` as the variant estimates them, and the floats each
        worker would send for it."""
        flat = [g.reshape(-1) for g in local]
        if self.kind == "cal":  # the product's own computation: the share comes back clamped, as a ratio over 1
            from horovod_topk.core.update_mode import sketch_salt

            contributions = torch.zeros(self.workers, self.samples + 1)
            for w, g in enumerate(flat):
                self.rule.sketch_into(contributions[w], g, sketch_salt(self.step, i))
            share = self.rule.noise_shares(contributions.sum(dim=0, keepdim=True), self.workers)[0]
            return share, torch.tensor(1.0), self.samples + 1
        if self.kind == "cown":  # a constant in place of the share: is it only a larger step?
            return torch.tensor(self.samples / 100.0), torch.tensor(1.0), 0
        if self.kind == "gown":  # the whole model's exact share, one number per step (computed once, at tensor 0)
            if i == 0:
                self.lagged[-1] = (sum(((sum(g) / self.workers).square().sum() for g in zip(*self.step_grads))),
                                   sum(sum(x.square().sum() for x in g) for g in zip(*self.step_grads)) / self.workers)
            return self.lagged[-1][0], self.lagged[-1][1], 1 if i == 0 else 0
        if self.kind in ("fown", "zown", "rown") and p.numel() > self.samples:
            # a structured count sketch: entry r * M + b goes to bucket b with the sign of row r (rows' signs random,
            # fixed per tensor): one matrix-vector product per worker, N / M signs of memory, unbiased for ||x||^2
            M = self.samples
            rows = -(-p.numel() // M)
            if i not in self.row_signs or self.kind == "rown":  # rown: drawn afresh each step
                self.row_signs[i] = (torch.randint(2, (rows,), generator=self.sample_gen) * 2 - 1).to(p)
            padded = [torch.nn.functional.pad(g, (0, rows * M - g.numel())).view(rows, M) for g in flat]
            sketch = sum(self.row_signs[i] @ g for g in padded) / self.workers
            return sketch.square().sum(), sum(g.square().sum() for g in flat) / self.workers, M + 1
        if self.kind in ("nown", "lown", "jown", "xown") or p.numel() <= self.samples:
            exact = (sum(flat) / self.workers).square().sum(), sum(g.square().sum() for g in flat) / self.workers
            if self.kind == "lown":  # last step's exact share: is it the share's correlation with this step that pays?
                exact, self.lagged[i] = self.lagged.get(i, exact), exact
            if self.kind == "jown":  # the exact share times (1 + PCT% iid normal noise): does an estimate's spread cost?
                noise = 1.0 + self.samples / 100.0 * torch.randn((), generator=self.sample_gen).item()
                exact = exact[0] * max(noise, 0.0), exact[1]
            return exact[0], exact[1], 1
        if self.kind == "kown":
            if i not in self.sketches:
                self.sketches[i] = (torch.randint(self.samples, (p.numel(),), generator=self.sample_gen).to(p.device),
                                    (torch.randint(2, (p.numel(),), generator=self.sample_gen) * 2 - 1).to(p))
            bucket, sign = self.sketches[i]
            sketch = sum(torch.zeros(self.samples, dtype=g.dtype, device=g.device).index_add_(0, bucket, g * sign)
                         for g in flat) / self.workers
            own = sum(g.square().sum() for g in flat) / self.workers  # each worker's own norm: exact locally
            return sketch.square().sum(), own, self.samples + 1
        at = torch.randint(p.numel(), (self.samples,), generator=self.sample_gen).to(p.device)
        seen = [g[at] for g in flat]
        return (sum(seen) / self.workers).square().sum(), sum(g.square().sum() for g in seen) / self.workers, \
            self.samples + 1

    def updates(self, grads: List[List[torch.Tensor]], step: int) -> Tuple[List[List[torch.Tensor]], float]:
        """Each worker's update per parameter (flat), and the bytes the workers hand over for the shared second
        moment (counted as dense tensors are: what every worker hands to its collective)."""
        out: List[List[torch.Tensor]] = [[] for _ in range(self.workers)]
        nbytes = 0.0
        self.step_grads = grads
        self.step = step
        for i, p in enumerate(self.params):
            group = self.group_of[id(p)]
            beta1, beta2 = group["betas"]
            local = [g[i].view_as(p) for g in grads]
            if self.kind == "own":
                for w in range(self.workers):
                    self.rule.update_second_moment(self.v[w][i], local[w].square(), beta2)
            elif self.kind in self.RESCALED:
                sq_mean, mean_sq, floats = self._share_sums(i, p, local)
                share = (sq_mean / mean_sq.clamp_min(1e-30)).clamp(1.0 / self.workers, 1.0)
                avg = self.share_avg.setdefault(i, torch.zeros(()))
                avg.mul_(beta2).add_(share, alpha=1.0 - beta2)
                for w in range(self.workers):
                    self.rule.update_second_moment(self.v[w][i], local[w].square(), beta2)
                nbytes += 4.0 * self.workers * floats
            elif self.kind in self.SCALED:
                sq_mean, mean_sq, floats = self._share_sums(i, p, local)
                if self.kind == "eown":
                    sums = self.share_sums.setdefault(i, [sq_mean, mean_sq])
                    sums[0] = 0.9 * sums[0] + 0.1 * sq_mean
                    sums[1] = 0.9 * sums[1] + 0.1 * mean_sq
                    sq_mean, mean_sq = sums
                share = sq_mean / mean_sq.clamp_min(1e-30)
                for w in range(self.workers):
                    self.rule.update_second_moment(self.v[w][i], local[w].square() * share, beta2)
                nbytes += 4.0 * self.workers * floats
            else:
                if self.kind == "oracle":
                    signal = (sum(local) / self.workers).square()
                elif self.kind == "ranksq":
                    signal = sum(g.square() for g in local) / self.workers
                elif self.kind == "oblock":
                    signal = self.rule.block_mean_squares(sum(local) / self.workers, self.block)
                else:
                    signal = sum(self.rule.block_mean_squares(g, self.block) for g in local) / self.workers
                    if self.kind == "rblock":
                        mean_sq = sum(g.square().sum() for g in local) / self.workers
                        signal = signal * ((sum(local) / self.workers).square().sum() / mean_sq.clamp_min(1e-30))
                self.rule.update_second_moment(self.v[0][i], signal, beta2)
                nbytes += 4.0 * signal.numel() * self.workers
            rescale = self.kind in self.RESCALED
            for w in range(self.workers):
                u = self.rule.adam_update(
                    p.detach(), local[w], self.m[w][i], self.v[w if self.kind in self.PER_WORKER else 0][i], step,
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=0.0 if rescale and self.decoupled else group["weight_decay"],
                    decoupled=self.decoupled, block=self.block,
                )
                if rescale:  # Adam's step over sqrt(share): what it would be with the averaged gradient's squares
                    u.mul_((self.share_avg[i] / (1.0 - beta2**step)).rsqrt())
                    if self.decoupled and group["weight_decay"]:
                        u.add_(p.detach(), alpha=group["lr"] * group["weight_decay"])
                out[w].append(u.reshape(-1))
        return out, nbytes


def make_method(spec: str) -> Dict[str, object]:
    """'dense' | 'topk:RATIO[:VALUEBITS[:INDEXBITS]]' | 'block:B:M:VALUEBITS' | 'sign' | 'isum:SPREAD[:BITS]' |
    'iblock:SPREAD:BLOCK[:FLOOR[:BITS]]'; bytes per entry/coordinate too."""
    parts = spec.split(":")
    kind = parts[0]
    if kind == "dense":
        return {"fn": None, "bytes_per_coord": 4.0}
    if kind == "topk":
        ratio = float(parts[1])
        vbits = int(parts[2]) if len(parts) > 2 else 32
        ibits = int(parts[3]) if len(parts) > 3 else 32  # 16: sorted indices sent as 16-bit gaps
        scale = [1.0]  # the byte schedule's factor of this step (run() sets it)
        return {"fn": lambda a: topk(a, ratio * scale[0], vbits), "bytes_per_coord": ratio * (ibits + vbits) / 8,
                "scale": scale}
    if kind == "block":
        block, m, vbits = int(parts[1]), int(parts[2]), int(parts[3])
        idx_bits = max(1, math.ceil(math.log2(block))) if m < block else 0
        return {"fn": lambda a: block_topm(a, block, m, vbits), "bytes_per_coord": m / block * (idx_bits + vbits) / 8}
    if kind == "powersgd":
        # rank chosen per matrix so that r (n + m) ~= FRACTION * n m: equal bytes to other methods
        fraction = float(parts[1])
        state: dict = {}

        def joint(accs, shape, key):
            n = shape[0]
            m = accs[0].numel() // n
            rank = max(1, round(fraction * n * m / (n + m)))
            return powersgd(accs, shape, rank, state, key), 4 * min(rank, n, m) * (n + m)
        return {"joint": joint}
    if kind == "cyclic":
        period, ratio = int(parts[1]), float(parts[2])
        counter = [0]
        return {"fn": lambda a: cyclic(a, period, ratio, counter), "bytes_per_coord": ratio * 3 + 1 / period,
                "counter": counter}
    if kind == "sar":  # 'sar:RATIO[:KEEP]': the sparse allreduce, owners keeping KEEP x ceil(k / P) sums
        ratio = float(parts[1])
        keep = float(parts[2]) if len(parts) > 2 else 1.0
        return {"inplace": lambda accs: sparse_allreduce(accs, ratio, keep)}
    if kind == "sign":
        return {"fn": lambda a: quantize(a, 1), "bytes_per_coord": 1 / 8}
    if kind in ("isum", "isumavg"):  # 'isum:SPREAD[:BITS]': an integer sum-allreduce with a shared scale (integer_sum)
        spread = float(parts[1])
        bits = int(parts[2]) if len(parts) > 2 else 8
        isum_state: dict = {}
        return {"inplace": lambda accs, key: integer_sum(accs, key, isum_state, spread, bits, kind == "isumavg"),
                "keyed": True}
    if kind == "iblock":  # 'iblock:SPREAD:BLOCK[:FLOOR[:BITS]]': integer_sum_blocks
        spread, block = float(parts[1]), int(parts[2])
        floor = float(parts[3]) if len(parts) > 3 else 1 / 64
        bits = int(parts[4]) if len(parts) > 4 else 8
        iblock_state: dict = {}
        return {"inplace": lambda accs, key: integer_sum_blocks(accs, key, iblock_state, spread, bits, block, floor),
                "keyed": True}
    raise ValueError(f"unknown method {spec!r}")


class Diagnosis:
    """Per compressed tensor: which coordinates reached the applied update and how long they waited, and how large
    the residuals are against what is applied -- the numbers that say where Top-K starves a model."""

    def __init__(self) -> None:
        self.last: Dict[int, torch.Tensor] = {}
        self.intervals: Dict[int, List[torch.Tensor]] = {}
        self.ratios: Dict[int, List[float]] = {}

    def record(self, key: int, applied: torch.Tensor, residuals: List[torch.Tensor], step: int) -> None:
        last = self.last.setdefault(key, torch.zeros(applied.numel(), dtype=torch.int32, device=applied.device))
        hit = applied != 0
        self.intervals.setdefault(key, []).append((step - last[hit]).to(torch.int32))
        last[hit] = step
        norm = applied.norm().item()
        mean_residual = sum(r.norm().item() for r in residuals) / len(residuals)
        self.ratios.setdefault(key, []).append(mean_residual / norm if norm > 0 else float("inf"))

    def summary(self, names: List[str], steps: int) -> List[dict]:
        rows = []
        for key, last in self.last.items():
            waits = torch.cat(self.intervals[key]).float()
            tail = self.ratios[key][-max(1, len(self.ratios[key]) // 10):]
            never = (last == 0)
            stale = (steps - last[~never]).float()
            rows.append({
                "tensor": names[key], "numel": last.numel(),
                "ever_applied": 1.0 - never.float().mean().item(),
                # steps between two arrivals of a coordinate (the first arrival counts from step 0)
                "wait_median": waits.median().item(), "wait_max": waits.max().item(),
                # torch.quantile takes at most 2**24 values: an evenly strided subset of the rest
                "wait_p90": waits[::max(1, -(-waits.numel() // 2**24))].quantile(0.9).item(),
                "stale_at_end_median": stale.median().item() if stale.numel() else float("nan"),
                "residual_over_applied": sum(tail) / len(tail),
            })
        return rows


def run(task: LMTask, spec: str, seed: int, steps: int, workers: int, min_numel: int = 1024,
        diagnose: bool = False, overrun: float = 1.0) -> dict:
    """One simulated run. ``spec`` is a method (make_method), then optionally, in this order, '+flush:T:BITS',
    '+drip:CAP', '+sched:F:H', '@dense=a,b' and '@boost=NAME:F'. '@dense=a,b': parameters
    whose names contain a or b go dense (a diagnosis of which tensors the compression hurts). ``diagnose``:
    per-tensor numbers (Diagnosis) in the result's "diagnosis". ``overrun``: go on to ``overrun x steps`` with the
    schedule's last rate, as benchmarks/convergence.py runs compressed methods, so that steps to dense's target can be
    read past a schedule that ends at the budget; "final" stays the loss at ``steps``."""
    spec_head, _, boost = spec.partition("@boost=")
    method_spec, _, extra = spec_head.partition("@dense=")
    # '+late' (after '+update:VARIANT'): the averaged update of step t is applied after step t + 1's backward, so
    # that its exchange could travel during that step's forward and backward (one step of staleness)
    method_spec, late, _ = method_spec.partition("+late")
    # '+update:VARIANT' (last of the other '+' suffixes): update mode; each worker's Adam update is what is compressed
    method_spec, _, update_variant = method_spec.partition("+update:")
    if late and not update_variant:
        raise ValueError(f"{spec!r}: +late applies update mode's averaged update a step late; it needs +update:")
    method_spec, _, byte_sched = method_spec.partition("+sched:")
    method_spec, _, drip_cap = method_spec.partition("+drip:")
    method_spec, _, flush = method_spec.partition("+flush:")
    method = make_method(method_spec)
    # '+flush:T:BITS': every T-th step each worker also sends its whole residual (after this step's selection) dense,
    # its values in BITS (quantize); what the quantization loses stays in the residual: bounded staleness, no index
    # bytes, numel * BITS / 8 bytes every T steps
    flush_every, flush_bits = (int(x) for x in flush.split(":")) if flush else (0, 32)
    if flush and ("fn" not in method or method["fn"] is None):
        raise ValueError(f"{spec!r}: +flush works with the per-worker compressors (topk, block, cyclic, sign)")
    # '+sched:F:H': the first fraction F of the steps send H times the entries, the rest fewer, the same bytes in all
    front, high = (float(x) for x in byte_sched.split(":")) if byte_sched else (0.0, 1.0)
    low = (1.0 - front * high) / (1.0 - front) if byte_sched else 1.0
    if byte_sched and low <= 0:
        raise ValueError(f"schedule {byte_sched!r} spends more than the budget in its first part")
    drip = Drip(int(drip_cap)) if drip_cap else None
    diagnosis = Diagnosis() if diagnose else None
    dense_names = [x for x in extra.split(",") if x]
    model, opt, sched = task.build(seed, steps)
    names = [n for n, _ in model.named_parameters()]
    params = [p for p in model.parameters()]
    # '@boost=NAME:F': tensors whose names contain NAME send F times their share of entries, the other compressed
    # tensors proportionally fewer, so that the model's entries per step (hence its bytes) stay the same
    factors = [1.0] * len(params)
    if boost:
        boosted_name, factor = boost.split(":")
        compressed = [i for i, p in enumerate(params) if p.numel() >= min_numel]
        hit = [i for i in compressed if boosted_name in names[i]]
        hit_numel = sum(params[i].numel() for i in hit)
        rest_numel = sum(params[i].numel() for i in compressed if i not in hit)
        low_factor = (hit_numel + rest_numel - float(factor) * hit_numel) / rest_numel
        if not hit or low_factor <= 0:
            raise ValueError(f"boost {boost!r}: no tensor named so, or more than the whole budget")
        for i in compressed:
            factors[i] = float(factor) if i in hit else low_factor
    residuals = [[p.new_zeros(p.numel()) for p in params] for _ in range(workers)]
    in_flight: List[torch.Tensor] = []  # '+late': the averaged update still travelling
    local_adam = LocalAdam(update_variant, opt, params, workers) if update_variant else None
    gens = [torch.Generator().manual_seed(seed * 100 + w) for w in range(workers)]
    bytes_sent = 0.0
    bytes_dense = 0.0
    curve: List[float] = []
    evals: List[int] = []
    flushed: List[float] = []  # update mode: the loss had every worker's residual been delivered (a dense allreduce)
    start = time.perf_counter()
    total = max(steps, int(overrun * steps))
    for step in range(1, total + 1):
        step_scale = high if step <= front * steps else low
        grads = []
        for w in range(workers):
            model.zero_grad(set_to_none=True)
            task.loss(model, task.batch(gens[w])).backward()
            grads.append([p.grad.reshape(-1).clone() for p in params])
        if local_adam is not None:  # what travels is each worker's own optimizer update, not its gradient
            grads, signal_bytes = local_adam.updates(grads, step)
            bytes_sent += signal_bytes
        for i, p in enumerate(params):
            numel = p.numel()
            bytes_dense += 4 * numel * workers
            forced_dense = any(d in names[i] for d in dense_names)
            if ("joint" not in method and "inplace" not in method and method["fn"] is None or numel < min_numel
                    or forced_dense):
                p.grad = (sum(g[i] for g in grads) / workers).view_as(p)
                bytes_sent += 4 * numel * workers
                if diagnosis is not None and numel >= min_numel:  # dense's own numbers, to compare with
                    diagnosis.record(i, p.grad.reshape(-1), [p.new_zeros(1)], step)
                continue
            accs = [residuals[w][i].add_(grads[w][i]) for w in range(workers)]
            if "inplace" in method:
                applied, nbytes = method["inplace"](accs, i) if method.get("keyed") else method["inplace"](accs)
                bytes_sent += nbytes * workers
            elif "joint" in method:
                applied, nbytes = method["joint"](accs, p.shape, i)
                for a in accs:
                    a -= applied
                bytes_sent += nbytes * workers
            else:
                if "scale" in method:
                    method["scale"][0] = step_scale * factors[i]
                sent = [method["fn"](a) for a in accs]
                if flush_every and step % flush_every == 0:
                    sent = [s_ + quantize(a - s_, flush_bits) for a, s_ in zip(accs, sent)]
                    bytes_sent += flush_bits / 8 * numel * workers
                for a, s_ in zip(accs, sent):
                    a -= s_
                applied = sum(sent) / workers
                bytes_sent += method["bytes_per_coord"] * method.get("scale", [1.0])[0] * numel * workers
            if drip is not None:
                applied = drip(i, applied, step)
            if diagnosis is not None:
                diagnosis.record(i, applied, [residuals[w][i] for w in range(workers)], step)
            p.grad = applied.view_as(p)
        if "counter" in method:
            method["counter"][0] += 1
        if local_adam is None:
            opt.step()
        else:  # the averaged applied update, the same on every worker
            with torch.no_grad():
                arrived = in_flight if late else [p.grad for p in params]
                if late:
                    in_flight = [p.grad.clone() for p in params]
                for p, update in zip(params, arrived):
                    p.sub_(update)
        if sched is not None and step < steps:  # past the budget the rate stays at the schedule's last
            sched.step()
        if step % task.eval_every == 0 or step in (steps, total):
            curve.append(task.validate(model))
            evals.append(step)
            if local_adam is not None:
                flushed.append(validate_flushed(task, model, params, residuals, workers))
    result = {"method": spec, "seed": seed, "steps": steps, "evals": evals, "valid": curve,
              "final": curve[evals.index(steps)],
              "bytes_fraction": bytes_sent / bytes_dense, "seconds": time.perf_counter() - start,
              "corpus": task.source, "device": task.device, "torch": torch.__version__,
              # CPU kernels of another kind (AVX2 / AVX512) may round differently, and over thousands of steps a
              # rounding moves a final loss: compare runs of one kind to the last digit
              "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if flushed:
        result["valid_flushed"] = flushed
        result["final_flushed"] = flushed[evals.index(steps)]
    if diagnosis is not None:
        result["diagnosis"] = diagnosis.summary(names, steps)
    return result


def validate_flushed(task: LMTask, model: torch.nn.Module, params: List[torch.Tensor],
                     residuals: List[List[torch.Tensor]], workers: int) -> float:
    """Update mode: the validation loss of the parameters minus the workers' mean residual, i.e. had one dense
    allreduce delivered every update still held back. The parameters are restored bit for bit (copied back, not
    added back) so that the run itself is unchanged."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for i, p in enumerate(params):
            p.sub_((sum(r[i] for r in residuals) / workers).view_as(p))
        loss = task.validate(model)
        for p, s in zip(params, saved):
            p.copy_(s)
    return loss


def steps_to(result: dict, target: float) -> Optional[int]:
    """The first evaluated step whose validation loss is at most ``target`` (None: not within the run)."""
    return next((step for step, loss in zip(result["evals"], result["valid"]) if loss <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--methods", nargs="+", default=["dense", "topk:0.01"])
    parser.add_argument("--out", default=str(ROOT / "results" / "sim"))
    parser.add_argument("--device", default="cpu", help="cuda: the same arithmetic on a GPU (many screens at once)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="gptlm's AdamW weight decay instead of 0.1 (a diagnosis: does decay interact with Top-K?)")
    parser.add_argument("--lr-scale", type=float, default=None,
                        help="the task's learning rate times this (a diagnosis: is a method's gain a larger step?)")
    parser.add_argument("--diagnose", action="store_true",
                        help="per compressed tensor: share of coordinates ever applied, steps between arrivals, "
                             "staleness at the end, residual norm / applied norm")
    parser.add_argument("--min-numel", type=int, default=1024,
                        help="tensors smaller than this go dense and exact (0: every tensor through the method, as "
                             "ratio=\"auto\"'s fp16 and int8 send them)")
    parser.add_argument("--overrun", type=float, default=1.0,
                        help="run this many times --steps (the schedule's last rate past --steps) and print the steps "
                             "to 1.01x the final loss of dense's run of the same seed in --out, where there is one")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # update mode steps its own Adam: the task's optimizer only carries the schedule's rates, never steps
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as on the CPU
    torch.backends.cudnn.allow_tf32 = False
    options = {"device": args.device}
    if args.weight_decay is not None:
        options["weight_decay"] = args.weight_decay
    if args.lr_scale is not None:
        options["lr_scale"] = args.lr_scale
    task = make_task(args.task, **options)
    tag = "" if args.weight_decay is None else f"-wd{args.weight_decay:g}"
    tag += "" if args.lr_scale is None else f"-lr{args.lr_scale:g}"
    tag += "" if args.device == "cpu" else f"-{args.device.split(':')[0]}"  # results of another device apart
    tag += "" if args.min_numel == 1024 else f"-mn{args.min_numel}"
    overrun = "" if args.overrun == 1.0 else f"-x{args.overrun:g}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in args.methods:
        for seed in args.seeds:
            diag = "-diag" if args.diagnose else ""
            name = f"{args.task}{tag}-{args.steps}-{spec.replace(':', '_')}-{seed}{diag}"
            path = out / f"{name}{overrun}-p{args.workers}.json"
            if path.exists():
                r = json.loads(path.read_text())
            else:
                r = run(task, spec, seed, args.steps, args.workers, min_numel=args.min_numel, diagnose=args.diagnose,
                        overrun=args.overrun)
                path.write_text(json.dumps(r))
            print(f"{args.task}{tag} {args.steps} {spec:<22} seed {seed}: valid {r['final']:.4f}  bytes "
                  f"{100 * r['bytes_fraction']:.2f}% of dense  ({r['seconds']:.0f} s)", flush=True)
            if "final_flushed" in r:
                print(f"    with the residuals delivered (one dense allreduce more): valid {r['final_flushed']:.4f}",
                      flush=True)
            dense_path = out / f"{args.task}{tag}-{args.steps}-dense-{seed}-p{args.workers}.json"
            if overrun and dense_path.exists():
                dense = json.loads(dense_path.read_text())
                if "cpu_capability" not in dense:
                    print("    dense's result does not record its CPU kernels: compare only if it ran on this machine",
                          flush=True)
                elif dense["cpu_capability"] != r.get("cpu_capability"):
                    print(f"    dense ran with CPU kernels {dense.get('cpu_capability')}, this run with "
                          f"{r.get('cpu_capability')}: not comparable to the last digit", flush=True)
                print(f"    steps to 1.01x dense's final loss: {steps_to(r, 1.01 * dense['final'])}, dense's own: "
                      f"{steps_to(dense, 1.01 * dense['final'])}", flush=True)
            for d in r.get("diagnosis", []):
                print(f"    {d['tensor']:<28} {d['numel']:>8}  ever applied {100 * d['ever_applied']:5.1f}%  "
                      f"steps between arrivals: median {d['wait_median']:.0f}, p90 {d['wait_p90']:.0f}, "
                      f"max {d['wait_max']:.0f}  stale at end (median) {d['stale_at_end_median']:.0f}  "
                      f"residual/applied {d['residual_over_applied']:.1f}", flush=True)


if __name__ == "__main__":
    main()
