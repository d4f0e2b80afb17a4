"""Framework-free core of horovod-topk: configuration, per-tensor decisions, payload layout, error-feedback
registry and the state/statistics shared by the PyTorch and TensorFlow compressors.

Imports nothing beyond the standard library (tests/core/test_no_framework_imports.py checks it), so the math of
what goes on the wire can be tested and reasoned about without a framework or a process group.
"""
from .compressor import CompressorState, TopKEFBase, default_instance_method
from .config import MAX_COMPRESSED_NUMEL, TopKConfig
from .consistency import RankMismatch, check_name, fingerprint, mismatch_message
from .costmodel import Link, Prediction, predict
from .naming import allgather_name, group_member_name
from .pending import PENDING_ATTR, PendingReduction, mark, pending_of, reduction_scale, refuse_unsupported_op
from .payload import ALIGNMENT, INDEX_ITEMSIZE, PayloadLayout, PayloadSizeMismatch
from .policy import TensorPlan, plan_tensor, sample_size, selected_count
from .registry import STATE_FORMAT, ErrorFeedbackRegistry, TensorRecord

__all__ = [
    "TopKConfig",
    "MAX_COMPRESSED_NUMEL",
    "TensorPlan",
    "plan_tensor",
    "selected_count",
    "sample_size",
    "PayloadLayout",
    "PayloadSizeMismatch",
    "INDEX_ITEMSIZE",
    "ALIGNMENT",
    "allgather_name",
    "group_member_name",
    "ErrorFeedbackRegistry",
    "TensorRecord",
    "STATE_FORMAT",
    "CompressorState",
    "TopKEFBase",
    "default_instance_method",
    "PendingReduction",
    "PENDING_ATTR",
    "mark",
    "pending_of",
    "reduction_scale",
    "refuse_unsupported_op",
    "RankMismatch",
    "check_name",
    "fingerprint",
    "mismatch_message",
    "Link",
    "Prediction",
    "predict",
]
