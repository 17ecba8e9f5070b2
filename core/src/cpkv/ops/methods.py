"""``OpMethods``: a backend object made of bound methods (op -> the callable implementing it).

A backend that composes its ops from several kernel objects hands the registry their bound
methods in one mapping instead of forwarding each op by hand; the op table then calls the
kernel's method directly. A type checker cannot see which ops a mapping holds, so the backend's
``load`` returns the object as ``typing.cast(KVOps, obj)`` (what the registry asks of a backend
of a few ops, :class:`cpkv.plugin.BackendSpec`); the op table the core calls is typed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cpkv.contracts import Op

__all__ = ["OpMethods"]

_OP_NAMES = frozenset(o.value for o in Op)


class OpMethods:
    """One attribute per given op, the callable given for it (``obj.rerange is
    methods[Op.RERANGE]``); :attr:`provided` names them. An op not given raises AttributeError
    (``hasattr`` is False), its message ending with :meth:`missing_reason`.

    Args:
        methods: op -> bound method (or any callable) with the signature of the
            :class:`~cpkv.contracts.KVOps` method of that name.
    """

    def __init__(self, methods: Mapping[Op, Callable[..., Any]]) -> None:
        for op, fn in methods.items():
            if not callable(fn):
                raise TypeError(f"{type(self).__name__}: {op.value} is {fn!r}, not a callable")
            self.__dict__[op.value] = fn
        #: the ops this object has
        self.provided: frozenset[Op] = frozenset(methods)

    def missing_reason(self, op: str) -> str:
        """Why ``op`` is not here (appended to the AttributeError); override to name a cause."""
        return "not provided"

    if not TYPE_CHECKING:  # a type checker sees no op here: it is told KVOps (a cast) or nothing

        def __getattr__(self, name: str) -> Any:
            if name in _OP_NAMES:
                raise AttributeError(f"{type(self).__name__} has no op {name!r}: "
                                     f"{self.missing_reason(name)}")
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
