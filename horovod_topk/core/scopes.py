"""One compressor object, several distributed optimizers: which name prefix each optimizer's tensors get.

Horovod names a gradient after its parameter (``named_parameters``), and two optimizers may both have a ``weight``
(a GAN's generator and discriminator). Error-feedback state is keyed by that name, so two optimizers sharing one
TopKEF object (the class passed twice, or one object passed twice) would mix residuals, or refuse a shape. Each
optimizer is therefore given a *scope*: the prefix put in front of its tensor names, in the same object.

Why one object with scopes rather than a copy per optimizer: the user holds that object (or the class) to call
``state_dict()``, ``stats()`` and the checkpoint helpers; with scopes these still see every optimizer's state in
one place, and a checkpoint round-trips unchanged.

The rule is deterministic (every rank builds its optimizers in the same order, so every rank picks the same
prefixes, and a restarted job picks them again): an optimizer joins the first scope where none of its parameter
names is claimed by *another* parameter; scope 0 has no prefix (a single optimizer, or optimizers whose names
do not overlap, keep their plain names), scope i > 0 has ``optimizer<i>/``. Wrapping the same parameters again
joins their own scope. A claim is never released when its parameter is garbage-collected: when that happens is
up to each process's collector, and ranks that chose different prefixes would wait on collectives of different
names. A process that builds model after model (a sweep) should give each its own TopKEF object.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Tuple

__all__ = ["ScopeTable", "scope_prefix"]


def scope_prefix(index: int) -> str:
    """The prefix of scope ``index``: none for the first, ``optimizer<i>/`` for the others."""
    return "" if index == 0 else f"optimizer{index}/"


class ScopeTable:
    """The claims (parameter name -> weak reference to the parameter) of each scope of one compressor."""

    def __init__(self) -> None:
        self._claims: List[Dict[str, Callable[[], Any]]] = []

    def __len__(self) -> int:
        return len(self._claims)

    def assign(self, parameters: Iterable[Tuple[str, Any]]) -> str:
        """The prefix for an optimizer of ``parameters`` ((name, parameter) pairs); claims their names."""
        params = [(name, param) for name, param in parameters]
        for index, claims in enumerate(self._claims):
            if all(_free_for(claims, name, param) for name, param in params):
                break
        else:
            index = len(self._claims)
            self._claims.append({})
        self._claims[index].update((name, _reference(param)) for name, param in params)
        return scope_prefix(index)


def _free_for(claims: Dict[str, Callable[[], Any]], name: str, param: Any) -> bool:
    """Whether ``name`` is unclaimed in a scope, or claimed by ``param`` itself (a weak reference: a new object
    that happens to get a dead one's id is not mistaken for it)."""
    ref = claims.get(name)
    return ref is None or ref() is param  # identity: tensors compare elementwise


def _reference(obj: Any) -> Callable[[], Any]:
    """A weak reference when the object allows one (framework parameters do), else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
