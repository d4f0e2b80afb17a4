"""The digits data set shared by the PyTorch and Keras examples: scikit-learn's 1,797 8x8 handwritten digits
(shipped with scikit-learn, no download), a fixed stratified 80/20 split, and each worker's shard."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load_split(seed: int, rank: int, size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train shard of this worker, y_train shard, x_test, y_test); images as float32 (N, 8, 8) in [0, 1]."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )
    return x_train[rank::size], y_train[rank::size].astype(np.int64), x_test, y_test.astype(np.int64)


def ratio_arg(text: str) -> Union[float, str]:
    """A ratio in (0, 1], or "auto"."""
    return text if text == "auto" else float(text)


def method_label(args: argparse.Namespace) -> str:
    """What a run is called in its lines and summary."""
    if args.dense:
        return "dense allreduce"
    return f"TopKEF(ratio={args.ratio!r})" if args.ratio == "auto" else f"TopKEF(ratio={args.ratio:g})"


def summary_ratio(args: argparse.Namespace, compressor: Any) -> Union[float, str, None]:
    """The ratio a summary records: None for dense; with "auto", "auto (<density in force at the end>)", which
    the demo's advisor part leaves out (its prediction is for one fixed ratio)."""
    if args.dense:
        return None
    if args.ratio == "auto":
        chosen = compressor.auto.ratio
        return f"auto ({'dense' if chosen is None else f'{chosen:g}'})"
    return args.ratio


def parse_args(description: str) -> argparse.Namespace:
    """The command line both examples share."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ratio", type=ratio_arg, default=0.01,
                        help="TopKEF ratio, or 'auto': chosen from the job's own measurements")
    parser.add_argument("--dense", action="store_true", help="plain Horovod allreduce instead of TopKEF")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", metavar="PATH", help="rank 0 writes the run's numbers there as JSON "
                        "(per-epoch loss, accuracy and training time, bytes handed to collectives, wall time; scripts/demo.sh)")
    return parser.parse_args()


def step_seconds(history: List[Dict[str, float]]) -> Optional[float]:
    """Training time per step: the median over epochs of each epoch's training time (evaluation excluded) divided
    by its steps, leaving out the first epoch when there are others (it includes one-time costs: tracing, kernel
    loading, Horovod's first negotiation)."""
    epochs = [h for h in history if h.get("steps")]
    if len(epochs) > 1:
        epochs = epochs[1:]
    if not epochs:
        return None
    per_step = sorted(h["train_s"] / h["steps"] for h in epochs)
    mid = len(per_step) // 2
    return per_step[mid] if len(per_step) % 2 else (per_step[mid - 1] + per_step[mid]) / 2


def write_summary(path: Optional[str], framework: str, method: str, history: List[Dict[str, float]],
                  bytes_sent: float, bytes_dense: float, wall_s: float, *, ratio: Union[float, str, None] = None,
                  tensors: Optional[List[int]] = None) -> None:
    """The numbers scripts/demo_report.py compares (rank 0 only). ``ratio``: TopKEF's (None for dense);
    ``tensors``: each trainable tensor's number of elements (the advisor's model of this network)."""
    if not path:
        return
    with open(path, "w") as out:
        json.dump({"framework": framework, "method": method, "history": history,
                   "final_accuracy": history[-1]["accuracy"] if history else None,
                   "bytes_sent": bytes_sent, "bytes_dense": bytes_dense, "wall_s": wall_s,
                   "step_s": step_seconds(history), "ratio": ratio, "tensors": tensors}, out, indent=1)
