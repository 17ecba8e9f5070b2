"""Declares the ``cuda`` backend (entry point ``cpkv.backends: cuda``).

Importing this module imports no torch and builds nothing; kernels will be compiled lazily with
nvcc on first load, so the probe checks for a compiler and a device.

There are no kernels yet (the first planned: FlashMLA's sparse MLA, docs/perf.md), so the probe
always says no and the backend is not in the default preference (``["triton", "torch"]``); it
joins it, first, once it has kernels. Until then it is tried only when a settings file names it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cpkv.contracts import Availability
from cpkv.plugin import BackendRegistrar, BackendSpec, hookimpl

NAME = "cuda"
NOT_IMPLEMENTED = "no kernels yet (the first planned: a TMA sparse-MLA kernel, docs/perf.md)"


def _nvcc_missing() -> str | None:
    if shutil.which("nvcc"):
        return None
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return None
    if home:
        return f"nvcc not found on PATH nor in CUDA_HOME={home!r}/bin"
    return "nvcc not found on PATH and CUDA_HOME is not set (the CUDA toolkit is needed to build)"


def _cuda_device_missing() -> str | None:
    try:
        import torch
    except Exception as exc:  # a broken torch install is a reason, not a crash
        return f"torch cannot be imported ({exc!r}), so no CUDA device can be used"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def _reasons() -> list[str]:
    reasons = [r for r in (_nvcc_missing(), _cuda_device_missing()) if r is not None]
    reasons.append(NOT_IMPLEMENTED)
    return reasons


def probe() -> Availability:
    """Every check runs; an unavailable result names all the failing ones, joined by "; "."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> object:
    """Raises:
        RuntimeError: always for now, with the probe's reason (no kernels yet).
    """
    raise RuntimeError(f"the cuda backend cannot be loaded: {'; '.join(_reasons())}")


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=frozenset(), probe=probe, load=load,
                              description="custom CUDA kernels, built lazily on first use"))
