"""Telemetry: a one-line summary every N steps through Python ``logging``, and scalars for a TensorBoard writer.

Enabled with ``TopKEF(log_every=N)`` (TopKConfig.log_every); scalars go to ``summary_writer=`` (anything with
``add_scalar(tag, value, step)``: ``torch.utils.tensorboard.SummaryWriter``, ``tensorboardX``...). The numbers are
this rank's, over the N steps since the previous report (residual norm: now). Each rank logs its own line to the
``horovod_topk`` logger at INFO: configure logging (e.g. ``logging.basicConfig(level=logging.INFO)``) on the
ranks you want to hear from, and pass a writer on rank 0 only, as with any Horovod job.

A report for step N is made when the first tensor of step N + 1 is reduced, so that it covers every tensor of
step N (the last step of a run is not reported: ``stats()`` has it). Pure Python: the compressor hands in its
``stats()`` dictionary.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional

__all__ = ["Telemetry", "LOGGER_NAME", "summary_line", "interval_scalars"]

LOGGER_NAME = "horovod_topk"

#: The scalars written to a summary writer, under ``horovod_topk/<name>``.
SCALARS = ("bytes_sent", "compression_ratio", "residual_norm", "compress_ms_per_step")


def interval_scalars(now: Mapping[str, Any], before: Mapping[str, Any], steps: int) -> Dict[str, float]:
    """The scalars of the ``steps`` steps between two ``stats()`` snapshots (cumulative counters differenced)."""
    sent = now["bytes_sent"] - before.get("bytes_sent", 0)
    dense = now["bytes_dense"] - before.get("bytes_dense", 0)
    seconds = now["compress_seconds"] - before.get("compress_seconds", 0.0)
    return {
        "bytes_sent": float(sent),
        "compression_ratio": dense / sent if sent else 1.0,
        "residual_norm": float(now["residual_norm"]),
        "compress_ms_per_step": 1e3 * seconds / max(steps, 1),
    }


def summary_line(step: int, steps: int, scalars: Mapping[str, float], rank: Optional[int] = None) -> str:
    """``horovod-topk rank 0 step 200: sent 2.04 MB in 100 steps (50.0x less than dense), residual norm 1.23,
    compress 12.3 ms/step``."""
    who = f"rank {rank} " if rank is not None else ""
    return (
        f"horovod-topk {who}step {step}: sent {scalars['bytes_sent'] / 1e6:.2f} MB in {steps} steps "
        f"({scalars['compression_ratio']:.1f}x less than dense), residual norm {scalars['residual_norm']:.4g}, "
        f"compress {scalars['compress_ms_per_step']:.2f} ms/step"
    )


class Telemetry:
    """When to report, and where to: a logger, and optionally a summary writer."""

    def __init__(self, log_every: int, writer: Any = None, logger: Optional[logging.Logger] = None) -> None:
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise ValueError(f"summary_writer must have an add_scalar(tag, value, step) method, got "
                             f"{type(writer).__name__}")
        if writer is not None and log_every == 0:
            raise ValueError("summary_writer needs log_every > 0 (how many steps between scalars)")
        self.log_every = log_every
        self.writer = writer
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        self._last_step = 0
        self._last: Dict[str, Any] = {}

    def due(self, completed_steps: int) -> bool:
        """Whether a report is due now that a tensor is about to start step ``completed_steps + 1``."""
        return (self.log_every > 0 and completed_steps > self._last_step
                and completed_steps % self.log_every == 0)

    def report(self, step: int, stats: Mapping[str, Any], rank: Optional[int] = None) -> Dict[str, float]:
        """Log the line and write the scalars for the steps since the last report; returns the scalars."""
        steps = step - self._last_step
        scalars = interval_scalars(stats, self._last, steps)
        self.logger.info(summary_line(step, steps, scalars, rank))
        if self.writer is not None:
            for name in SCALARS:
                self.writer.add_scalar(f"horovod_topk/{name}", scalars[name], step)
        self._last_step, self._last = step, dict(stats)
        return scalars

    def restart(self) -> None:
        """Forget the previous report (after a reset or a load: the counters start over)."""
        self._last_step, self._last = 0, {}
