"""Declares the ``triton`` backend (entry point ``cpkv.backends: triton``).

Importing this module imports neither triton nor torch; neither does listing the ops: the ops are
the methods, named like a :class:`~cpkv.contracts.Op`, that the kernel modules (``kv.py``,
``attention.py``) define, read from their source without importing them. ``load`` imports them
(``ops.TritonOps``) and checks that every listed op is there.
"""

from __future__ import annotations

import ast
import importlib.util
import os

from cpkv.contracts import Availability, Op
from cpkv.plugin import BackendRegistrar, BackendSpec, hookimpl

NAME = "triton"
#: the kernel modules, each providing one mixin of ``TritonOps``
KERNEL_MODULES: tuple[str, ...] = ("kv", "attention")
_OP_NAMES = frozenset(o.value for o in Op)


def _module_ops(module: str) -> frozenset[Op]:
    """The ops ``cpkv_backend_triton.<module>`` defines as methods of its top-level classes;
    empty when the module is not there or its source does not parse."""
    try:
        spec = importlib.util.find_spec(f"{__package__}.{module}")
    except (ImportError, ValueError):
        return frozenset()
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return frozenset()
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=spec.origin)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    names = {item.name for node in tree.body if isinstance(node, ast.ClassDef)
             for item in node.body if isinstance(item, ast.FunctionDef)}
    return frozenset(Op(n) for n in names & _OP_NAMES)


def kernel_ops() -> frozenset[Op]:
    """Every op the kernel modules present here provide."""
    ops: frozenset[Op] = frozenset()
    for m in KERNEL_MODULES:
        ops |= _module_ops(m)
    return ops


def _cuda_device_missing() -> str | None:
    try:
        import torch
    except Exception as exc:  # a broken torch install is a reason, not a crash
        return f"torch cannot be imported ({exc!r}), so no CUDA device can be used"
    if not torch.cuda.is_available():
        return ("no CUDA device (torch.cuda.is_available() is False) and TRITON_INTERPRET=1 is "
                "not set (the Triton interpreter runs the kernels on the CPU)")
    return None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _reasons() -> list[str]:
    reasons: list[str] = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    if not _interpret() and (why := _cuda_device_missing()) is not None:
        reasons.append(why)
    if not kernel_ops():
        reasons.append(f"no kernel module ({', '.join(m + '.py' for m in KERNEL_MODULES)}) "
                       f"provides an op")
    return reasons


def probe() -> Availability:
    """Available when triton is installed, a kernel module provides an op, and a CUDA device is
    present or ``TRITON_INTERPRET=1`` is set. Every check runs; an unavailable result names all
    the failing ones, joined by "; "."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> object:
    """The ``TritonOps`` object.

    Raises:
        RuntimeError: the backend is unavailable here (the probe's reasons), or a listed op is
            missing because its kernel module failed to import (the import error is named).
    """
    reasons = _reasons()
    if reasons:
        raise RuntimeError(f"the triton backend cannot be loaded: {'; '.join(reasons)}")
    from .ops import IMPORT_ERRORS, TritonOps

    impl = TritonOps()
    missing = sorted(o.value for o in kernel_ops() if not callable(getattr(impl, o.value, None)))
    if missing:
        raise RuntimeError(f"the triton backend lists {missing} but does not have them: kernel "
                           f"module import errors {IMPORT_ERRORS}")
    return impl


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=kernel_ops(), probe=probe, load=load,
                              description="Triton GPU kernels", page_sizes=None))
