"""Cross-rank agreement about each compressed tensor, checked once on its first step.

Every rank decides alone whether a tensor goes dense (allreduce) or Top-K (allgather) and how large its payload is
(core.policy). If two ranks were configured differently (a typo in one node's config, another model version, a
checkpoint loaded on one rank only), one would wait in an allreduce the other never starts: a hang, or with equal
collectives a silently wrong average. So the first time each tensor is reduced (and again after a load), every
rank also allgathers a small fixed-size *fingerprint* of what it is about to do -- configuration, shape, dtype,
step and decision -- and waits for it before the tensor's own collective. A disagreement then raises the same
:class:`RankMismatch` on every rank, naming the tensor and the differing fields, instead of hanging.

Pure functions of Python numbers: each framework only ships the integer vector through its allgather.
"""
from __future__ import annotations

import struct
from typing import List, Optional, Sequence, Tuple

from .config import SECOND_MOMENTS, TARGETS, VALUE_DTYPES, TopKConfig
from .exchange import DENSE, DENSE_HALF, DENSE_INT8, EXCHANGES

__all__ = ["FINGERPRINT_LENGTH", "RankMismatch", "fingerprint", "mismatch_message", "check_name"]

_VERSION = 7
_MAX_DIMS = 8
#: Element dtypes by the names both frameworks print ("float32", not "torch.float32"); others encode as -1.
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
#: The fields of a fingerprint, in order; the shape takes the last _MAX_DIMS + 1 slots (ndim, then the dims).
_FIELDS = ("version", "ratio", "k", "min_numel", "value_dtype", "index_bits", "dense_fallback", "warmup_steps",
           "momentum", "dtype", "numel", "step", "decision", "exchange", "route", "target", "second_moment",
           "second_moment_block", "second_moment_sketch", "budget", "auto_every", "sparsity_cost", "bucket_bytes")
#: What a "route" field encodes: the exchange a tensor actually takes this step (core.exchange).
_ROUTES = (DENSE,) + EXCHANGES + (DENSE_HALF, DENSE_INT8)
FINGERPRINT_LENGTH = len(_FIELDS) + 1 + _MAX_DIMS


class RankMismatch(ValueError):
    """Ranks disagree about how one tensor is reduced; raised on every rank."""

    #: TensorFlow's autograph rewraps errors raised while tracing a tf.function into a generic StagingError unless
    #: they carry this attribute: users can catch RankMismatch itself in both frameworks.
    ag_pass_through = True


def check_name(tensor_name: str) -> str:
    """Name of the fingerprint allgather of ``tensor_name`` (its own prefix: never collides with ours or Horovod's)."""
    return "topk.check." + tensor_name


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _shown_float(field: str, value: float) -> str:
    if value == -1.0 and field == "ratio":
        return "'auto'"
    if value == -1.0 and field in ("budget", "sparsity_cost"):
        return "None"
    return f"{value:g}"


def _dtype_name(dtype: object) -> str:
    return str(getattr(dtype, "name", dtype)).replace("torch.", "")


def fingerprint(
    config: TopKConfig, shape: Sequence[int], dtype: object, step: int, k: Optional[int],
    route: Optional[str] = None,
) -> List[int]:
    """The integers every rank must agree on for one tensor: its configuration, shape, dtype, step, and the
    decision taken (k, or -1 for dense, and ``route``, the exchange taken: "dense", "allgather",
    "sparse_allreduce"; None when the caller does not say). ``dtype`` is a torch or TensorFlow dtype, or its
    name."""
    dims = [int(d) for d in shape]
    numel = 1
    for d in dims:
        numel *= d
    dtype_name = _dtype_name(dtype)
    values = [
        _VERSION,
        _float_bits(-1.0 if config.auto else config.ratio),  # "auto" shows as such (the decision: k, route)
        -1 if config.k is None else int(config.k),
        int(config.min_numel),
        VALUE_DTYPES.index(config.value_dtype),
        int(config.index_bits),
        int(config.dense_fallback),
        int(config.warmup_steps),
        _float_bits(config.momentum),
        _DTYPES.index(dtype_name) if dtype_name in _DTYPES else -1,
        numel,
        int(step),
        -1 if k is None else int(k),
        EXCHANGES.index(config.exchange),
        _ROUTES.index(route) if route is not None else -1,
        TARGETS.index(config.target),
        SECOND_MOMENTS.index(config.second_moment),
        int(config.second_moment_block),
        int(config.second_moment_sketch),
        _float_bits(config.budget if config.budget is not None else -1.0),
        -1 if config.auto_every is None else int(config.auto_every),
        _float_bits(config.sparsity_cost if config.sparsity_cost is not None else -1.0),
        int(config.bucket_bytes),
        len(dims),
    ]
    values += (dims + [-1] * _MAX_DIMS)[:_MAX_DIMS]
    assert len(values) == FINGERPRINT_LENGTH
    return values


def _readable(rows: Sequence[Sequence[int]]) -> List[Tuple[str, List[str]]]:
    """(field, value on each rank) for every field, decoded for a human."""
    out: List[Tuple[str, List[str]]] = []
    for i, field in enumerate(_FIELDS):
        column = [int(r[i]) for r in rows]
        if field in ("ratio", "momentum", "budget", "sparsity_cost"):
            shown = [_shown_float(field, _bits_float(v)) for v in column]
        elif field == "exchange":
            shown = [repr(EXCHANGES[v]) if 0 <= v < len(EXCHANGES) else "?" for v in column]
        elif field == "route":
            shown = [_ROUTES[v] if 0 <= v < len(_ROUTES) else "unknown" for v in column]
        elif field == "auto_every":
            shown = ["None" if v < 0 else str(v) for v in column]
        elif field == "target":
            shown = [repr(TARGETS[v]) if 0 <= v < len(TARGETS) else "?" for v in column]
        elif field == "second_moment":
            shown = [repr(SECOND_MOMENTS[v]) if 0 <= v < len(SECOND_MOMENTS) else "?" for v in column]
        elif field == "value_dtype":
            shown = [repr(VALUE_DTYPES[v]) if 0 <= v < len(VALUE_DTYPES) else "?" for v in column]
        elif field == "dtype":
            shown = [_DTYPES[v] if 0 <= v < len(_DTYPES) else "other" for v in column]
        elif field in ("k", "decision"):
            shown = ["dense" if v < 0 and field == "decision" else "None" if v < 0 else str(v) for v in column]
        else:
            shown = [str(v) for v in column]
        out.append((field, shown))
    shapes = []
    for r in rows:
        ndim = int(r[len(_FIELDS)])
        dims = [int(d) for d in r[len(_FIELDS) + 1 : len(_FIELDS) + 1 + min(ndim, _MAX_DIMS)]]
        shapes.append(str(tuple(dims)) + ("..." if ndim > _MAX_DIMS else ""))
    out.append(("shape", shapes))
    return out


def mismatch_message(tensor_name: str, rows: Sequence[Sequence[int]]) -> Optional[str]:
    """None when all ranks' fingerprints agree; otherwise a message naming the tensor and each differing field
    with every rank's value."""
    if all(list(r) == list(rows[0]) for r in rows):
        return None
    differences = []
    for field, shown in _readable(rows):
        if len(set(shown)) > 1:
            per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(shown))
            differences.append(f"{field} ({per_rank})")
    detail = "; ".join(differences) if differences else "fingerprints differ"
    return (
        f"horovod-topk: ranks disagree about tensor {tensor_name!r}: {detail}. Every rank must run the same model "
        f"with the same TopKEF configuration and load the same checkpoint step; stopping here instead of letting "
        f"the ranks wait on different collectives."
    )
