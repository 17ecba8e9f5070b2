"""Triton kernel modules for the tests: compiled for the GPU when there is a CUDA device, else
run by Triton's CPU interpreter (``TRITON_INTERPRET=1``); and kernels compiled for Hopper on the
CPU: :func:`compile_script` runs a script that compiles them, :func:`ptxas_report` gives the
registers and spills of a kernel's PTX.

``triton.jit`` reads the variable when a kernel is defined and the interpreter again at launch;
so :func:`import_kernels` sets it only around the import (re-importing a module imported
earlier without it), and :func:`interpreter_env` around a module's tests, so that it never
leaks into the session (subprocesses would pick the interpreter, and the triton backend's probe
reads it).
"""

from __future__ import annotations

import importlib
import json
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

__all__ = ["CUDA", "SM90_PRELUDE", "assert_op_mixed_in", "bin_values", "compile_script",
           "import_kernels", "interp", "interpreter_env", "needs_bundled_ptxas", "ptxas_report"]

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


#: the prelude of :func:`compile_script`'s scripts: ``sm90(fn, ptrs, const, aligned, source,
#: **options)`` compiles kernel ``fn`` for Hopper: ``ptrs`` its pointer arguments' types, the
#: other arguments i32 unless ``const`` gives their value, those named in ``aligned``
#: specialised as multiples of 16 (as a real launch's 16-byte aligned tensors and strides are);
#: names the kernel does not have are passed over
SM90_PRELUDE = r"""
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def sm90(fn, ptrs, const, aligned, source=ASTSource, **options):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in names}
    src = source(fn=fn, signature=sig,
                 constexprs={(names.index(k),): v for k, v in const.items() if k in names},
                 attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned
                        if n in names})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
"""


def compile_script(script: str) -> dict[str, Any]:
    """``script`` after :data:`SM90_PRELUDE`, run in a fresh interpreter without
    ``TRITON_INTERPRET`` (the compiler cannot take the interpreted kernels other test modules
    import): its last stdout line as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    proc = subprocess.run([sys.executable, "-c", SM90_PRELUDE + script], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def needs_bundled_ptxas() -> None:
    """Skip the calling test when this Triton has no bundled ptxas (it compiles no PTX here)."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip(f"this Triton has no bundled ptxas ({ptxas})")
