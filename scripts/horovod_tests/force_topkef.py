"""pytest plugin: every ``hvd.DistributedOptimizer`` built during the session gets TopKEF as its compression.

Used by run_optimizer_tests.sh to run Horovod's own optimizer tests (horovod/horovod test/parallel/test_torch.py)
against TopKEF: those tests are the semantics a user switching a job over relies on. ``FORCE_TOPKEF`` chooses what
is forced: "class" (``compression=TopKEF``, the one-argument use we advertise: ratio 0.01), "ratio1"
(``TopKEF(ratio=1.0)``, every entry sent: results must equal plain Horovod's) or "none" (plain Horovod, the
baseline that tells our failures from the test file's own).
"""
from __future__ import annotations

import os
from typing import Any

MODES = ("class", "ratio1", "none")


def pytest_configure(config: Any) -> None:
    mode = os.environ.get("FORCE_TOPKEF", "class")
    if mode not in MODES:
        raise ValueError(f"FORCE_TOPKEF must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return
    import horovod.torch as hvd

    from horovod_topk.torch import TopKEF

    original = hvd.DistributedOptimizer

    def distributed_optimizer(*args: Any, **kwargs: Any) -> Any:
        # ratio1 is the parity check with plain Horovod: gradient mode named (target="auto" would step Adam per rank)
        kwargs["compression"] = TopKEF if mode == "class" else TopKEF(ratio=1.0, target="gradient")
        return original(*args, **kwargs)

    hvd.DistributedOptimizer = distributed_optimizer
