"""The names of the allgathers a TensorFlow step builds (Horovod's own allgather, called through): which collectives
a bucketed or per-tensor exchange issues, for the multi-worker TensorFlow and Keras 3 tests."""
from typing import Any, List


def record_allgathers(monkeypatch: Any) -> List[str]:
    """Start recording the name of every allgather built from now on (until ``monkeypatch`` undoes it)."""
    import horovod.tensorflow.mpi_ops as mpi_ops

    names: List[str] = []
    original = mpi_ops.allgather

    def recording(tensor: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
        names.append(name)
        return original(tensor, name, *args, **kwargs)

    monkeypatch.setattr(mpi_ops, "allgather", recording)
    return names


def topk_exchanges(names: List[str]) -> List[str]:
    """The compressed exchanges' allgathers among ``names`` (not the agreement checks'), each once, sorted."""
    return sorted({n for n in names if n and n.startswith("topk.") and not n.startswith("topk.check")})
