"""``TritonOps``: the object the ``triton`` backend loads, five kernel objects composed.

``TritonOps(kv=KVKernels(), attention=AttentionKernels(kv=...), rope=RopeKernels(),
quant=QuantKernels(), norm=NormKernels())``: each op is the bound method of the part
implementing it (an :class:`~cpkv.ops.api.OpMethods`). Each kernel module is imported on its
own: one that cannot be imported (``ImportError``) leaves its class None here
(:data:`KV_KERNELS`, :data:`ATTENTION_KERNELS`, :data:`ROPE_KERNELS`, :data:`QUANT_KERNELS`,
:data:`NORM_KERNELS`) and its error in :data:`IMPORT_ERRORS`, so the parts land independently
(``kv`` uses ``quant``'s fp8 helpers).
:attr:`TritonOps.provided` names the ops of the parts present; ``plugin.load`` checks it
against the plugin's static list.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cpkv.ops.api import Op, OpMethods

if TYPE_CHECKING:
    from .attention import AttentionKernels
    from .kv import KVKernels
    from .norm import NormKernels
    from .quant import QuantKernels
    from .rope import RopeKernels

__all__ = ["ATTENTION_KERNELS", "ATTENTION_OPS", "IMPORT_ERRORS", "KV_KERNELS", "KV_OPS",
           "NORM_KERNELS", "NORM_OPS", "QUANT_KERNELS", "QUANT_OPS", "ROPE_KERNELS", "ROPE_OPS", "TritonOps"]

#: kernel module name -> repr of the ImportError that kept its part out
IMPORT_ERRORS: dict[str, str] = {}

#: the ops each part implements
KV_OPS: frozenset[Op] = frozenset({Op.PAGE_GATHER, Op.PAGE_SCATTER, Op.PAGE_COPY, Op.RERANGE,
                                   Op.PEER_GATHER, Op.FP8_PACK, Op.FP8_UNPACK, Op.PAGE_ROWS,
                                   Op.FP8_STORE})
ATTENTION_OPS: frozenset[Op] = frozenset({Op.INDEXER_LOGITS, Op.INDEXER_LOGITS_PAGED,
                                          Op.INDEXER_LOGITS_INDEX_PAGES, Op.TOPK, Op.INDEXER_TOPK,
                                          Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED})
ROPE_OPS: frozenset[Op] = frozenset({Op.ROPE})
QUANT_OPS: frozenset[Op] = frozenset({Op.INDEX_Q_FP8})
NORM_OPS: frozenset[Op] = frozenset({Op.RMS_NORM})

def _part(module: str, cls: str) -> Any:
    """The kernel class ``cls`` of ``.<module>``, or None with the ImportError kept."""
    try:
        return getattr(importlib.import_module(f".{module}", __package__), cls)
    except ImportError as exc:
        IMPORT_ERRORS[module] = repr(exc)
        return None


KV_KERNELS: type[KVKernels] | None = _part("kv", "KVKernels")
ATTENTION_KERNELS: type[AttentionKernels] | None = _part("attention", "AttentionKernels")
ROPE_KERNELS: type[RopeKernels] | None = _part("rope", "RopeKernels")
QUANT_KERNELS: type[QuantKernels] | None = _part("quant", "QuantKernels")
NORM_KERNELS: type[NormKernels] | None = _part("norm", "NormKernels")


class TritonOps(OpMethods):
    """cpkv's compute ops as Triton kernels: the bound methods of its parts, one per op (no
    forwarding layer: the op table calls the kernel object's method itself).

    Args:
        kv: the KV kernels; None: a default :class:`~cpkv_backend_triton.kv.KVKernels` when its
            module imported.
        attention: the sparse-attention kernels; None: a default
            :class:`~cpkv_backend_triton.attention.AttentionKernels` reading pages through
            ``kv`` (configure precision and launches by passing your own).
        rope: the rope kernel; None: a default :class:`~cpkv_backend_triton.rope.RopeKernels`.
        quant: the index-query quantization; None: a default
            :class:`~cpkv_backend_triton.quant.QuantKernels`.
        norm: the RMSNorm; None: a default :class:`~cpkv_backend_triton.norm.NormKernels`.

    A part whose module did not import stays None: its ops are not in :attr:`provided`, and
    looking one up raises AttributeError naming the import error.
    """

    def __init__(self, kv: KVKernels | None = None, attention: AttentionKernels | None = None,
                 rope: RopeKernels | None = None, quant: QuantKernels | None = None,
                 norm: NormKernels | None = None) -> None:
        if kv is None and KV_KERNELS is not None:
            kv = KV_KERNELS()
        if attention is None and ATTENTION_KERNELS is not None and kv is not None:
            attention = ATTENTION_KERNELS(kv=kv)
        if rope is None and ROPE_KERNELS is not None:
            rope = ROPE_KERNELS()
        if quant is None and QUANT_KERNELS is not None:
            quant = QUANT_KERNELS()
        self.kv_kernels, self.attention_kernels, self.rope_kernels = kv, attention, rope
        if norm is None and NORM_KERNELS is not None:
            norm = NORM_KERNELS()
        self.quant_kernels, self.norm_kernels = quant, norm
        methods: dict[Op, Callable[..., Any]] = {}
        if kv is not None:
            methods |= {Op.PAGE_GATHER: kv.page_gather, Op.PAGE_SCATTER: kv.page_scatter,
                        Op.PAGE_COPY: kv.page_copy, Op.RERANGE: kv.rerange,
                        Op.PEER_GATHER: kv.peer_gather, Op.FP8_PACK: kv.fp8_pack,
                        Op.FP8_UNPACK: kv.fp8_unpack, Op.PAGE_ROWS: kv.page_rows,
                        Op.FP8_STORE: kv.fp8_store}
        if attention is not None:
            methods |= {Op.INDEXER_LOGITS: attention.indexer_logits,
                        Op.INDEXER_LOGITS_PAGED: attention.indexer_logits_paged,
                        Op.INDEXER_LOGITS_INDEX_PAGES: attention.indexer_logits_index_pages,
                        Op.TOPK: attention.topk, Op.INDEXER_TOPK: attention.indexer_topk,
                        Op.SPARSE_MLA: attention.sparse_mla,
                        Op.SPARSE_MLA_PAGED: attention.sparse_mla_paged}
        if rope is not None:
            methods[Op.ROPE] = rope.rope
        if quant is not None:
            methods[Op.INDEX_Q_FP8] = quant.index_q_fp8
        if norm is not None:
            methods[Op.RMS_NORM] = norm.rms_norm
        super().__init__(methods)

    def missing_reason(self, op: str) -> str:
        """The import error of the part that implements ``op``."""
        part = next(name for name, ops in (("kv", KV_OPS), ("attention", ATTENTION_OPS),
                                           ("rope", ROPE_OPS), ("quant", QUANT_OPS),
                                           ("norm", NORM_OPS))
                    if Op(op) in ops)
        why = IMPORT_ERRORS.get(part, "its module did not import (or kv did not)")
        return f"the triton backend has no {part} kernels: {why}"
