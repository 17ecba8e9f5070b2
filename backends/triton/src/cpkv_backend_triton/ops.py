"""``TritonOps``: the object the ``triton`` backend loads, three kernel objects composed.

``TritonOps(kv=KVKernels(), attention=AttentionKernels(kv=...), rope=RopeKernels())``: each op is
a method that calls the part implementing it. Each kernel module is imported on its own: one
that cannot be imported (``ImportError``) leaves its class None here (:data:`KV_KERNELS`,
:data:`ATTENTION_KERNELS`, :data:`ROPE_KERNELS`) and its error in :data:`IMPORT_ERRORS`, so the
KV, attention and rope kernels land independently. :attr:`TritonOps.provided` names the ops of
the parts present; ``plugin.load`` checks it against the plugin's static list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from cpkv.ops.api import Op

if TYPE_CHECKING:
    import torch

    from cpkv.ops.api import KVFormat, KVPart, RopeStyle

__all__ = ["ATTENTION_KERNELS", "ATTENTION_OPS", "IMPORT_ERRORS", "KV_KERNELS", "KV_OPS",
           "ROPE_KERNELS", "ROPE_OPS", "TritonOps"]

#: kernel module name -> repr of the ImportError that kept its part out
IMPORT_ERRORS: dict[str, str] = {}

#: the ops each part implements
KV_OPS: frozenset[Op] = frozenset({Op.PAGE_GATHER, Op.PAGE_SCATTER, Op.PAGE_COPY, Op.RERANGE,
                                   Op.PEER_GATHER, Op.FP8_PACK, Op.FP8_UNPACK})
ATTENTION_OPS: frozenset[Op] = frozenset({Op.INDEXER_LOGITS, Op.INDEXER_LOGITS_PAGED, Op.TOPK,
                                          Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED})
ROPE_OPS: frozenset[Op] = frozenset({Op.ROPE})

KV_KERNELS: type[KVKernels] | None
ATTENTION_KERNELS: type[AttentionKernels] | None
ROPE_KERNELS: type[RopeKernels] | None
try:
    from .kv import KVKernels
except ImportError as exc:
    IMPORT_ERRORS["kv"] = repr(exc)
    KV_KERNELS = None
else:
    KV_KERNELS = KVKernels
try:
    from .attention import AttentionKernels
except ImportError as exc:
    IMPORT_ERRORS["attention"] = repr(exc)
    ATTENTION_KERNELS = None
else:
    ATTENTION_KERNELS = AttentionKernels
try:
    from .rope import RopeKernels
except ImportError as exc:
    IMPORT_ERRORS["rope"] = repr(exc)
    ROPE_KERNELS = None
else:
    ROPE_KERNELS = RopeKernels

_P = TypeVar("_P")


class TritonOps:
    """cpkv's compute ops as Triton kernels: one method per op, each calling its part.

    Args:
        kv: the KV kernels; None: a default :class:`~cpkv_backend_triton.kv.KVKernels` when its
            module imported.
        attention: the sparse-attention kernels; None: a default
            :class:`~cpkv_backend_triton.attention.AttentionKernels` reading pages through
            ``kv`` (configure precision and launches by passing your own).
        rope: the rope kernel; None: a default :class:`~cpkv_backend_triton.rope.RopeKernels`.

    A part whose module did not import stays None: its ops are not in :attr:`provided`, and
    calling one raises RuntimeError naming the import error.
    """

    def __init__(self, kv: KVKernels | None = None, attention: AttentionKernels | None = None,
                 rope: RopeKernels | None = None) -> None:
        if kv is None and KV_KERNELS is not None:
            kv = KV_KERNELS()
        if attention is None and ATTENTION_KERNELS is not None and kv is not None:
            attention = ATTENTION_KERNELS(kv=kv)
        if rope is None and ROPE_KERNELS is not None:
            rope = ROPE_KERNELS()
        self.kv_kernels, self.attention_kernels, self.rope_kernels = kv, attention, rope

    @property
    def provided(self) -> frozenset[Op]:
        """The ops of the parts present."""
        parts = ((self.kv_kernels, KV_OPS), (self.attention_kernels, ATTENTION_OPS),
                 (self.rope_kernels, ROPE_OPS))
        return frozenset().union(*(ops for part, ops in parts if part is not None))

    @staticmethod
    def _need(part: _P | None, name: str) -> _P:
        if part is None:
            why = IMPORT_ERRORS.get(name, "its module did not import (or kv did not)")
            raise RuntimeError(f"the triton backend has no {name} kernels: {why}")
        return part

    # ---- KV ops: KVKernels ---------------------------------------------------------------
    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.kv_kernels, "kv").page_gather(src, index)

    def page_scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """See :class:`cpkv.ops.api.KVOps`."""
        self._need(self.kv_kernels, "kv").page_scatter(dst, index, src)

    def page_copy(self, dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor,
                  src_index: torch.Tensor) -> None:
        """See :class:`cpkv.ops.api.KVOps`."""
        self._need(self.kv_kernels, "kv").page_copy(dst, dst_index, src, src_index)

    def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.kv_kernels, "kv").rerange(gathered, perm)

    def peer_gather(self, srcs: Sequence[torch.Tensor], owner: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.kv_kernels, "kv").peer_gather(srcs, owner, rows)

    def fp8_pack(self, x: torch.Tensor, fmt: KVFormat, part: KVPart) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.kv_kernels, "kv").fp8_pack(x, fmt, part)

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: KVPart,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.kv_kernels, "kv").fp8_unpack(packed, fmt, part, dtype, index)

    # ---- sparse attention: AttentionKernels ----------------------------------------------
    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.attention_kernels, "attention").indexer_logits(
            q, w, k, k_scale, key_start, key_end)

    def indexer_logits_paged(self, q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.attention_kernels, "attention").indexer_logits_paged(
            q, w, pages, fmt, block_table, row_request, key_end)

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.attention_kernels, "attention").topk(logits, k, key_start,
                                                                     key_end)

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.attention_kernels, "attention").sparse_mla(q, kv, indices, scale,
                                                                           dv)

    def sparse_mla_paged(self, q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                         fmt: KVFormat, scale: float, dv: int) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.attention_kernels, "attention").sparse_mla_paged(
            q, pages, rows, fmt, scale, dv)

    # ---- rope: RopeKernels ---------------------------------------------------------------
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """See :class:`cpkv.ops.api.KVOps`."""
        return self._need(self.rope_kernels, "rope").rope(x, cos, sin, style, out)
