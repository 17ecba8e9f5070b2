"""Declares the ``mooncake`` transfer (entry point ``cpkv.transfers: mooncake``).

Importing this module does not import mooncake; the probe only looks it up.
"""

from __future__ import annotations

import importlib.util

from cpkv.contracts import Availability
from cpkv.plugin import TransferRegistrar, TransferSpec, hookimpl

NAME = "mooncake"
NOT_INSTALLED = ("mooncake-transfer-engine not installed (pip install "
                 "mooncake-transfer-engine-non-cuda on CPU machines, ...-cuda13 on GPU)")
NOT_IMPLEMENTED = "transfer not implemented yet (issue #6)"


def _reasons() -> list[str]:
    reasons: list[str] = []
    try:
        missing = importlib.util.find_spec("mooncake") is None
    except (ImportError, ValueError):  # a broken parent package or spec counts as missing
        missing = True
    if missing:
        reasons.append(NOT_INSTALLED)
    reasons.append(NOT_IMPLEMENTED)
    return reasons


def probe() -> Availability:
    """Every check runs; an unavailable result names all the failing ones, joined by "; "."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> object:
    """Raises:
        RuntimeError: always for now, with the probe's reason (no transfer yet).
    """
    raise RuntimeError(f"the mooncake transfer cannot be loaded: {'; '.join(_reasons())}")


@hookimpl
def cpkv_register_transfers(registrar: TransferRegistrar) -> None:
    registrar.add(TransferSpec(name=NAME, probe=probe, load=load,
                               description="Mooncake Transfer Engine (RDMA/TCP)"))
