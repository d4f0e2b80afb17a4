"""ratio="auto" in a traced TensorFlow step: the stamps its decisions measure the exposed wait from
(tensorflow.auto_density.AutoTick) sit where they must in the graph. Every gradient's ready stamp runs after the
step's tick (else the tick reads a mix of two steps' stamps) and waits for no reduction (TensorFlow runs
timestamps in program order, so a ready stamp made after a bucket's done stamp waits for that bucket's
collectives). Either mistake makes the wait read ~0 over a slow link, so that auto takes every step for compute and
stays dense where fp16 and 0.01 are 0.5-0.7x dense's step (docs/auto-density.md)."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_topk.tensorflow import TopKEF


def _closure(op, within):
    """Every op of graph ``within`` that ``op`` waits for (data and control inputs), transitively."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for dep in [t.op for t in current.inputs] + list(current.control_inputs):
            if dep.graph is within and dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def test_every_ready_stamp_follows_the_tick_and_waits_for_no_reduction():
    hvd.init()
    widths = [16, 32, 32, 32, 10]
    layers = [tf.keras.layers.Dense(w) for w in widths]
    x = tf.constant(np.ones((4, 8), np.float32))
    compressor = TopKEF(ratio="auto", bucket_bytes=5000)  # several buckets: one reduction after another

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for layer in layers:
                h = layer(h)
            loss = tf.reduce_sum(h * h)
        tape = hvd.DistributedGradientTape(tape, compression=compressor)
        return tape.gradient(loss, [v for layer in layers for v in layer.trainable_variables])

    outer = step.get_concrete_function().graph
    ticks = [op for op in outer.get_operations() if op.type == "EagerPyFunc" and "topk_auto_tick" in op.name]
    assert len(ticks) == 1
    # the reductions are built in Horovod's tf.cond: find the branch that holds the stamps, and the tick in it
    branch, tick_inside = None, None
    for op in outer.get_operations():
        if op.type not in ("If", "StatelessIf"):
            continue
        for fn in outer._functions.values():
            graph = getattr(fn, "graph", None)
            if graph is None or not any(o.type == "Timestamp" for o in graph.get_operations()):
                continue
            for outer_input, inner in zip(op.inputs[1:], graph.inputs):
                if outer_input.op is ticks[0]:
                    branch, tick_inside = graph, inner.op
    assert branch is not None, "no branch with stamps that takes the tick"
    stamps = [op for op in branch.get_operations() if op.type == "Timestamp"]
    reductions = {op for op in branch.get_operations() if op.type in ("Case", "StatelessCase", "If", "StatelessIf")}
    assert len(reductions) >= 2, "the test needs several buckets"
    ready = [op for op in stamps if not reductions & _closure(op, branch)]
    done = [op for op in stamps if reductions & _closure(op, branch)]
    stamped = len(compressor._auto_tick._stamps)
    assert len(ready) == stamped and len(done) == stamped, (len(ready), len(done), stamped)
    for op in ready:
        assert tick_inside in _closure(op, branch), f"{op.name} does not wait for the tick"
