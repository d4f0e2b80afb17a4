"""Selection backends: who compresses a gradient into a payload and adds the gathered payloads back, per device.

``TopKEF.start_reduction`` does not know how a tensor is compressed; it asks :func:`backend_for` and calls the
backend's ``compress`` and (through its handle) ``decompress``. Four backends:

``fused``      CPU tensors, selector "sampled": the C++ kernel (csrc/topk_kernels.cpp), one pass per tensor.
``reference``  selector "exact" anywhere, and CPU tensors when the kernel cannot be built: ``torch.topk``
               (ops.compensate_and_select), with one host check for non-finite entries.
``triton``     CUDA tensors, selector "sampled", where Triton is installed: triton_select's kernels, each tensor a
               group of one (~20 launches), exact and without host synchronisation; what they do not cover (DGC
               momentum, float64 residuals) goes to device_select.
``device``     other accelerators, and CUDA without Triton: device_select, exact and without host
               synchronisation, but ~170 small launches per tensor: on an H100, ResNet-50's weights took 62-92 ms
               this way across runs, against 16-23 ms for the reference and about 5 ms for torch.topk alone
               (benchmarks/bench_compress.py --device cuda).

``HOROVOD_TOPK_SELECTION=device`` (or ``triton``, ``fused``, ``reference``) forces a backend whatever the
tensor's device (the fused one only for CPU tensors; ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``, set
before Triton is first imported in the process): that is how the device paths are tested on the CPU.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..core.payload import PayloadLayout
from ..core.policy import sample_size
from . import device_select, encoding, ops

__all__ = ["Backend", "ReferenceBackend", "FusedBackend", "DeviceBackend", "TritonBackend", "backend_for",
           "select_seconds_per_entry", "ENV", "compress_tensor", "decompress_tensor", "triton_backend", "on_device"]

ENV = "HOROVOD_TOPK_SELECTION"
Count = Union[int, torch.Tensor]  # a 0-dim device tensor where reading the count would synchronise


@functools.lru_cache(maxsize=None)
def dtype_token(dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``dtype``: how the kernels are told a dtype (made once per dtype)."""
    return torch.empty(0, dtype=dtype)


class Backend:
    """How one tensor is compressed into a payload and how the gathered payloads become its dense reduction."""

    name = "base"

    def compress(
        self, flat: torch.Tensor, residual: torch.Tensor, momentum_buffer: Any, momentum: float,
        layout: PayloadLayout, wire_dtype: torch.dtype, sample_size: int, step: int,
    ) -> Tuple[torch.Tensor, Count]:
        """Compensate ``residual`` with the gradient ``flat``, select ``layout.k`` entries and pack them.
        Returns (payload uint8 of ``layout.nbytes``, 1 if the gradient had NaN/Inf entries else 0)."""
        raise NotImplementedError

    def decompress(
        self, gathered: torch.Tensor, world_size: int, layout: PayloadLayout, value_dtype: torch.dtype,
        scale: float, out: torch.Tensor,
    ) -> None:
        """Write the sum of the ``world_size`` payloads in ``gathered``, times ``scale``, over ``out`` (flat)."""
        indices, values = ops.unpack(gathered, world_size, layout, value_dtype)
        out.copy_(ops.scatter_sum(indices, values * scale, out.numel(), ops.residual_dtype(out.dtype)))


class ReferenceBackend(Backend):
    name = "reference"

    def compress(self, flat, residual, momentum_buffer, momentum, layout, wire_dtype, sample_size, step):
        selection = ops.compensate_nonfinite(flat, residual, layout.k, wire_dtype, momentum_buffer, momentum)
        nonfinite = selection is not None
        if selection is None:
            selection = ops.compensate_and_select(flat, residual, layout.k, wire_dtype, momentum_buffer, momentum)
        return ops.pack(*selection, layout), int(nonfinite)


class DeviceBackend(Backend):
    name = "device"

    def compress(self, flat, residual, momentum_buffer, momentum, layout, wire_dtype, sample_size, step):
        indices, values, nonfinite = device_select.compensate_and_select(
            flat, residual, layout.k, wire_dtype, momentum_buffer, momentum
        )
        return ops.pack(indices, values, layout), nonfinite

    def decompress(self, gathered, world_size, layout, value_dtype, scale, out):
        if out.dtype != ops.residual_dtype(out.dtype):  # half precision: sum in float32, as the reference does
            super().decompress(gathered, world_size, layout, value_dtype, scale, out)
            return
        # in place: no N-sized temporary and one pass less than building the sum aside and copying it over
        indices, values = ops.unpack(gathered, world_size, layout, value_dtype)
        out.zero_().index_add_(0, indices.reshape(-1), (values * scale).reshape(-1).to(out.dtype))


class FusedBackend(Backend):
    name = "fused"

    def __init__(self, kernels: Any) -> None:
        self._kernels = kernels

    def compress(self, flat, residual, momentum_buffer, momentum, layout, wire_dtype, sample_size, step):
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        first_count = self._kernels.compress(
            residual, flat, momentum_buffer, momentum, layout.k, layout.values_offset, payload,
            dtype_token(wire_dtype), sample_size, step,
        )[0]
        return payload, int(first_count < 0)

    def decompress(self, gathered, world_size, layout, value_dtype, scale, out):
        # zeroes ``out`` (the gradient, which compress only read) and adds the payloads in
        self._kernels.decompress(gathered, world_size, layout.k, layout.values_offset, layout.nbytes,
                                 dtype_token(value_dtype), scale, out)

    def compress_group(
        self, flats: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor],
        momentum_buffers: Optional[Sequence[torch.Tensor]], momentum: float, layouts: Sequence[PayloadLayout],
        wire_dtype: torch.dtype, steps: Sequence[int],
    ) -> Tuple[torch.Tensor, List[int]]:
        """:meth:`compress` for a bucket's members in one call (plain layouts, one wire dtype): their payloads
        back to back in one buffer, and each member's non-finite flag. Why: on the CPU the Python around each
        member's kernel call (a payload allocated, arguments converted, a concatenation after) cost ~60 us a
        member, a tenth of a ResNet-50 synchronize() (docs/performance.md)."""
        payload = torch.empty(sum(layout.nbytes for layout in layouts), dtype=torch.uint8)
        first = self._kernels.compress_group(
            list(residuals), list(flats), list(momentum_buffers or ()), momentum, [layout.k for layout in layouts],
            [layout.values_offset for layout in layouts], [layout.nbytes for layout in layouts], payload,
            dtype_token(wire_dtype), [sample_size(layout.k, f.numel()) for layout, f in zip(layouts, flats)],
            list(steps),
        )
        return payload, [int(count < 0) for count in first]

    def decompress_group(self, rows: torch.Tensor, layouts: Sequence[PayloadLayout], value_dtype: torch.dtype,
                         scale: float, outs: Sequence[torch.Tensor]) -> None:
        """:meth:`decompress` for every member of :meth:`compress_group`'s payload: ``rows`` holds P rows of
        their payloads (a view of the bucket's gathered buffer: nothing is cut out and copied per member)."""
        self._kernels.decompress_group(rows, [layout.k for layout in layouts],
                                       [layout.values_offset for layout in layouts],
                                       [layout.nbytes for layout in layouts], dtype_token(value_dtype), scale,
                                       list(outs))


class TritonBackend(Backend):
    """triton_select for one tensor at a time (a group of one, its layout made once per size and k), so that
    Horovod's per-tensor hooks and collectives stay as they are; device_select for what it does not cover."""

    name = "triton"

    def __init__(self, module: Any) -> None:
        self._kernels = module
        self._groups: Dict[Tuple[int, PayloadLayout, torch.device], Any] = {}

    @property
    def kernels(self) -> Any:
        """The triton_select module (torch.bucket_select runs its kernels over whole buckets)."""
        return self._kernels

    def _group(self, numel: int, layout: PayloadLayout, device: torch.device) -> Any:
        key = (numel, layout, device)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = self._kernels.GroupLayout((numel,), (layout,), device)
        return group

    def compress(self, flat, residual, momentum_buffer, momentum, layout, wire_dtype, sample_size, step):
        if not self._kernels.supports(flat, residual, layout, wire_dtype, momentum_buffer):
            return _DEVICE.compress(flat, residual, momentum_buffer, momentum, layout, wire_dtype, sample_size, step)
        group = self._group(flat.numel(), layout, flat.device)
        with on_device(flat.device):  # Triton launches on the current device: make it the tensor's
            payload, nonfinite = self._kernels.compensate_and_select(flat, residual, group, wire_dtype)
        return payload, nonfinite[0]

    def decompress(self, gathered, world_size, layout, value_dtype, scale, out):
        if out.dtype != torch.float32 or layout.compact or value_dtype not in self._kernels.WIRE_DTYPES:
            _DEVICE.decompress(gathered, world_size, layout, value_dtype, scale, out)
            return
        rows = gathered.view(world_size, layout.nbytes)
        with on_device(out.device):
            self._kernels.accumulate(list(rows), self._group(out.numel(), layout, out.device), value_dtype, scale, out)


def on_device(device: torch.device) -> Any:
    """``torch.cuda.device(device)`` for a CUDA device, else nothing (the interpreter runs on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_REFERENCE = ReferenceBackend()
_DEVICE = DeviceBackend()


@functools.lru_cache(maxsize=1)
def _triton() -> Backend:
    """The Triton backend, or the device one where Triton cannot be imported."""
    try:
        from . import triton_select
    except ImportError:
        return _DEVICE
    return TritonBackend(triton_select)


def triton_backend() -> Optional[TritonBackend]:
    """The Triton backend, or None where Triton cannot be imported."""
    backend = _triton()
    return backend if isinstance(backend, TritonBackend) else None


@functools.lru_cache(maxsize=1)
def _fused() -> Backend:
    from . import kernels

    module = kernels.load()
    return _REFERENCE if module is None else FusedBackend(module)


def backend_for(tensor: torch.Tensor, selector: str) -> Backend:
    """The backend for a gradient on ``tensor``'s device with the configured ``selector`` (see the module
    docstring; ``HOROVOD_TOPK_SELECTION`` overrides it)."""
    forced = os.environ.get(ENV, "").strip().lower()
    on_cpu = tensor.device.type == "cpu"
    if forced:
        if forced == "device":
            return _DEVICE
        if forced == "reference":
            return _REFERENCE
        if forced == "triton":
            if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"horovod-topk: {ENV}=triton on CPU tensors runs Triton's interpreter: set "
                                 "TRITON_INTERPRET=1 before the process starts")
            return _triton()
        if forced == "fused" and on_cpu:
            return _fused()
        if forced != "fused":
            raise ValueError(f"horovod-topk: {ENV}={forced!r} is not one of 'device', 'triton', 'fused', "
                             "'reference'")
    if selector != "sampled":
        return _REFERENCE
    if on_cpu:
        return _fused()
    return _triton() if tensor.device.type == "cuda" else _DEVICE


def compress_tensor(
    backend: Backend, flat: torch.Tensor, residual: torch.Tensor, momentum_buffer: Any, momentum: float,
    layout: PayloadLayout, wire_dtype: torch.dtype, step: int,
) -> Tuple[torch.Tensor, Count]:
    """One tensor's error feedback, selection and payload under ``layout`` (plain or compact): the backend writes
    the plain layout and the compact options re-encode its pairs (float8 values are selected exactly; the encoder
    puts float8's rounding back into the residual). Returns (payload, 1 if the gradient had NaN/Inf else 0)."""
    select_dtype = torch.float32 if layout.scaled else wire_dtype
    plain = PayloadLayout(layout.k, dtype_token(select_dtype).element_size()) if layout.compact else layout
    # A gradient's NaN/Inf entries are sent as such and never enter residual or momentum buffer, on every
    # backend: see compress_impl in csrc/topk_kernels.cpp and ops.compensate_nonfinite.
    payload, nonfinite = backend.compress(flat, residual, momentum_buffer, momentum, plain, select_dtype,
                                          sample_size(layout.k, flat.numel()), step)
    if layout.compact:
        indices, values = ops.unpack(payload, 1, plain, select_dtype)
        payload = encoding.encode(indices[0], values[0], residual, layout)
    return payload, nonfinite


def decompress_tensor(
    backend: Backend, gathered: torch.Tensor, world_size: int, layout: PayloadLayout, value_dtype: torch.dtype,
    scale: float, flat: torch.Tensor,
) -> None:
    """Write the sum of the ``world_size`` payloads in ``gathered`` (each rank's, back to back) times ``scale``
    over ``flat``: the wire encoding decides how they are read, the backend how they are added."""
    if layout.compact:
        indices, values = encoding.decode(gathered, world_size, layout, value_dtype)
        flat.copy_(ops.scatter_sum(indices, values * scale, flat.numel(), ops.residual_dtype(flat.dtype)))
    else:
        backend.decompress(gathered, world_size, layout, value_dtype, scale, flat)


def select_seconds_per_entry(numel: int, device: torch.device, selector: str) -> float:
    """Host seconds per entry of one compress of ``numel`` random entries at ratio 0.01 with ``selector``'s backend
    on ``device``: best of 3 (synchronised on a GPU: it runs once per ratio="auto" decision, not per step). What
    every front end's link probes time a selection with (torch.auto_density for Horovod, torch.ddp_auto for DDP)."""
    flat = torch.randn(numel, device=device)
    residual = torch.zeros(numel, device=device)
    k = max(1, math.ceil(0.01 * numel))
    layout = PayloadLayout(k, 4)
    backend = backend_for(flat, selector)
    best = math.inf
    for step in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        backend.compress(flat, residual, None, 0.0, layout, torch.float32, sample_size(k, numel), step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
        residual.zero_()
    return best / numel
