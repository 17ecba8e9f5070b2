"""Declares the ``nccl`` transfer (entry point ``cpkv.transfers: nccl``).

Importing this module does not import torch; the probe does.
"""

from __future__ import annotations

from cpkv.contracts import Availability
from cpkv.plugin import TransferRegistrar, TransferSpec, hookimpl

NAME = "nccl"


def _reasons() -> list[str]:
    reasons: list[str] = []
    try:
        import torch.distributed as dist

        if not dist.is_available():
            reasons.append("torch.distributed is not available in this torch build")
    except Exception as exc:  # a broken torch install is a reason, not a crash
        reasons.append(f"torch.distributed cannot be imported ({exc!r})")
    return reasons


def probe() -> Availability:
    """Every check runs; an unavailable result names all the failing ones, joined by "; "."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> object:
    """The transport (``cpkv.disagg.transport.Transport``).

    Raises:
        RuntimeError: torch.distributed is not usable here (the probe's reasons).
    """
    reasons = _reasons()
    if reasons:
        raise RuntimeError(f"the nccl transfer cannot be loaded: {'; '.join(reasons)}")
    from .transport import NcclTransport

    return NcclTransport()


@hookimpl
def cpkv_register_transfers(registrar: TransferRegistrar) -> None:
    registrar.add(TransferSpec(name=NAME, probe=probe, load=load,
                               description="torch.distributed point-to-point "
                                           "(NCCL on GPUs, Gloo on CPUs)"))
