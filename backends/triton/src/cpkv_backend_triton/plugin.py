"""Declares the ``triton`` backend (entry point ``cpkv.backends: triton``).

Importing this module imports neither triton nor torch. The ops are the static list :data:`OPS`,
the ops of the kernel objects (``kv.py``, ``attention.py``, ``rope.py``, ``quant.py``,
``norm.py``) that ``ops.TritonOps``
composes; ``load`` builds one and checks that every listed op is provided
(``tests/test_triton_kv.py`` checks that the list equals the ops ``TritonOps`` provides).
"""

from __future__ import annotations

import importlib.util
import os
from typing import cast

from cpkv.contracts import Availability, KVOps, Op
from cpkv.plugin import BackendRegistrar, BackendSpec, hookimpl

NAME = "triton"
#: the ops of ``kv.KVKernels``, ``attention.AttentionKernels``, ``rope.RopeKernels``,
#: ``quant.QuantKernels`` and ``norm.NormKernels``, the parts of ``TritonOps``
OPS: frozenset[Op] = frozenset({
    Op.PAGE_GATHER, Op.PAGE_SCATTER, Op.PAGE_COPY, Op.RERANGE, Op.PEER_GATHER, Op.FP8_PACK, Op.FP8_UNPACK,
    Op.INDEXER_LOGITS, Op.INDEXER_LOGITS_PAGED, Op.INDEXER_LOGITS_INDEX_PAGES, Op.TOPK,
    Op.INDEXER_TOPK, Op.SPARSE_MLA,
    Op.SPARSE_MLA_PAGED,
    Op.ROPE,
    Op.INDEX_Q_FP8,
    Op.PAGE_ROWS,
    Op.FP8_STORE,
    Op.RMS_NORM,
})


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
