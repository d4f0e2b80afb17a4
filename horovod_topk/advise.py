"""Will Top-K pay? Predicted step time, efficiency and bytes per worker for dense allreduce, Horovod's fp16
compression and TopKEF, from numbers known before launching a job.

    python -m horovod_topk.advise --model resnet50 --workers 16 --bandwidth 10gbit --compute 120ms
    python -m horovod_topk.advise --params 25.6e6 --workers 8 --bandwidth 1gbit --compute 50ms --ratio 0.001
    python -m horovod_topk.advise --tensors 512x1024 1024 1024x1024 --workers 4 --bandwidth 100mbit --compute 20ms
    python -m horovod_topk.advise --check results/e2e.json      # measured (benchmarks/bench_e2e.py --json) vs predicted

The model (horovod_topk.core.costmodel, which states it in full): bytes per worker from the compressor's own
per-tensor decisions (core.policy.plan_tensor, core.exchange), T_comm = bytes / (0.75 * bandwidth) + collectives *
latency, T_step = T_compute + T_compress + T_comm - min(T_comm, overlap * T_compute), E = T_compute / T_step.

Models: ``--model`` takes the real parameter list of a few well-known networks (below, built here so no framework
is needed). ``--params N`` has no structure to go by: it becomes equal tensors of at most ``--layer-numel``
(default 2**21 = 2.1M: ResNet-50's last 3x3 convolutions and GPT-2 small's MLP matrices hold 2.36M each) and no
small ones. The biases and norm scales a real model has go dense under min_numel but hold under 1% of the
parameters of the presets, so bytes come out nearly the same while the count of collectives (latency) is a guess:
prefer ``--tensors`` or ``--model`` when latency matters.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from horovod_topk.core.autodensity import HALF, INT8, label, steps_factor
from horovod_topk.core.config import DEFAULT_SPARSITY_COST, INDEX_BITS, VALUE_DTYPES, TopKConfig
from horovod_topk.core.costmodel import (
    latency_bytes,
    BANDWIDTH_EFFICIENCY,
    Link,
    Prediction,
    predict,
    with_exchange,
)
from horovod_topk.core.exchange import ALLGATHER, AUTO, DENSE, EXCHANGES, SPARSE_ALLREDUCE, int8_offered

Tensors = List[Tuple[str, int]]


# ---- model presets -----------------------------------------------------------------------------------------------


def resnet50() -> Tensors:
    """torchvision's ResNet-50: 161 tensors, 25,557,032 parameters (convolutions, BatchNorm scale and bias, fc)."""
    t: Tensors = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    inplanes = 64
    for layer, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            for i, (cout, numel) in enumerate(((planes, planes * inplanes), (planes, planes * planes * 9),
                                               (planes * 4, planes * 4 * planes)), start=1):
                t += [(f"{p}.conv{i}.weight", numel), (f"{p}.bn{i}.weight", cout), (f"{p}.bn{i}.bias", cout)]
            if b == 0:
                t += [(f"{p}.downsample.0.weight", planes * 4 * inplanes), (f"{p}.downsample.1.weight", planes * 4),
                      (f"{p}.downsample.1.bias", planes * 4)]
            inplanes = planes * 4
    return t + [("fc.weight", 1000 * 2048), ("fc.bias", 1000)]


def gpt2_small() -> Tensors:
    """GPT-2 small: 148 tensors, 124,439,808 parameters (12 layers, d=768, vocabulary 50257, context 1024; the
    output layer shares the token embedding)."""
    d, vocab, context = 768, 50257, 1024
    t: Tensors = [("wte", vocab * d), ("wpe", context * d)]
    for i in range(12):
        p = f"h.{i}"
        t += [(f"{p}.ln_1.weight", d), (f"{p}.ln_1.bias", d), (f"{p}.attn.c_attn.weight", d * 3 * d),
              (f"{p}.attn.c_attn.bias", 3 * d), (f"{p}.attn.c_proj.weight", d * d), (f"{p}.attn.c_proj.bias", d),
              (f"{p}.ln_2.weight", d), (f"{p}.ln_2.bias", d), (f"{p}.mlp.c_fc.weight", d * 4 * d),
              (f"{p}.mlp.c_fc.bias", 4 * d), (f"{p}.mlp.c_proj.weight", 4 * d * d), (f"{p}.mlp.c_proj.bias", d)]
    return t + [("ln_f.weight", d), ("ln_f.bias", d)]


def bert_large() -> Tensors:
    """BERT-large encoder with pooler (no pre-training heads): 391 tensors, 335,141,888 parameters (24 layers,
    d=1024, feed-forward 4096, vocabulary 30522, 512 positions)."""
    d, ff = 1024, 4096
    t: Tensors = [("embeddings.word", 30522 * d), ("embeddings.position", 512 * d), ("embeddings.token_type", 2 * d),
                  ("embeddings.LayerNorm.weight", d), ("embeddings.LayerNorm.bias", d)]
    for i in range(24):
        p = f"encoder.layer.{i}"
        for proj in ("query", "key", "value", "output"):
            t += [(f"{p}.attention.{proj}.weight", d * d), (f"{p}.attention.{proj}.bias", d)]
        t += [(f"{p}.attention.LayerNorm.weight", d), (f"{p}.attention.LayerNorm.bias", d),
              (f"{p}.intermediate.weight", d * ff), (f"{p}.intermediate.bias", ff),
              (f"{p}.output.weight", ff * d), (f"{p}.output.bias", d),
              (f"{p}.output.LayerNorm.weight", d), (f"{p}.output.LayerNorm.bias", d)]
    return t + [("pooler.weight", d * d), ("pooler.bias", d)]


def mlp_e2e() -> Tensors:
    """The MLP of benchmarks/bench_e2e.py and the README's end-to-end table: 8 tensors, 2,104,842 parameters."""
    t: Tensors = []
    for i, (n_in, n_out) in enumerate(((512, 1024), (1024, 1024), (1024, 512), (512, 10))):
        t += [(f"{2 * i}.weight", n_in * n_out), (f"{2 * i}.bias", n_out)]
    return t


MODELS: Dict[str, Callable[[], Tensors]] = {
    "resnet50": resnet50,
    "gpt2-small": gpt2_small,
    "bert-large": bert_large,
    "mlp-e2e": mlp_e2e,
}
#: --params N without --layer-numel: tensors of at most this many elements (see the module docstring).
LAYER_NUMEL = 2 ** 21


def split_params(params: int, layer_numel: int = LAYER_NUMEL) -> Tensors:
    """``params`` as ceil(params / layer_numel) tensors of (nearly) equal size, summing exactly to ``params``."""
    n = max(1, math.ceil(params / layer_numel))
    base, extra = divmod(params, n)
    return [(f"layer{i}", base + (1 if i < extra else 0)) for i in range(n)]


# ---- parsing -----------------------------------------------------------------------------------------------------

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str) -> float:
    """'10gbit', '100mbit', '1.5gbit/s', '2.5e9' -> bits per second. Units are tc's (decimal, bits); 'bps' forms
    are refused because tc reads 'mbps' as megabytes per second and people mean megabits."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)(?:/s)?\s*", str(text).lower())
    if m is None or m.group(2) not in ("", *_RATE_UNITS):
        raise argparse.ArgumentTypeError(
            f"bandwidth {text!r} not understood: write a number of bits per second with a unit, "
            f"e.g. 100mbit, 10gbit, 1.5gbit/s (units: {', '.join(_RATE_UNITS)})")
    value = float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1.0)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"bandwidth must be above 0, got {text!r}")
    return value


def parse_duration(text: str) -> float:
    """'120ms', '0.12s', '50us' -> seconds. A unit is required: a bare number is ambiguous."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zµ]+)\s*", str(text).lower())
    if m is None or m.group(2) not in _TIME_UNITS:
        raise argparse.ArgumentTypeError(
            f"time {text!r} not understood: write a number with a unit, e.g. 120ms, 0.12s, 50us "
            f"(units: {', '.join(u for u in _TIME_UNITS if u != 'µs')})")
    value = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"time must be finite, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(low_open: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = (0.0 < value <= 1.0) if low_open else (0.0 <= value <= 1.0)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be in {'(0' if low_open else '[0'}, 1], got {text!r}")
        return value
    return parse


def _params(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count such as 25.6e6, got {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"parameter count must be at least 1, got {text!r}")
    return int(round(value))


def _tensor_size(text: str) -> int:
    """'524288' or a shape '512x1024' -> numel."""
    parts = text.lower().split("x")
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"tensor size {text!r} not understood: give a numel (524288) or a shape "
                                         f"(512x1024)")
    numel = math.prod(int(p) for p in parts)
    if numel < 1:
        raise argparse.ArgumentTypeError(f"tensor size must be at least 1 element, got {text!r}")
    return numel


# ---- output ------------------------------------------------------------------------------------------------------


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _rate(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def _method_name(method: str) -> str:
    if method == "dense":
        return "dense allreduce"
    if method == "int8":
        return "int8 (ratio=\"auto\", PyTorch)"
    return "fp16 (Horovod)"


def _auto_summary(pred: Prediction, config: TopKConfig) -> str:
    """One line: how many tensors exchange='auto' sent which way, and why the dense ones went dense."""
    parts = []
    for route in (SPARSE_ALLREDUCE, ALLGATHER, DENSE):
        tensors = [r for r in pred.routes if r.route == route]
        if not tensors:
            continue
        part = f"{len(tensors)} {route} ({_mb(sum(r.nbytes for r in tensors))})"
        if route == DENSE:
            small = sum(1 for r in tensors if r.reason.startswith("smaller than min_numel"))
            why = [f"{small} under min_numel={config.min_numel}"] if small else []
            if len(tensors) - small:
                why.append(f"{len(tensors) - small} cheaper dense")
            part += f": {', '.join(why)}"
        parts.append(part)
    return "auto sends " + "; ".join(parts)


def advise(tensors: Tensors, workers: int, link: Link, t_compute_s: float, config: TopKConfig, *,
           grad_itemsize: int = 4, overlap: float = 0.0, t_compress_s: float = 0.0,
           sparse_available: bool = True, int8_available: bool = True
           ) -> Tuple[List[Tuple[str, Optional[Prediction], str]], List[str]]:
    """The rows of the table ((name, prediction or None, why not)) and the lines under it. ``int8_available``:
    the front end sends ratio="auto"'s int8 (PyTorch through Horovod, on CPU gradients)."""
    kwargs = dict(grad_itemsize=grad_itemsize, overlap=overlap, t_compress_s=t_compress_s,
                  sparse_available=sparse_available)
    rows: List[Tuple[str, Optional[Prediction], str]] = []
    held = ("dense", "fp16", "int8") if int8_available and int8_offered(workers) else ("dense", "fp16")
    for method in held:
        rows.append((_method_name(method), predict(method, tensors, workers, link, t_compute_s, **kwargs),
                     ""))
    auto = None
    for exchange in (ALLGATHER, SPARSE_ALLREDUCE, AUTO):
        name = f"TopKEF {config.ratio:g} {exchange}"
        if exchange == SPARSE_ALLREDUCE and not sparse_available:
            rows.append((name, None, "not available"))
            continue
        try:
            cfg = with_exchange(config, exchange)
        except ValueError:
            rows.append((name, None, "compact encoding travels by allgather"))
            continue
        pred = predict("topk", tensors, workers, link, t_compute_s, config=cfg, **kwargs)
        rows.append((name, pred, ""))
        if exchange == AUTO:
            auto = pred
    notes = []
    if auto is not None:
        notes.append(_auto_summary(auto, config))
        best_dense, label = min(((p, method) for (_, p, _), method in zip(rows, held)), key=lambda pm: pm[0].t_step_s)
        label = "dense allreduce" if label == "dense" else label
        gain = best_dense.t_step_s / auto.t_step_s
        if gain > 1.0:
            notes.append(f"pays: TopKEF auto {_ms(auto.t_step_s)} ms per step against {_ms(best_dense.t_step_s)} ms "
                         f"for {label} ({gain:.2f}x faster, E {auto.efficiency:.0%} vs {best_dense.efficiency:.0%})")
        else:
            notes.append(f"does not pay: TopKEF auto {_ms(auto.t_step_s)} ms per step against "
                         f"{_ms(best_dense.t_step_s)} ms for {label}")
        notes.append(to_target_note(auto.t_step_s, best_dense.t_step_s, label, config.ratio))
        sparse = [r for r in auto.routes if r.route == SPARSE_ALLREDUCE]
        if sparse:
            notes.append(sparse_allreduce_note(len(sparse), workers, config.ratio))
    return rows, notes


def to_target_note(t_topk_s: float, t_dense_s: float, dense_label: str, ratio: Optional[float],
                   sparsity_cost: float = DEFAULT_SPARSITY_COST) -> str:
    """Per step is not to the target: a sparser density needs more steps to the same loss. ratio="auto" prices
    that with ratio ** -sparsity_cost times dense's steps (core.autodensity.steps_factor); the advisor says what
    the same prior makes of this ratio, so both choose by one model."""
    if ratio is None:
        return "to the target: Top-K may need more steps to the same accuracy (docs/convergence.md)"
    factor = steps_factor(ratio, sparsity_cost)
    t_target = t_topk_s * factor
    verdict = "sooner" if t_target < t_dense_s else "later"
    return (f"to the target: ratio {ratio:g} taken to need {factor:.2f}x dense's steps (ratio ** -{sparsity_cost:g}, "
            f"docs/auto-density.md): {_ms(t_target)} ms per dense step against {_ms(t_dense_s)} ms for "
            f"{dense_label}, {verdict} (the prior ratio=\"auto\" chooses by)")


def sparse_allreduce_note(tensors: int, workers: int, ratio: Optional[float]) -> str:
    """What a user should know when auto sends tensors through the sparse allreduce: at the same ratio it applies
    at most k entries per step where the allgather applies up to P k, which trained an Adam language model worse
    (docs/convergence.md, "The two exchanges at P = 4 and P = 8"). ``ratio`` is one number for the whole model:
    about P / 2.2 times it gives those tensors the allgather's bytes (and every other compressed tensor more too),
    capped at 1; exchange="allgather" keeps the allgather's convergence at its bytes."""
    scale = workers / 2.2
    if ratio is not None:
        larger = min(1.0, ratio * scale)
        reach = "gives them" if larger == ratio * scale else "is the largest ratio and comes closest to"
        advice = (f"ratio={larger:.3g} (x{larger / ratio:.1f}, raising every compressed tensor's bytes) {reach} "
                  f"the allgather's bytes")
    else:
        advice = f"about {scale:.1f}x the entries give them the allgather's bytes"
    return (f"{tensors} tensor(s) take the sparse allreduce: it applies at most k entries per step, the allgather "
            f"up to {workers}k; at the same ratio an Adam LM trained worse (+9% at P=4, +12% at P=8); {advice}, or "
            f"exchange='allgather' keeps the allgather's steps at its bytes (docs/convergence.md, \"The two exchanges at P = 4 and P = 8\")")


def format_table(rows: Sequence[Tuple[str, Optional[Prediction], str]]) -> str:
    head = f"{'method':<30} {'bytes/worker/step':>18} {'collectives':>12} {'T_comm ms':>10} {'T_step ms':>10} {'E':>5}"
    lines = [head, "-" * len(head)]
    for name, pred, why in rows:
        if pred is None:
            lines.append(f"{name:<30} {'n/a: ' + why:>58}")
            continue
        lines.append(f"{name:<30} {_mb(pred.nbytes):>18} {pred.collectives:>12} {_ms(pred.t_comm_s):>10} "
                     f"{_ms(pred.t_step_s):>10} {pred.efficiency:>5.0%}")
    return "\n".join(lines)


# ---- --check -----------------------------------------------------------------------------------------------------

_TOPK_METHOD = re.compile(r"topk([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(?:-(\w+))?")


def row_method(row: dict, base: TopKConfig) -> Tuple[str, TopKConfig]:
    """(costmodel method, TopKConfig) of a bench_e2e row: "dense", "fp16", "topk<ratio>[-<exchange>]"; the row's
    own "ratio" and "exchange" fields win over the name when they are given."""
    method = str(row.get("method"))
    if method in ("dense", "fp16"):
        return method, base
    if method == "auto":  # ratio="auto": predicted as the density it chose (bench_e2e records it)
        chosen = (row.get("auto") or {}).get("ratio")
        if chosen is None or chosen in (HALF, INT8):  # dense, or every tensor dense in float16 / int8
            return ("dense" if chosen is None else str(chosen)), base
        return "topk", TopKConfig(**{**base.to_dict(), "ratio": float(chosen), "exchange": base.exchange})
    m = _TOPK_METHOD.fullmatch(method)
    if m is None:
        raise ValueError(f"method {method!r} not understood: expected dense, fp16, topk<ratio> or "
                         f"topk<ratio>-<exchange> with exchange one of {', '.join(EXCHANGES)}")
    ratio = row.get("ratio") if row.get("ratio") is not None else float(m.group(1))
    exchange = row.get("exchange") or m.group(2) or AUTO
    if exchange not in EXCHANGES:
        raise ValueError(f"method {method!r}: exchange {exchange!r} is not one of {', '.join(EXCHANGES)}")
    cfg = TopKConfig(**{**base.to_dict(), "ratio": float(ratio), "exchange": exchange})
    return "topk", cfg


def auto_comparison(auto: dict, rate_bps: float, efficiency: float, t_step: float) -> str:
    """What ratio="auto" measured next to this model: its probed rate against the nominal rate x efficiency, and
    its own predicted step for the density it chose against the measured step."""
    chosen = auto.get("ratio")
    key = label(chosen if chosen is None or chosen in (HALF, INT8) else float(chosen))
    predicted = (auto.get("predicted_s") or {}).get(key)
    probed = auto.get("bandwidth_bps")
    parts = [f"auto chose {key}"]
    if probed:
        parts.append(f"probed {_rate(float(probed))} = {float(probed) / rate_bps:.2f} x nominal (this model: "
                     f"{efficiency:g}), latency {float(auto.get('latency_s') or 0) * 1e3:.2f} ms")
    if predicted:
        parts.append(f"its prediction {_ms(float(predicted))} ms vs measured {_ms(t_step)} ms "
                     f"({float(predicted) / t_step:.2f})")
    return "; ".join(parts)


def check(data: dict, link_defaults: Link, base: TopKConfig, *, overlap: float, t_compress_s: float,
          sparse_available: bool) -> List[str]:
    """Measured vs predicted for each row of a benchmarks/bench_e2e.py --json file, predicting from the row's own
    workers, link rate and T_compute. Raises ValueError naming what is wrong with the file."""
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), list) or not isinstance(
            data.get("rows"), list):
        raise ValueError("expected a JSON object with 'tensors' ([[name, numel], ...]) and 'rows' (a list)")
    try:
        tensors = [(str(name), int(numel)) for name, numel in data["tensors"]]
    except (TypeError, ValueError):
        raise ValueError("'tensors' must be a list of [name, numel] pairs") from None
    grad_itemsize = data.get("grad_bytes", 4)
    if grad_itemsize not in (1, 2, 4, 8):
        raise ValueError(f"'grad_bytes' must be 1, 2, 4 or 8, got {grad_itemsize!r}")
    lines = [f"model {data.get('model', '?')}: {len(tensors)} tensors, {sum(n for _, n in tensors):,} parameters, "
             f"{grad_itemsize}-byte gradients; bandwidth x{link_defaults.efficiency:g} effective, latency "
             f"{link_defaults.latency_s * 1e6:g} us per collective, overlap {overlap:g}",
             f"{'P':>3} {'rate':>8} {'method':<26} {'T_compute':>9} {'T_step meas':>11} {'pred':>8} {'pred/meas':>9}"
             f" {'bytes meas':>12} {'bytes pred':>12} {'pred/meas':>9}"]
    step_ratios = []
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            raise ValueError(f"row {i} must be an object with workers, rate, method, t_compute_s, t_step_s; got {row!r}")
        try:
            workers = int(row["workers"])
            rate_bps = float(row["rate_bps"]) if row.get("rate_bps") else parse_bandwidth(row["rate"])
            t_compute, t_step = float(row["t_compute_s"]), float(row["t_step_s"])
            method, cfg = row_method(row, base)
            link = Link(rate_bps, link_defaults.efficiency, link_defaults.latency_s,
                        link_defaults.fusion_threshold_bytes)
            pred = predict(method, tensors, workers, link, t_compute, config=cfg, grad_itemsize=grad_itemsize,
                           overlap=overlap, t_compress_s=t_compress_s, sparse_available=sparse_available)
            tx = row.get("tx_bytes_per_step")
            tx = None if tx is None else float(tx)
            if t_step <= 0:
                raise ValueError(f"t_step_s must be above 0, got {t_step}")
        except (AttributeError, KeyError, TypeError, ValueError, argparse.ArgumentTypeError) as e:
            what = f"missing {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"row {i} ({row!r}): {what}") from None
        step_ratio = pred.t_step_s / t_step
        step_ratios.append(step_ratio)
        byte_cols = (f"{_mb(tx):>12} {_mb(pred.nbytes):>12} {pred.nbytes / tx:>9.2f}" if tx else
                     f"{'–':>12} {_mb(pred.nbytes):>12} {'–':>9}")
        lines.append(f"{workers:>3} {row.get('rate', _rate(rate_bps)):>8} {row['method']:<26} "
                     f"{_ms(t_compute):>9} {_ms(t_step):>11} {_ms(pred.t_step_s):>8} {step_ratio:>9.2f} {byte_cols}")
        if row.get("method") == "auto" and isinstance(row.get("auto"), dict):
            lines.append("    " + auto_comparison(row["auto"], rate_bps, link_defaults.efficiency, t_step))
    if step_ratios:
        geo = math.exp(sum(math.log(r) for r in step_ratios) / len(step_ratios))
        lines.append(f"step time predicted/measured over {len(step_ratios)} rows: {min(step_ratios):.2f} .. "
                     f"{max(step_ratios):.2f} (geometric mean {geo:.2f}); times in ms")
    return lines


# ---- command line ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m horovod_topk.advise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", choices=sorted(MODELS), help="a preset's real list of tensor sizes")
    src.add_argument("--params", type=_params, help="a parameter count, e.g. 25.6e6 (split as --layer-numel says)")
    src.add_argument("--tensors", type=_tensor_size, nargs="+", metavar="SIZE",
                     help="each tensor's numel (524288) or shape (512x1024)")
    src.add_argument("--check", metavar="FILE",
                     help="compare with the measured rows of benchmarks/bench_e2e.py --json FILE (workers, bandwidth "
                          "and T_compute come from each row)")
    p.add_argument("--layer-numel", type=_positive_int, default=LAYER_NUMEL,
                   help=f"with --params: largest tensor size (default {LAYER_NUMEL})")
    p.add_argument("--workers", "-P", type=_positive_int, help="number of workers (ranks)")
    p.add_argument("--bandwidth", type=parse_bandwidth, help="each worker's link: 100mbit, 10gbit, ...")
    p.add_argument("--compute", type=parse_duration, help="compute time per step without communication: 120ms")
    p.add_argument("--ratio", type=_fraction(True), default=0.01, help="TopKEF ratio (default 0.01)")
    p.add_argument("--grad-bytes", type=int, choices=(2, 4, 8), default=4, help="bytes per gradient element (4)")
    p.add_argument("--latency", type=parse_duration, default=0.0,
                   help="time of one collective beyond its bytes, e.g. 50us (default 0, as on the test bed)")
    p.add_argument("--overlap", type=_fraction(False), default=0.0,
                   help="fraction of T_compute communication may hide behind (default 0: an upper bound)")
    p.add_argument("--efficiency", type=_fraction(True), default=BANDWIDTH_EFFICIENCY,
                   help=f"fraction of the nominal bandwidth collectives get (default {BANDWIDTH_EFFICIENCY}, "
                        f"measured on the test bed)")
    p.add_argument("--compress-time", type=parse_duration, default=0.0,
                   help="TopKEF compress + decompress per step, e.g. 17ms (default 0)")
    p.add_argument("--min-numel", type=int, default=TopKConfig.min_numel, help="TopKConfig.min_numel (1024)")
    p.add_argument("--value-dtype", choices=[v for v in VALUE_DTYPES if v], help="TopKConfig.value_dtype")
    p.add_argument("--index-bits", type=int, choices=INDEX_BITS, default=32, help="TopKConfig.index_bits")
    p.add_argument("--no-dense-fallback", action="store_true", help="TopKConfig.dense_fallback=False")
    p.add_argument("--framework", choices=("torch", "tensorflow"), default="torch",
                   help="both have the same exchanges and choose them alike; ratio=\"auto\"'s int8 (a row of the "
                        "table) is PyTorch's only")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = TopKConfig(ratio=args.ratio, min_numel=args.min_numel, value_dtype=args.value_dtype,
                            index_bits=args.index_bits, dense_fallback=not args.no_dense_fallback)
    except ValueError as e:
        parser.error(str(e))
    sparse_available = True  # PyTorch and TensorFlow both have the sparse allreduce (README, "Many workers")
    if args.check:
        try:
            data = json.loads(Path(args.check).read_text())
        except OSError as e:
            parser.error(f"--check {args.check}: {e.strerror or e}")
        except json.JSONDecodeError as e:
            parser.error(f"--check {args.check}: not JSON ({e})")
        try:
            lines = check(data, Link(1.0, args.efficiency, args.latency), config, overlap=args.overlap,
                          t_compress_s=args.compress_time, sparse_available=sparse_available)
        except ValueError as e:
            parser.error(f"--check {args.check}: {e}")
        print("\n".join(lines))
        return 0

    missing = [flag for flag, value in (("--workers", args.workers), ("--bandwidth", args.bandwidth),
                                        ("--compute", args.compute)) if value is None]
    if args.model is None and args.params is None and args.tensors is None:
        missing.insert(0, "--model, --params or --tensors")
    if missing:
        parser.error(f"missing {', '.join(missing)} (or give --check FILE)")
    if args.model:
        tensors, what = MODELS[args.model](), args.model
    elif args.params is not None:
        tensors = split_params(args.params, args.layer_numel)
        what = f"--params split into tensors of <= {args.layer_numel:,}"
    else:
        tensors, what = [(f"t{i}", n) for i, n in enumerate(args.tensors)], "--tensors"
    link = Link(args.bandwidth, args.efficiency, args.latency)
    if args.latency > 0:
        # auto then weighs each collective as this link does, which is what the user should pass to TopKEF too
        config = replace(config, collective_latency_bytes=latency_bytes(link))
    try:
        rows, notes = advise(tensors, args.workers, link, args.compute, config, grad_itemsize=args.grad_bytes,
                             overlap=args.overlap, t_compress_s=args.compress_time, sparse_available=sparse_available,
                             int8_available=args.framework == "torch")
    except ValueError as e:
        parser.error(str(e))
    print(f"{what}: {len(tensors)} tensors, {sum(n for _, n in tensors):,} parameters, {args.grad_bytes}-byte "
          f"gradients")
    print(f"{args.workers} workers, {_rate(args.bandwidth)} link (x{args.efficiency:g} effective), latency "
          f"{args.latency * 1e6:g} us per collective, overlap {args.overlap:g}, T_compute {_ms(args.compute)} ms"
          + (f", T_compress {_ms(args.compress_time)} ms" if args.compress_time else "") + f", {config.describe()}")
    print()
    print(format_table(rows))
    print()
    print("\n".join(notes))
    if args.latency > 0:
        print(f"auto above counts each collective as {config.collective_latency_bytes:,} bytes (latency x effective "
              f"rate): pass TopKEF(collective_latency_bytes={config.collective_latency_bytes}) to choose the same way")
    else:
        print(f"auto above counts each collective as {config.collective_latency_bytes:,} bytes (TopKEF's default); "
              f"give --latency to weigh your link's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
