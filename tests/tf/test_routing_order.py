"""Where horovod-topk routes Horovod's TensorFlow constructors: a ``DistributedOptimizer`` looked up before
``horovod_topk.tensorflow`` is imported (``from horovod.tensorflow.keras import DistributedOptimizer`` at the top of
a script) must still build update mode's optimizer, because both of Horovod's constructors reach the Keras factory
that the routing replaces through its module at call time. In a new process, so that nothing is imported yet."""
from tests.new_process import run_code


def test_distributed_optimizers_looked_up_before_the_package_build_update_mode():
    out = run_code("""
        import horovod.tensorflow as hvd
        from horovod.tensorflow import DistributedOptimizer as tf_distributed_optimizer
        from horovod.tensorflow.keras import DistributedOptimizer as keras_distributed_optimizer
        import tensorflow as tf
        import horovod_topk.tensorflow as ht
        hvd.init()
        for label, make in (("tf", tf_distributed_optimizer), ("keras", keras_distributed_optimizer)):
            opt = make(tf.keras.optimizers.Adam(1e-3), compression=ht.TopKEF(ratio=0.1, target="update"))
            try:
                opt.register_local_var(tf.Variable(1.0))  # update mode's optimizer refuses rank-local variables
                print(label, "update mode: False")
            except ValueError as exc:
                print(label, "update mode:", "target='update'" in str(exc))
    """)
    assert "tf update mode: True" in out and "keras update mode: True" in out, out
