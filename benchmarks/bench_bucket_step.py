#!/usr/bin/env python
"""What TopKEF adds to a training step through the DDP hook, per bucket: a real backward pass over a model of the
given layer shapes, in one process (torch.distributed with world size 1: Gloo on the CPU, NCCL on a GPU), so the
collectives cost next to nothing and the difference to DDP's own allreduce is the compression's work.

    python benchmarks/bench_bucket_step.py                                   # CPU: ResNet-50 and GPT-2 small shapes
    python benchmarks/bench_bucket_step.py --device cuda --repeat 50        # GPU: grouped against member by member
    python benchmarks/bench_bucket_step.py --host-only --models resnet50-25.6M  # the GPU path's host work, on a CPU

Each step: a loss whose backward pass produces every parameter's gradient (sum of parameter x fixed random
tensor: autograd, DDP's hooks and buckets as in training, with compute that stays small next to the
compression's), then DDP's reduction; with ``--real-batch B`` a real network of that size instead (torchvision's
ResNet-50, or a GPT-2-small-sized decoder from torch.nn) on one fixed batch, forward included, so that backward's
compute can hide what the hook overlaps. Timed: ``loss.backward()`` to the end of DDP's reduction (on a GPU, with
``torch.cuda.synchronize()`` after it), median of ``--repeat`` steps after 3 warm-up steps. Methods, interleaved
step by step so that the machine's noise hits them alike:
``dense`` (DDP's allreduce), ``topk`` (TopKEFState at --ratio, as a user gets it: on a GPU the bucket's allgather
members selected by one run of the grouped kernels, torch.bucket_select, recorded once as a CUDA graph and replayed,
torch.group_graphs), ``topk-eager`` (the same without graphs: HOROVOD_TOPK_CUDA_GRAPHS=0), ``topk-graphs`` (graphs
asked for explicitly, HOROVOD_TOPK_CUDA_GRAPHS=1: on a GPU the same as ``topk``), ``topk-alone`` (each member
selected on its own, no graphs; on the CPU the same as ``topk``: the fused kernel runs per member there),
``topk-bucket-graphs`` (a steady bucket's whole step, its NCCL collectives included, one graph replayed on a side
stream: HOROVOD_TOPK_CUDA_GRAPHS=bucket, torch.bucket_graph; GPU only).
On request ``auto`` (ratio="auto": with one worker nothing travels, so it stays dense after its first decision at
step 12; what its clock, probes and dense path add to DDP's step), ``fp16-hook`` (torch's own
``fp16_compress_hook``) and ``auto-fp16`` (ratio="auto" held at its fp16 choice: the same float16 allreduce with
the rounding fed back into each tensor's residual, torch.half_route). One elementwise pass (``r.add_(g)`` over every
gradient) is timed in the same steps, as the unit the CPU numbers are given in.
"""
from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_compress import MODELS  # noqa: E402  (the same real layer shapes)

from horovod_topk.core.autodensity import HALF  # noqa: E402
from horovod_topk.torch import bucket_select, group_graphs  # noqa: E402
from horovod_topk.torch.ddp import TopKEFState, topk_ef_hook  # noqa: E402

#: HOROVOD_TOPK_CUDA_GRAPHS per method; the rest run with it unset, as a user's job does.
GRAPHS = {"topk-eager": "0", "topk-alone": "0", "topk-graphs": "1", "topk-bucket-graphs": "bucket"}
METHODS = ["dense", "topk", "topk-eager", "topk-alone", "topk-graphs", "topk-bucket-graphs"]
#: What a GPU run times when no --methods are given (topk-graphs is topk there).
GPU_METHODS = ["dense", "topk-eager", "topk", "topk-alone", "topk-bucket-graphs"]


class Shapes(torch.nn.Module):
    """Parameters of the given shapes; ``forward`` makes a scalar whose gradient is a fixed tensor per parameter."""

    def __init__(self, shapes: List[tuple], device: torch.device) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=gen).to(device) * 0.01) for s in shapes])
        self.directions = [torch.randn(s, generator=gen).to(device) for s in shapes]

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        # one tensor input: DDP on CUDA moves its inputs to the device and cannot be called without one
        return scale * sum((w * d).sum() for w, d in zip(self.weights, self.directions))


class GPTSmall(torch.nn.Module):
    """A GPT-2-small-sized decoder from torch.nn alone (12 pre-norm layers, width 768, 12 heads, vocabulary 50,257,
    tied head: 124M parameters), so that the real-model step needs no package beyond torch."""

    def __init__(self, layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(context, width)
        block = torch.nn.TransformerEncoderLayer(width, width // 64, 4 * width, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        steps = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(steps, device=ids.device)
        x = self.tokens(ids) + self.positions(torch.arange(steps, device=ids.device))
        x = self.norm(self.blocks(x, mask=mask, is_causal=True))
        return torch.nn.functional.cross_entropy((x @ self.tokens.weight.t()).flatten(0, 1),
                                                 ids.roll(-1, 1).flatten())


def real_model(name: str, device: torch.device, batch: int) -> tuple:
    """A real network of the named size with one fixed batch: ``(module, inputs, loss_of_output)``. ResNet-50 needs
    torchvision (present on the GPU image); the GPT-2-small stand-in is torch.nn alone."""
    torch.manual_seed(0)
    if name.startswith("resnet50"):
        import torchvision
        module = torchvision.models.resnet50().to(device)
        images = torch.randn(batch, 3, 224, 224, device=device)
        labels = torch.randint(0, 1000, (batch,), device=device)
        return module, (images,), lambda out: torch.nn.functional.cross_entropy(out, labels)
    if name.startswith("gpt2"):
        module = GPTSmall().to(device)
        ids = torch.randint(0, 50257, (batch, 256), device=device)
        return module, (ids,), lambda out: out
    raise ValueError(f"no real model for {name!r}: use resnet50-25.6M or gpt2-small-124M")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model_name: str, device: torch.device, ratio: float, repeat: int, methods: List[str],
            real_batch: int = 0, profile: int = 0) -> Dict[str, float]:
    models: Dict[str, DDP] = {}
    hook_ms: Dict[str, List[float]] = {}
    states: Dict[str, TopKEFState] = {}
    inputs: Dict[str, tuple] = {}
    for method in methods:
        if real_batch:
            module, batch, loss_of = real_model(model_name, device, real_batch)
        else:
            module = Shapes(MODELS[model_name](), device)
            batch, loss_of = (torch.ones((), device=device),), (lambda out: out)
        ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
        if method == "fp16-hook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
            ddp.register_comm_hook(None, fp16_compress_hook)
        elif method != "dense":
            states[method] = TopKEFState(ratio="auto" if method.startswith("auto") else ratio,
                                         named_parameters=module.named_parameters())
            if method == "auto-fp16":  # held at fp16: no decision ever due
                states[method].auto.half, states[method].auto.ratio = True, HALF
                states[method].auto.next_decision = 1 << 62
            ddp.register_comm_hook(states[method], timed_hook(hook_ms.setdefault(method, [])))
        models[method] = ddp
        inputs[method] = (batch, loss_of)
    shapes = [tuple(p.shape) for p in next(iter(models.values())).module.parameters()]
    residuals = [torch.zeros(s, device=device) for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    groupable = bucket_select.groupable
    times: Dict[str, List[float]] = {m: [] for m in methods + ["elementwise"]}

    def elementwise() -> None:
        for r, g in zip(residuals, grads):
            r.add_(g)

    runs: Dict[str, Callable[[], None]] = {"elementwise": elementwise}
    for method, ddp in models.items():
        def step(ddp: DDP = ddp, alone: bool = method == "topk-alone", batch: tuple = inputs[method][0],
                 loss_of: Callable = inputs[method][1],
                 graphs: str = GRAPHS.get(method, "")) -> None:
            bucket_select.groupable = (lambda *args: False) if alone else groupable
            os.environ[group_graphs.ENV] = graphs
            try:
                ddp.zero_grad(set_to_none=False)
                loss_of(ddp(*batch)).backward()
            finally:
                bucket_select.groupable = groupable
        runs[method] = step
    hook_per_step: Dict[str, List[float]] = {m: [] for m in hook_ms}
    for i in range(3 + repeat):
        for name, fn in runs.items():
            if name in hook_ms:
                hook_ms[name].clear()
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if i >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
                if name in hook_ms:
                    hook_per_step[name].append(sum(hook_ms[name]))
    result = {name: statistics.median(values) for name, values in times.items()}
    graphed = [m for m in ("topk-graphs", "topk") if m in states and device.type == "cuda"]
    if graphed:  # the graphs did replay (recording failed nowhere)
        result["replayed_by"] = graphed[0]
        result["replays"] = states[graphed[0]]._group_selection().replays()
        result["finish_replays"] = states[graphed[0]]._group_selection().finish_replays()
    if "topk-bucket-graphs" in states:
        result["whole_replays"] = whole_replays(states["topk-bucket-graphs"])
    for method, per_step in hook_per_step.items():  # the host's time inside the hook (planning, selection, launches)
        result[f"hook:{method}"] = statistics.median(per_step)
    profiled = [m for m in ("topk-bucket-graphs", "topk-graphs", "topk") if m in states]
    if profile and profiled:
        host_profile(runs[profiled[0]], profiled[0], device, profile)
    if device.type == "cuda":
        for method in methods:
            result[f"syncs:{method}"] = host_syncs(runs[method], device)
    return result


def whole_replays(state: TopKEFState) -> int:
    """How many whole bucket steps the state's current steady buckets replayed as CUDA graphs (torch.bucket_graph)."""
    slots = [entry[5] for entry in state._layouts.values()]
    wholes = [slot["steady"].whole for slot in slots if slot.get("steady") is not None]
    return sum(w.graphs.replays for w in wholes if w is not None)


def timed_hook(calls: List[float]) -> Callable:
    """topk_ef_hook, with the host's time inside each call appended to ``calls`` (ms): on a GPU the hook runs in
    autograd's device thread between backward's launches, so its host time is what a step can lose."""
    @functools.wraps(topk_ef_hook)  # DDP checks the hook's annotations
    def hook(state, bucket):
        start = time.perf_counter()
        profiler = HOOK_PROFILER[0]
        if profiler is not None:  # cProfile sees one thread: the hook's own (autograd's device thread on a GPU)
            profiler.enable()
        try:
            return topk_ef_hook(state, bucket)
        finally:
            if profiler is not None:
                profiler.disable()
            calls.append((time.perf_counter() - start) * 1e3)
    return hook


HOOK_PROFILER: List[object] = [None]  # the cProfile.Profile that timed_hook runs under while --profile records


def host_profile(step: Callable[[], None], method: str, device: torch.device, steps: int) -> None:
    """Where the hook's host time goes in ``steps`` steps of ``method`` (cProfile, enabled inside the hook, since on
    a GPU autograd runs it on a device thread that a profiler of the main thread never sees): the step is bound by
    what the host does between launches, so this is the list of what to make cheaper."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    _sync(device)
    HOOK_PROFILER[0] = profiler
    try:
        for _ in range(steps):
            step()
        _sync(device)
    finally:
        HOOK_PROFILER[0] = None
    stats = pstats.Stats(profiler)
    for order in ("tottime", "cumulative"):
        print(f"# host profile of the hook in {steps} {method} steps, by {order}:")
        stats.sort_stats(order).print_stats(32)


def host_syncs(step: Callable[[], None], device: torch.device) -> int:
    """How many times one whole step (backward, DDP's hooks, the reduction) made the host wait for the GPU, counted
    by torch's sync debug mode ("warn": one warning per synchronising call) -- the training step's own check, next
    to the unit tests' check of the grouped selection alone."""
    import warnings
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    for w in syncs[:3]:
        print(f"#   host sync: {str(w.message)[:160]} ({w.filename}:{w.lineno})")
    return len(syncs)


def _kernels_as_no_ops() -> None:
    """Every tensor takes the Triton backend, whose kernels return an all-zero payload and add nothing back: what
    is left of a step is the host's own work on the GPU path (planning, bookkeeping, the collective's launch)."""
    from horovod_topk.torch import selection, state, triton_select

    class Delegating(type):
        def __getattr__(cls, name: str) -> object:
            return getattr(triton_select, name)

    class NoOpKernels(metaclass=Delegating):
        GroupLayout = triton_select.GroupLayout

        @staticmethod
        def supports(*args: object) -> bool:
            return True

        @staticmethod
        def compensate_and_select(grad, residual, group, wire_dtype):
            return (torch.zeros(group.nbytes, dtype=torch.uint8, device=grad.device),
                    torch.zeros(len(group.numels), dtype=torch.int64, device=grad.device))

        @staticmethod
        def accumulate(gathered, group, wire_dtype, scale, out) -> None:
            return None

    backend = selection.TritonBackend(NoOpKernels)
    selection.triton_backend = lambda: backend
    state.TorchResiduals._backend = lambda self, tensor: backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50-25.6M", "gpt2-small-124M"], choices=sorted(MODELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS + ["auto", "fp16-hook", "auto-fp16"])
    parser.add_argument("--real-batch", type=int, default=0,
                        help="time a real network of each size (torchvision's ResNet-50 on this many 224x224 images, "
                             "a GPT-2-small-sized decoder on this many 256-token sequences) instead of the shapes "
                             "alone: forward and backward in every step, so backward's compute can hide the work")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timing, profile the hook's host work in this many steps of topk-bucket-graphs, "
                             "else topk-graphs, else topk "
                             "(cProfile)")
    parser.add_argument("--host-only", action="store_true",
                        help="CPU: run the GPU path's Python (grouped selection, DDP glue) with its kernels replaced "
                             "by no-ops, so the hook's host time is what a GPU step would spend launching. Meaningful "
                             "where a bucket's compressed members lie back to back (ResNet-50's shapes); GPT-2's "
                             "buckets gather theirs first, a memory pass here that is a device copy on a GPU")
    args = parser.parse_args()
    if args.host_only:
        if args.device != "cpu" or args.real_batch:
            parser.error("--host-only runs the layer shapes on the CPU")
        _kernels_as_no_ops()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    methods = args.methods or (GPU_METHODS if device.type == "cuda" else ["dense", "topk"])
    if {"topk-graphs", "topk-bucket-graphs"} & set(methods) and device.type != "cuda":
        parser.error("topk-graphs and topk-bucket-graphs record CUDA graphs: they need --device cuda")
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
              f", ratio {args.ratio}, median of {args.repeat} steps ({time.strftime('%Y-%m-%d')}), "
              + (f"real networks, batch {args.real_batch}" if args.real_batch else "layer shapes alone"))
        print("| model | " + " | ".join(f"{m} ms" for m in methods) + " | elementwise ms | "
              + " | ".join(f"{m} - dense ms" for m in methods if m != "dense") + " |")
        print("|---" * (1 + 2 * len(methods)) + "|")
        for name in args.models:
            r = measure(name, device, args.ratio, args.repeat, methods, args.real_batch, args.profile)
            over = [f"{r[m] - r['dense']:.2f}" + (f" ({(r[m] - r['dense']) / r['elementwise']:.2f}x elem.)"
                                                   if device.type == "cpu" else "")
                    for m in methods if m != "dense"]
            print(f"| {name} | " + " | ".join(f"{r[m]:.2f}" for m in methods) + f" | {r['elementwise']:.2f} | "
                  + " | ".join(over) + " |")
            print(f"# {name}: host ms inside the hook per step (launching, not waiting): "
                  + ", ".join(f"{m} {r['hook:' + m]:.2f}" for m in methods if f"hook:{m}" in r))
            if "replays" in r:
                print(f"# {name}: {r['replayed_by']} replayed {r['replays']} bucket selections and {r['finish_replays']} "
                      f"addings back as CUDA graphs")
            if "whole_replays" in r:
                print(f"# {name}: topk-bucket-graphs replayed {r['whole_replays']} whole bucket steps as CUDA graphs")
            if device.type == "cuda":
                print(f"# {name}: host synchronisations in one step (sync debug mode): "
                      + ", ".join(f"{m} {r['syncs:' + m]}" for m in methods))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
