"""Save and restore the error-feedback state of *all* ranks in one checkpoint (TensorFlow).

    state = gather_state(compressor)          # every rank calls it (eagerly); a dict on rank 0, None elsewhere
    if hvd.rank() == 0:
        with open(path, "wb") as f: pickle.dump(state, f)      # residuals are numpy arrays
    ...
    restore_state(compressor, state_on_rank_0_or_None)         # every rank calls it

Same policy as PyTorch (horovod_topk.core.checkpoint): exact on the same number of workers, mass-preserving on
another. Residuals travel with Horovod's alltoall, received by the root only. Uses the global process set.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import tensorflow as tf

from ..core import checkpoint as core

__all__ = ["gather_state", "restore_state"]


class _TensorFlowTransport(core.ObjectCollectives):
    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        super().__init__(hvd)

    def describe(self, value: np.ndarray) -> Dict[str, Any]:
        return {"numel": int(np.size(value)), "dtype": np.asarray(value).dtype.name}

    def _alltoall(self, send: np.ndarray, counts: Dict[int, int], key: str) -> np.ndarray:
        splits = tf.constant([counts.get(r, 0) for r in range(self.size)], tf.int32)
        out = self.hvd.alltoall(tf.constant(send), splits=splits, name=key, ignore_name_scope=True)
        return np.array((out[0] if isinstance(out, (tuple, list)) else out).numpy(), copy=True)

    def gather(self, value: np.ndarray, root: int, key: str) -> Optional[List[np.ndarray]]:
        flat = np.asarray(value).reshape(-1)
        received = self._alltoall(flat, {root: flat.size}, f"topk.ckpt.g.{key}")
        return list(received.reshape(self.size, -1)) if self.rank == root else None

    def scatter(self, values: Optional[List[np.ndarray]], root: int, key: str, like: Mapping[str, Any]) -> np.ndarray:
        dtype = np.dtype(like["dtype"])
        if self.rank == root:
            assert values is not None
            send = np.concatenate([np.asarray(v, dtype).reshape(-1) for v in values])
            counts = {r: int(np.size(v)) for r, v in enumerate(values)}
        else:
            send, counts = np.zeros(0, dtype), {}
        return self._alltoall(send, counts, f"topk.ckpt.s.{key}")

    def broadcast(self, value: Optional[np.ndarray], root: int, key: str, like: Mapping[str, Any]) -> np.ndarray:
        dtype = np.dtype(like["dtype"])
        send = np.asarray(value, dtype).reshape(-1) if value is not None else np.zeros(like["numel"], dtype)
        out = self.hvd.broadcast(tf.constant(send), root_rank=root, name=f"topk.ckpt.b.{key}", ignore_name_scope=True)
        return np.array(out.numpy(), copy=True)

    def mean(self, values: List[np.ndarray], factor: float) -> np.ndarray:
        total = np.zeros(np.size(values[0]), np.float64)
        for v in values:
            total += np.asarray(v, np.float64).reshape(-1)
        return (total * (factor / len(values))).astype(np.asarray(values[0]).dtype)


def gather_state(compressor: Any, root_rank: int = 0) -> Optional[Dict[str, Any]]:
    """Collective (call eagerly): all ranks' TopKEF state in one dict on ``root_rank``, None on the others."""
    return core.gather_state(core.resolve_compressor(compressor), _TensorFlowTransport(), root_rank)


def restore_state(
    compressor: Any, checkpoint: Optional[Mapping[str, Any]], root_rank: int = 0, reduction: str = "average"
) -> None:
    """Collective (call eagerly): every rank gets its share of a :func:`gather_state` checkpoint held by
    ``root_rank``; ``reduction`` ("average" or "sum") is the reduction op, for a different number of workers."""
    core.restore_state(core.resolve_compressor(compressor), checkpoint, _TensorFlowTransport(), root_rank, reduction)
