"""Triton kernel modules for the tests: compiled for the GPU when there is a CUDA device, else
run by Triton's CPU interpreter (``TRITON_INTERPRET=1``).

``triton.jit`` reads the variable when a kernel is defined and the interpreter again at launch;
so :func:`import_kernels` sets it only around the import (re-importing a module imported
earlier without it), and :func:`interpreter_env` around a module's tests, so that it never
leaks into the session (subprocesses would pick the interpreter, and the triton backend's probe
reads it).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest
import torch

__all__ = ["CUDA", "import_kernels", "interpreter_env"]

CUDA = torch.cuda.is_available()


@contextmanager
def interpreter_env() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` inside (without CUDA; nothing changes with it), restored after."""
    prev = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


def import_kernels(name: str, kernel: str) -> ModuleType:
    """Module ``name`` with its kernels defined for this machine (``kernel``: one of its
    ``triton.jit`` functions, checked); the calling test module is skipped without triton."""
    with interpreter_env():
        pytest.importorskip("triton", reason="triton is not installed")
        mod = importlib.import_module(name)
        if not CUDA and type(getattr(mod, kernel)).__name__ != "InterpretedFunction":
            mod = importlib.reload(mod)  # imported before TRITON_INTERPRET was set
        return mod
