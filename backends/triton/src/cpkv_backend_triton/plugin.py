"""Declares the ``triton`` backend (entry point ``cpkv.backends: triton``).

Importing this module imports neither triton nor torch. The ops are :data:`.parts.OPS`;
``load`` builds a ``TritonOps`` and checks that it has every listed op.
"""

from __future__ import annotations

import importlib.util
import os
from typing import cast

from cpkv.contracts import Availability, KVOps
from cpkv.plugin import BackendRegistrar, BackendSpec, cuda_device_missing, hookimpl

from .parts import OPS

__all__ = ["NAME", "OPS", "device_types", "load", "probe"]

NAME = "triton"
def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _reasons() -> list[str]:
    reasons: list[str] = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    if not _interpret() and (why := cuda_device_missing()) is not None:
        reasons.append(f"{why} and TRITON_INTERPRET=1 is not set (the Triton interpreter runs "
                       f"the kernels on the CPU)")
    return reasons


def device_types() -> frozenset[str]:
    """CUDA tensors; CPU tensors too under the interpreter (``TRITON_INTERPRET=1``)."""
    return frozenset({"cpu", "cuda"}) if _interpret() else frozenset({"cuda"})


def probe() -> Availability:
    """Available when triton is installed and a CUDA device is present or ``TRITON_INTERPRET=1``
    is set. Every check runs; an unavailable result names all the failing ones, joined by "; "."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> KVOps:
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
    missing = sorted(o.value for o in OPS - impl.provided)
    if missing:
        raise RuntimeError(f"the triton backend lists {missing} but does not have them: kernel "
                           f"module import errors {IMPORT_ERRORS}")
    return cast(KVOps, impl)  # its ops are bound methods (OpMethods), checked just above


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=OPS, probe=probe, load=load,
                              description="Triton GPU kernels", page_sizes=None,
                              device_types=device_types))
