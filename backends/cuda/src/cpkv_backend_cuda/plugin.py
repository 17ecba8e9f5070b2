"""Declares the ``cuda`` backend (entry point ``cpkv.backends: cuda``): the field's CUDA kernels.

Today that is FlashMLA's sparse MLA prefill and its fp8 sparse decode over part-major pages
(``sgl-flash-mla``, the ``cpkv[cuda]`` extra; :mod:`cpkv_backend_cuda.flashmla`). Importing
this module imports no torch and no kernel
library; the probe imports them (lazily, once) and says exactly why the backend cannot run: no
CUDA device, a compute capability other than SM90 (the legacy sparse kernels are Hopper's), or
the import error of ``flash_mla``. A call its kernel cannot take (heads, head dims, dtype, top-k)
is declined and runs on the next backend of the preference.

On a machine whose torch is older than the wheel's metadata asks (e.g. torch 2.11 where
the wheel says >= 2.14.1) install it with ``pip install --no-deps sgl-flash-mla``: it loads
through torch's stable ABI.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import cast

from cpkv.contracts import Availability, KVOps, Op
from cpkv.plugin import BackendRegistrar, BackendSpec, hookimpl

NAME = "cuda"
OPS: frozenset[Op] = frozenset({Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED})
#: compute capabilities whose FlashMLA sparse prefill kernels the wheel ships (legacy SM90 path)
CAPABILITIES = ((9, 0),)


def _cuda_device_missing() -> str | None:
    try:
        import torch
    except Exception as exc:  # a broken torch install is a reason, not a crash
        return f"torch cannot be imported ({exc!r}), so no CUDA device can be used"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability()
    if cap not in CAPABILITIES:
        return (f"compute capability {cap[0]}.{cap[1]}: FlashMLA's sparse prefill kernels here "
                f"are for {', '.join(f'{a}.{b}' for a, b in CAPABILITIES)} (Hopper)")
    return None


@functools.cache
def _flash_mla() -> ModuleType | str:
    """The imported ``flash_mla`` module, or why it cannot be used."""
    try:
        mod = importlib.import_module("flash_mla")
    except Exception as exc:
        return (f"flash_mla cannot be imported ({type(exc).__name__}: {exc}); install "
                "sgl-flash-mla (pip install 'cpkv[cuda]', or --no-deps for an older torch)")
    if not hasattr(mod, "flash_mla_sparse_fwd"):
        return "flash_mla has no flash_mla_sparse_fwd (a FlashMLA without the sparse kernels)"
    return mod


def _reasons() -> list[str]:
    why = _cuda_device_missing()
    if why is not None:
        return [why]
    mod = _flash_mla()
    return [mod] if isinstance(mod, str) else []


def probe() -> Availability:
    """Available on a Hopper GPU where ``flash_mla`` imports; otherwise the reason."""
    reasons = _reasons()
    return Availability.no("; ".join(reasons)) if reasons else Availability.yes()


def load() -> KVOps:
    """Raises:
        RuntimeError: the backend cannot run here (the probe's reason).
    """
    reasons = _reasons()
    if reasons:
        raise RuntimeError(f"the cuda backend cannot be loaded: {'; '.join(reasons)}")
    from .flashmla import FlashMLAOps

    mod = _flash_mla()
    assert isinstance(mod, ModuleType)
    return cast(KVOps, FlashMLAOps(mod))  # two ops of KVOps: only those are called


@hookimpl
def cpkv_register_backends(registrar: BackendRegistrar) -> None:
    registrar.add(BackendSpec(name=NAME, ops=OPS, probe=probe, load=load,
                              device_types=lambda: frozenset({"cuda"}),
                              description="the field's CUDA kernels (FlashMLA sparse prefill), "
                                          "imported lazily"))
