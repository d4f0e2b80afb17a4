"""Scripted links for ratio="auto"'s multi-worker tests (PyTorch and TensorFlow): measurements a decision is made
from, the same on every rank as a function of the step, in place of the probes. The collectives, compressor and
planning stay the real ones."""
from horovod_topk.core.autodensity import CHECK_STEPS, FIRST_DECISION, Measurement

#: The decisions after the first, when each of them changes the density (or auto_every=CHECK_STEPS).
SECOND_DECISION = FIRST_DECISION + CHECK_STEPS
THIRD_DECISION = SECOND_DECISION + CHECK_STEPS
FOURTH_DECISION = THIRD_DECISION + CHECK_STEPS


def slow_link(world_size: int) -> Measurement:
    """A dense window over a 1 Mbit/s link: dense's step is 1 s, almost all of it communication."""
    return Measurement(period_s=1.0, compute_s=0.01, compress_s=0.0, latency_s=1e-4, large_s=8.0,
                       large_nbytes=1e6, select_s_per_entry=1e-9, world_size=world_size)


def sparse_slower_than_dense(world_size: int) -> Measurement:
    """A sparse window measured at 5 s per step (slower than the dense 1 s): the model missed something here."""
    return Measurement(period_s=5.0, compute_s=0.01, compress_s=0.0, latency_s=1e-4, large_s=8.0,
                       large_nbytes=1e6, select_s_per_entry=1e-9, world_size=world_size)


def much_slower_link(world_size: int) -> Measurement:
    """A dense window over a 20x slower link: 20 s per dense step, worth compressing again despite the 5 s."""
    return Measurement(period_s=20.0, compute_s=0.01, compress_s=0.0, latency_s=1e-4, large_s=160.0,
                       large_nbytes=1e6, select_s_per_entry=1e-9, world_size=world_size)


def fast_link(world_size: int) -> Measurement:
    """A dense window whose communication all hides behind compute: dense fits the budget."""
    return Measurement(period_s=1.0, compute_s=1.0, compress_s=0.0, latency_s=1e-5, large_s=1e-3,
                       large_nbytes=1e6, select_s_per_entry=1e-9, world_size=world_size)


def script(monkeypatch, probes_module, plan):
    """Replace ``probes_module.measure`` (torch.auto_density or tensorflow.auto_density) by ``plan(step)``;
    returns the steps decided at."""
    decided = []

    def measure(auto, tensors, process_set, *framework_args):
        decided.append(auto.step)
        return plan(auto.step)(process_set.size())

    monkeypatch.setattr(probes_module, "measure", measure)
    return decided


def half_link(world_size: int) -> Measurement:
    """A dense window over a 1 Mbit/s link whose communication mostly hides behind compute (5 ms of 15 exposed):
    dense misses the budget, fp16 (half its bytes) hides entirely, where the front end sends fp16."""
    return Measurement(period_s=0.015, compute_s=0.01, compress_s=0.0, latency_s=1e-4, large_s=8.0,
                       large_nbytes=1e6, select_s_per_entry=1e-9, world_size=world_size)


def int8_link(world_size: int) -> Measurement:
    """A dense window over a 1 Mbit/s link with a quarter of dense's ~0.4 s communication exposed (0.25 s of a
    0.26 s step): fp16 (half the bytes) still misses the budget, int8 (a quarter) hides entirely, where the front end
    sends int8; without it the densities are the soonest."""
    return Measurement(period_s=0.26, compute_s=0.01, compress_s=0.0, latency_s=1e-4, large_s=8.0,
                       large_nbytes=1e6, select_s_per_entry=1e-9, world_size=world_size)
