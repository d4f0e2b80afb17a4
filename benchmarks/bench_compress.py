#!/usr/bin/env python
"""Benchmark of TopKEF's compression math (PyTorch, CPU, one thread like each Horovod worker here).

For each model (one 1M tensor, one 10M tensor, a 25.6M-parameter ResNet-50 made of its real layer shapes) and
ratio, it times in the same run, best of --repeat, interleaved:
  elementwise   one elementwise pass over all parameters (r.add_(g)): the unit of the speed bar in docs/performance.md
  exact top-k   torch.topk over |r + g| per tensor (the selection alone)
  compress      residual + selection + payload, per selector ("sampled" fused kernel, "exact" torch ops)
  decompress    the dense average from P=2 payloads, per selector
and prints the ratios, bytes on the wire per step versus a dense ring allreduce, and the peak extra memory per
parameter (measured in a fresh process per selector: RSS growth over the gradients' own memory).

    python benchmarks/bench_compress.py                   # the table in docs/performance.md
    python benchmarks/bench_compress.py --repeat 3 --models 1M

With ``--device cuda`` (or ``cpu``) it benchmarks the device selection path instead (torch alone, no Horovod):
ResNet-50's and GPT-2 small's real shapes and one 25M tensor at ratios 0.01 and 0.001, on that device, timed with
CUDA events on a GPU; ``--shrink 100`` divides every size by 100 for a quick check on a CPU.

    python benchmarks/bench_compress.py --device cuda
    python benchmarks/bench_compress.py --device cpu --shrink 100 --repeat 2
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch

from horovod_topk.core import PayloadLayout, sample_size
from horovod_topk.torch import kernels, ops, selection

WORLD = 2


def resnet50_shapes() -> List[tuple]:
    """Weight shapes of torchvision's ResNet-50 (25.5M weights; BatchNorm scales/biases are left out: they are
    small and travel dense), built here to avoid a torchvision dependency."""
    shapes = [(64, 3, 7, 7)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes, planes, 3, 3), (planes * 4, planes, 1, 1)]
            if b == 0:
                shapes.append((planes * 4, inplanes, 1, 1))  # downsample
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def gpt2_small_shapes() -> List[tuple]:
    """Parameter shapes of GPT-2 small (124,439,808 parameters: 12 layers, d=768, vocabulary 50257, context 1024;
    the output layer shares the token embedding), in Hugging Face's Conv1D (in, out) layout."""
    d, vocab, context, layers = 768, 50257, 1024, 12
    shapes = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),  # ln_1, attention qkv and projection
                   (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, MLP
    return shapes + [(d,), (d,)]  # ln_f


MODELS: Dict[str, Callable[[], List[tuple]]] = {
    "1M": lambda: [(1_000_000,)],
    "10M": lambda: [(10_000_000,)],
    "resnet50-25.6M": resnet50_shapes,
    "gpt2-small-124M": gpt2_small_shapes,
    "25M": lambda: [(25_000_000,)],
}
DEVICE_MODELS = ["resnet50-25.6M", "gpt2-small-124M", "25M"]


def best_ms(fn: Callable[[], None], repeat: int, setup: Callable[[], None] = lambda: None) -> float:
    best = math.inf
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


class Model:
    """Gradients, residuals and per-tensor k for one model and ratio."""

    def __init__(self, shapes: List[tuple], ratio: float, seed: int = 0, keep_copy: bool = True) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.grads = [torch.randn(math.prod(s), generator=gen) for s in shapes]
        self.saved = [g.clone() for g in self.grads] if keep_copy else []
        self.residuals = [torch.zeros_like(g) for g in self.grads]
        self.ks = [max(1, math.ceil(ratio * g.numel())) for g in self.grads]
        self.layouts = [PayloadLayout(k, 4) for k in self.ks]
        self.numel = sum(g.numel() for g in self.grads)

    def restore(self) -> None:
        for g, s in zip(self.grads, self.saved):
            g.copy_(s)


def compress_all(m: Model, selector: str) -> List[torch.Tensor]:
    payloads = []
    wire = torch.empty(0)
    for g, r, k, lay in zip(m.grads, m.residuals, m.ks, m.layouts):
        if selector == "sampled":
            p = torch.empty(lay.nbytes, dtype=torch.uint8)
            kernels.load().compress(r, g, None, 0.0, k, lay.values_offset, p, wire, sample_size(k, g.numel()), 1)
        else:
            idx, val = ops.compensate_and_select(g, r, k, torch.float32)
            p = ops.pack(idx, val, lay)
        payloads.append(p)
    return payloads


def decompress_all(m: Model, selector: str, gathered: List[torch.Tensor]) -> None:
    """Into the gradient buffers, as TopKEF does (the kernel zeroes the buffer and adds the payloads in)."""
    wire = torch.empty(0)
    for g, lay, buf in zip(m.grads, m.layouts, gathered):
        if selector == "sampled":
            kernels.load().decompress(buf, WORLD, lay.k, lay.values_offset, lay.nbytes, wire, 1.0 / WORLD, g)
        else:
            idx, val = ops.unpack(buf, WORLD, lay, torch.float32)
            g.copy_(ops.scatter_sum(idx, val * (1.0 / WORLD), g.numel(), torch.float32))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_probe(model: str, selector: str, ratio: float) -> None:
    """Run in a fresh process: print the extra bytes per parameter that TopKEF needs, i.e. the residual (4 bytes,
    persistent) plus the transient peak of compress/decompress above the gradients + residuals (Linux: the peak
    RSS is reset through /proc/self/clear_refs right before the steps)."""
    torch.set_num_threads(1)
    kernels.load()
    m = Model(MODELS[model](), ratio, keep_copy=False)
    compress_all(m, selector)  # warm-up: allocator caches and kernel code paths
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    base = _rss_kib("VmRSS")
    for _ in range(3):
        payloads = compress_all(m, selector)
        decompress_all(m, selector, [torch.cat([p, p]) for p in payloads])
    transient = max(0, _rss_kib("VmHWM") - base) * 1024 / m.numel
    print(4 + transient)


def measured_memory(model: str, selector: str, ratio: float) -> float:
    out = subprocess.run([sys.executable, __file__, "--memory-probe", model, selector, str(ratio)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


class Timer:
    """Best-of-``repeat`` milliseconds of ``fn`` on ``device``: CUDA events around the launches on a GPU (the
    device's own time, after one warm-up call), the wall clock on the CPU."""

    def __init__(self, device: torch.device, repeat: int) -> None:
        self.device, self.repeat = device, repeat

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            fn()
            return best_ms(fn, self.repeat)
        fn()
        torch.cuda.synchronize(self.device)
        best = math.inf
        for _ in range(self.repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        return best


def _triton_select():
    """The grouped Triton path, or None where Triton is not installed."""
    try:
        from horovod_topk.torch import triton_select
    except ImportError:
        return None
    return triton_select


def device_main(args: argparse.Namespace) -> None:
    """The device selection paths with torch alone, no Horovod: per model and ratio, compress and decompress
    (P=2 payloads) of every tensor one by one, as Horovod's hooks hand them over, by each backend (triton: the
    Triton kernels per tensor, what CUDA tensors get; device: device_select; reference: torch.topk plus a host
    check for non-finite entries), and by the grouped Triton path (all the model's tensors as one group: the
    gradients are concatenated and the result copied back into them, both counted); one elementwise pass and
    torch.topk alone for scale."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    timer = Timer(device, args.repeat)
    # Triton kernels run on a GPU, or on the CPU only under Triton's interpreter (slow; for checking the script)
    grouped = _triton_select() if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else None
    backends = {"device": selection.DeviceBackend(), "reference": selection.ReferenceBackend()}
    if grouped is not None:
        backends["triton"] = selection.TritonBackend(grouped)
    print(f"# torch {torch.__version__}, device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{os.cpu_count()} cores, 1 thread'})"
          f", sizes / {args.shrink}, best of {args.repeat}; times in ms"
          + ("" if grouped else "; Triton not installed: no triton or grouped columns"))
    print("| model | ratio | elements | tensors | elementwise | torch.topk | compress triton | decompress triton "
          "| compress grouped | decompress grouped | compress device | decompress device | compress reference "
          "| grouped (c+d) | torch.topk / grouped compress | torch.topk / triton compress |")
    print("|" + "---|" * 16)
    for name in args.models or DEVICE_MODELS:
        numels = [max(1, math.prod(shape) // args.shrink) for shape in MODELS[name]()]
        gen = torch.Generator(device=device).manual_seed(0)
        grads = [torch.randn(n, device=device, generator=gen) for n in numels]
        for ratio in args.ratios or [0.01, 0.001]:
            ks = [max(1, math.ceil(ratio * n)) for n in numels]
            layouts = [PayloadLayout(k, 4) for k in ks]
            residuals = [torch.zeros_like(g) for g in grads]
            scratch = [torch.zeros_like(g) for g in grads]
            t = {
                "elementwise": timer(lambda: [s.add_(g) for s, g in zip(scratch, grads)]),
                "topk": timer(lambda: [torch.topk(s.abs(), k, sorted=False) for s, k in zip(scratch, ks)]),
            }
            for label, backend in backends.items():
                payloads: List[torch.Tensor] = [torch.empty(0)] * len(grads)

                def compress() -> None:
                    for i, (g, r, lay) in enumerate(zip(grads, residuals, layouts)):
                        payloads[i] = backend.compress(g, r, None, 0.0, lay, torch.float32, 0, 0)[0]

                t[f"c_{label}"] = timer(compress)
                gathered = [torch.cat([p, p]) for p in payloads]
                t[f"d_{label}"] = timer(lambda: [backend.decompress(buf, WORLD, lay, torch.float32, 1.0 / WORLD, s)
                                                 for buf, lay, s in zip(gathered, layouts, scratch)])
            if grouped is not None:
                group = grouped.GroupLayout(tuple(numels), tuple(layouts), device)
                flat_residual = torch.zeros(group.numel, device=device)
                flat_out = torch.empty(group.numel, device=device)
                pieces = list(flat_out.split(list(numels)))
                buffers: List[torch.Tensor] = []

                def compress_grouped() -> None:
                    buffers[:] = [grouped.compensate_and_select(torch.cat(grads), flat_residual, group,
                                                                torch.float32)[0]]

                def decompress_grouped() -> None:
                    grouped.accumulate([buffers[0], buffers[0]], group, torch.float32, 1.0 / WORLD, flat_out)
                    torch._foreach_copy_(scratch, pieces)

                t["c_grouped"] = timer(compress_grouped)
                t["d_grouped"] = timer(decompress_grouped)
            cell = lambda key: f"{t[key]:.3f}" if key in t else "-"  # noqa: E731
            ratio_of = lambda key: f"{t['topk'] / t[key]:.1f}x" if key in t else "-"  # noqa: E731
            both = f"{t['c_grouped'] + t['d_grouped']:.3f}" if "c_grouped" in t else "-"
            cells = [f"{t['elementwise']:.3f}", f"{t['topk']:.3f}", cell("c_triton"), cell("d_triton"),
                     cell("c_grouped"), cell("d_grouped"), cell("c_device"), cell("d_device"), cell("c_reference"),
                     both, ratio_of("c_grouped"), ratio_of("c_triton")]
            print(f"| {name} | {ratio:g} | {sum(numels):,} | {len(numels)} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS),
                        help=f"default: 1M 10M resnet50-25.6M; with --device: {' '.join(DEVICE_MODELS)}")
    parser.add_argument("--ratios", nargs="+", type=float, default=None,
                        help="default: 0.1 0.01 0.001; with --device: 0.01 0.001")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", help="benchmark the device selection path on this device (cuda, cpu)")
    parser.add_argument("--shrink", type=int, default=1,
                        help="with --device: divide every tensor's size by this (a quick check on a CPU)")
    parser.add_argument("--memory-probe", nargs=3, metavar=("MODEL", "SELECTOR", "RATIO"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(args.memory_probe[0], args.memory_probe[1], float(args.memory_probe[2]))
        return
    if args.device:
        device_main(args)
        return
    args.models = args.models or ["1M", "10M", "resnet50-25.6M"]
    args.ratios = args.ratios or [0.1, 0.01, 0.001]
    torch.set_num_threads(1)
    if kernels.load() is None:
        sys.exit("the fused kernels could not be built; nothing to compare")
    print(f"# torch {torch.__version__}, 1 thread, {os.cpu_count()} cores, P={WORLD} payloads per decompress, "
          f"best of {args.repeat}; times in ms")
    print("| model | ratio | elementwise | exact top-k | compress sampled | decompress sampled | compress exact "
          "| decompress exact | sampled (c+d) / elementwise | exact top-k / sampled (c+d) | bytes/step sent vs dense "
          "allreduce | extra bytes/param sampled, exact |")
    print("|" + "---|" * 12)
    for name in args.models:
        for ratio in args.ratios:
            m = Model(MODELS[name](), ratio)
            other = compress_all(Model(MODELS[name](), ratio, seed=1), "sampled")  # the second rank's payloads
            scratch = [torch.zeros_like(g) for g in m.grads]
            t: Dict[str, float] = {}
            def elementwise() -> float:
                return best_ms(lambda: [s.add_(g) for s, g in zip(scratch, m.grads)], args.repeat)

            t["elementwise"] = elementwise()
            t["topk"] = best_ms(lambda: [torch.topk(s.abs(), k, sorted=False) for s, k in zip(scratch, m.ks)],
                                args.repeat)
            for selector in ("sampled", "exact"):
                payloads: List[torch.Tensor] = []
                t[f"c_{selector}"] = best_ms(lambda: payloads.__setitem__(slice(None), compress_all(m, selector)),
                                             args.repeat, m.restore)
                gathered = [torch.cat([p, q]) for p, q in zip(payloads, other)]
                t[f"d_{selector}"] = best_ms(lambda: decompress_all(m, selector, gathered), args.repeat)
            # the shared machine is noisy: the reference is timed again after the others, best of both kept
            t["elementwise"] = min(t["elementwise"], elementwise())
            sampled = t["c_sampled"] + t["d_sampled"]
            sent = sum(lay.nbytes for lay in m.layouts) * (WORLD - 1)  # an allgather moves the others' payloads
            dense = 2 * (WORLD - 1) / WORLD * m.numel * 4  # a ring allreduce
            mem = [measured_memory(name, s, ratio) for s in ("sampled", "exact")]
            print(f"| {name} | {ratio:g} | {t['elementwise']:.1f} | {t['topk']:.1f} | {t['c_sampled']:.1f} | "
                  f"{t['d_sampled']:.1f} | {t['c_exact']:.1f} | {t['d_exact']:.1f} | "
                  f"{sampled / t['elementwise']:.2f}x | {t['topk'] / sampled:.1f}x | "
                  f"{sent / 1e6:.2f} MB vs {dense / 1e6:.1f} MB ({dense / sent:.0f}x less) | "
                  f"{mem[0]:.1f}, {mem[1]:.1f} |", flush=True)
    print("\nextra bytes/param: the residual (4) plus the peak RSS growth during compress+decompress steps")


if __name__ == "__main__":
    main()
