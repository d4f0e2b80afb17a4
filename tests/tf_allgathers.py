"""The names of the allgathers (and alltoalls) a TensorFlow step builds (Horovod's own collectives, called through):
which collectives a bucketed or per-tensor exchange issues, for the multi-worker TensorFlow and Keras 3 tests."""
from typing import Any, List


def _record(monkeypatch: Any, collective: str) -> List[str]:
    import functools
    import inspect

    import horovod.tensorflow.mpi_ops as mpi_ops

    names: List[str] = []
    original = getattr(mpi_ops, collective)
    signature = inspect.signature(original)  # through functools.wraps: the real one when patched twice

    @functools.wraps(original)
    def recording(*args: Any, **kwargs: Any) -> Any:
        names.append(signature.bind(*args, **kwargs).arguments.get("name"))
        return original(*args, **kwargs)

    monkeypatch.setattr(mpi_ops, collective, recording)
    return names


def record_allgathers(monkeypatch: Any) -> List[str]:
    """Start recording the name of every allgather built from now on (until ``monkeypatch`` undoes it)."""
    return _record(monkeypatch, "allgather")


def record_alltoalls(monkeypatch: Any) -> List[str]:
    """The same for every alltoall (the sparse allreduce's first phase)."""
    return _record(monkeypatch, "alltoall")


def topk_exchanges(names: List[str]) -> List[str]:
    """The compressed exchanges' allgathers among ``names`` (not the agreement checks'), each once, sorted."""
    return sorted({n for n in names if n and n.startswith("topk.")
                   and not n.startswith(("topk.check", "topk.auto."))})
