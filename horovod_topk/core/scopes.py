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
names is claimed by *another* live parameter; scope 0 has no prefix (a single optimizer, or optimizers whose names
do not overlap, keep their plain names), scope i > 0 has ``optimizer<i>/``. Wrapping the same parameters again
joins their own scope. A scope whose parameters were all garbage-collected (a model rebuilt in a notebook or a
sweep) is reused, and the state left under its names is dropped with it, so it is neither inherited nor leaked.
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

    def assign(self, parameters: Iterable[Tuple[str, Any]], forget: Callable[[str], None]) -> str:
        """The prefix for an optimizer of ``parameters`` ((name, parameter) pairs); claims their names.

        ``forget(full_name)`` is called for every name whose parameter is gone when the name is claimed again (or
        its whole scope is reused), to drop the state left under it.
        """
        params = [(name, param) for name, param in parameters]
        for index, claims in enumerate(self._claims):
            if all(ref() is None for ref in claims.values()):  # every parameter of this scope is gone
                for name in claims:
                    forget(scope_prefix(index) + name)
                claims.clear()
            if all(_free_for(claims, name, param) for name, param in params):
                break
        else:
            index = len(self._claims)
            self._claims.append({})
        claims = self._claims[index]
        for name, param in params:
            if name in claims and claims[name]() is not param:  # its parameter is gone: so is what it left
                forget(scope_prefix(index) + name)
            claims[name] = _reference(param)
        return scope_prefix(index)


def _free_for(claims: Dict[str, Callable[[], Any]], name: str, param: Any) -> bool:
    """Whether ``name`` is unclaimed in a scope, or claimed by ``param`` itself or by a parameter now gone."""
    ref = claims.get(name)
    if ref is None:
        return True
    held = ref()
    return held is None or held is param  # identity: tensors compare elementwise


def _reference(obj: Any) -> Callable[[], Any]:
    """A weak reference when the object allows one (framework parameters do), else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
