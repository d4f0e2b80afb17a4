"""horovod-topk for TensorFlow 2.

    import horovod.tensorflow as hvd
    from horovod_topk.tensorflow import TopKEF
    tape = hvd.DistributedGradientTape(tape, compression=TopKEF)
    opt = hvd.DistributedOptimizer(opt, compression=TopKEF(ratio=0.001))          # legacy optimizers
    opt = horovod.tensorflow.keras.DistributedOptimizer(opt, compression=TopKEF)  # Keras 3, or Keras 2 (tf-keras)

Importing this package installs the routing of :mod:`horovod_topk.tensorflow.routing` (in memory, once), which
also adapts Horovod 0.28.1 to Keras 3 (:mod:`horovod_topk.tensorflow.keras3`).
"""
from ..core import RankMismatch, TopKConfig
from .checkpoint import gather_state, restore_state
from .compressor import TopKEF
from .routing import install as _install_routing

_install_routing()

__all__ = ["TopKEF", "TopKConfig", "RankMismatch", "gather_state", "restore_state"]
