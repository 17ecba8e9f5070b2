"""The ``triton`` backend's op set, declared once: the ops of each part of ``ops.TritonOps``
(each op the part's method of the op's name) and their union. Imports neither triton nor torch:
the plugin's declaration reads it."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from cpkv.ops.api import Op

__all__ = ["OPS", "PART_OPS"]

#: the ops of each part of ``TritonOps`` (its kernel module: ``kv``, ``attention``, ``rope``,
#: ``quant``, ``norm``)
PART_OPS: Mapping[str, frozenset[Op]] = MappingProxyType({
    "kv": frozenset({Op.PAGE_GATHER, Op.PAGE_SCATTER, Op.PAGE_COPY, Op.RERANGE, Op.PEER_GATHER,
                     Op.FP8_PACK, Op.FP8_UNPACK, Op.PAGE_ROWS, Op.FP8_STORE}),
    "attention": frozenset({Op.INDEXER_LOGITS, Op.INDEXER_LOGITS_PAGED,
                            Op.INDEXER_LOGITS_INDEX_PAGES, Op.TOPK, Op.INDEXER_TOPK,
                            Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED, Op.V4_INDEX_TOPK}),
    "rope": frozenset({Op.ROPE}),
    "quant": frozenset({Op.INDEX_Q_FP8}),
    "norm": frozenset({Op.RMS_NORM}),
})
#: the backend's ops
OPS: frozenset[Op] = frozenset().union(*PART_OPS.values())
