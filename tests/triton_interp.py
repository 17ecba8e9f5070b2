"""Triton kernel modules for the tests: compiled for the GPU when there is a CUDA device, else
run by Triton's CPU interpreter (``TRITON_INTERPRET=1``); and :func:`ptxas_report`, the
registers and spills of a kernel compiled for Hopper on the CPU.

``triton.jit`` reads the variable when a kernel is defined and the interpreter again at launch;
so :func:`import_kernels` sets it only around the import (re-importing a module imported
earlier without it), and :func:`interpreter_env` around a module's tests, so that it never
leaks into the session (subprocesses would pick the interpreter, and the triton backend's probe
reads it).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

__all__ = ["CUDA", "assert_op_mixed_in", "bin_values", "import_kernels", "interp", "interpreter_env",
           "ptxas_report"]

CUDA = torch.cuda.is_available()
#: a test of the interpreted kernels (with CUDA the kernels are compiled: the gpu tests run)
interp = pytest.mark.skipif(CUDA, reason="CUDA present: kernels are compiled for the GPU (the "
                                         "gpu tests cover them)")


def assert_op_mixed_in(op: Any) -> None:
    """``op`` (a :class:`cpkv.contracts.Op`) is declared by the triton plugin and a method of
    :class:`~cpkv_backend_triton.ops.TritonOps`."""
    from cpkv_backend_triton.ops import TritonOps
    from cpkv_backend_triton.plugin import OPS

    assert op in OPS
    assert callable(getattr(TritonOps(), op.value))


def bin_values(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    """n fp32 logits for the top-k selects' radix rounds: "spread" (distinct keys, few share
    16 bits), "mixed" (a quarter above 2, the rest over eight 16-bit bins at 1, each holding
    several keys: the last two rounds decide) or "clustered" (every key in one 16-bit bin)."""
    if kind == "spread":
        return torch.randn(n, generator=g) * 4
    if kind == "mixed":
        return torch.where(torch.rand(n, generator=g) < 0.25, 2 + 8 * torch.rand(n, generator=g),
                           1 + torch.randint(0, 4096, (n,), generator=g).float() / 65536)
    return 1.0 + torch.randint(0, 24, (n,), generator=g).float() / 4096


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
    ``triton.jit`` functions, checked); the calling test module is skipped without triton.
    Kernels imported earlier without the interpreter: every backend module that imports triton
    is imported again (the wrappers and the :mod:`cpkv_backend_triton.kernels` they launch)."""
    with interpreter_env():
        pytest.importorskip("triton", reason="triton is not installed")
        mod = importlib.import_module(name)
        if not CUDA and type(getattr(mod, kernel)).__name__ != "InterpretedFunction":
            light = {"cpkv_backend_triton", "cpkv_backend_triton.plugin", "cpkv_backend_triton.parts",
                     "cpkv_backend_triton.tuning"}
            for m in [m for m in sys.modules
                      if m.startswith("cpkv_backend_triton.") and m not in light]:
                del sys.modules[m]
            mod = importlib.import_module(name)
        return mod


def ptxas_report(ptx: str, tmp: Path) -> str | None:
    """``ptxas -v`` for sm_90a by the first ptxas here that reads this PTX version (Triton's own
    may be older than the PTX it writes): its report (registers, spills, warnings), or None."""
    import triton  # here, not at import: the interpreter's tests import triton under it first

    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    path = tmp / "kernel.ptx"
    path.write_text(ptx)
    for exe in (bins / "ptxas-blackwell", bins / "ptxas", Path("/usr/local/cuda/bin/ptxas")):
        if exe.is_file():
            r = subprocess.run([str(exe), "-v", "-arch=sm_90a", str(path), "-o", "/dev/null"],
                               capture_output=True, text=True, check=False)
            if r.returncode == 0:
                return r.stderr
    return None
