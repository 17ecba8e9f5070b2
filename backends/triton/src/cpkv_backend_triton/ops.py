"""``TritonOps``: the object the ``triton`` backend loads, its parts composed; each op of
:data:`.parts.PART_OPS` is the bound method of its part named as the op. Each part's module is
imported on its own: one that cannot be (``ImportError``) leaves its class None in
:data:`KERNELS` and its error in :data:`IMPORT_ERRORS`; ``plugin.load`` checks
:attr:`TritonOps.provided` against :data:`.parts.OPS`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cpkv.ops.api import Op, OpMethods

from .parts import PART_OPS

if TYPE_CHECKING:
    from .attention import AttentionKernels
    from .kv import KVKernels
    from .norm import NormKernels
    from .quant import QuantKernels
    from .rope import RopeKernels


__all__ = ["IMPORT_ERRORS", "KERNELS", "TritonOps"]

#: kernel module name -> repr of the ImportError that kept its part out
IMPORT_ERRORS: dict[str, str] = {}
_CLASSES = {"kv": "KVKernels", "attention": "AttentionKernels", "rope": "RopeKernels",
            "quant": "QuantKernels", "norm": "NormKernels"}


def _part(module: str) -> Any:
    """The kernel class of ``.<module>``, or None with the ImportError kept."""
    try:
        return getattr(importlib.import_module(f".{module}", __package__), _CLASSES[module])
    except ImportError as exc:
        IMPORT_ERRORS[module] = repr(exc)
        return None


#: each part's kernel class (None: its module did not import)
KERNELS: dict[str, Any] = {part: _part(part) for part in PART_OPS}


def _new(part: str, **kwargs: Any) -> Any:
    cls = KERNELS[part]
    return None if cls is None else cls(**kwargs)


class TritonOps(OpMethods):
    """cpkv's compute ops as Triton kernels: the bound methods of its parts, one per op (no
    forwarding layer). ``kv``, ``attention``, ``rope``, ``quant``, ``norm``: the parts; None: each
    module's default (``attention`` reading pages through ``kv``). A part whose module did not
    import stays None: its ops are not in :attr:`provided`, and looking one up raises
    AttributeError naming the import error."""

    def __init__(self, kv: KVKernels | None = None, attention: AttentionKernels | None = None,
                 rope: RopeKernels | None = None, quant: QuantKernels | None = None,
                 norm: NormKernels | None = None) -> None:
        kv = kv if kv is not None else _new("kv")
        if attention is None and kv is not None:
            attention = _new("attention", kv=kv)
        self.kv_kernels, self.attention_kernels = kv, attention
        self.rope_kernels = rope if rope is not None else _new("rope")
        self.quant_kernels = quant if quant is not None else _new("quant")
        self.norm_kernels = norm if norm is not None else _new("norm")
        parts = {"kv": kv, "attention": attention, "rope": self.rope_kernels,
                 "quant": self.quant_kernels, "norm": self.norm_kernels}
        super().__init__({op: getattr(obj, op.value) for part, obj in parts.items()
                          if obj is not None for op in PART_OPS[part]})

    def missing_reason(self, op: str) -> str:
        """The import error of the part that implements ``op``."""
        part = next(name for name, ops in PART_OPS.items() if Op(op) in ops)
        why = IMPORT_ERRORS.get(part, "its module did not import (or kv did not)")
        return f"the triton backend has no {part} kernels: {why}"
