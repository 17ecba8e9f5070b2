"""Declares the ``triton`` backend (entry point ``cpkv.backends: triton``).

Importing this module imports neither triton nor torch; the probe looks them up when called.
"""

from __future__ import annotations

import importlib.util

from cpkv.contracts import Availability
from cpkv.plugin import BackendRegistrar, BackendSpec, hookimpl

NAME = "triton"
NOT_IMPLEMENTED = "kernels not implemented yet (issue #5)"


def _cuda_device_missing() -> str | None:
    try:
        import torch
    except Exception as exc:  # a broken torch install is a reason, not a crash
        return f"torch cannot be imported ({exc!r}), so no CUDA device can be used"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def _reasons() -> list[str]:
    reasons: list[str] = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    if (why := _cuda_device_missing()) is not None:
        reasons.append(why)
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
    raise RuntimeError(f"the triton backend cannot be loaded: {'; '.join(_reasons())}")


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=frozenset(), probe=probe, load=load,
                              description="Triton GPU kernels"))
