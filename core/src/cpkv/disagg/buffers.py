"""What a transfer plugin sees of an endpoint's KV: its registered buffers, not the pool.

A plugin moves page bytes; it has no business with page tables, reference counts or the
materializer. :func:`registered_buffers` is the one place this view is built from a pool's
store (``pool.store``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.contracts import BufferLayout, KVFormat, KVPart, pages_nbytes
from cpkv.kv.buffers import KVBufferSpec, read_part

from .plan import RankTransfer

if TYPE_CHECKING:
    from cpkv.kv import KVStore

__all__ = ["PoolBuffers", "registered_buffers"]


@dataclass(frozen=True)
class PoolBuffers:
    """One endpoint's KV buffers, as a transfer plugin reads, writes and registers them.

    Attributes:
        spec: the pool's tensors (:class:`~cpkv.kv.buffers.KVBufferSpec`: per layer its tensors
            in the pool's :class:`~cpkv.contracts.BufferLayout`, each layer in its own format; a
            GLM-5 shared-indexer layer's has no index-K).
        device: where the buffers live.
    """

    spec: KVBufferSpec
    device: torch.device

    @property
    def layout(self) -> BufferLayout:
        """How page bytes lie in the tensors (token-major, part-major or two-part)."""
        return self.spec.layout

    @property
    def fmt(self) -> KVFormat:
        """The stored format (page size, bytes per token): a full layer's."""
        return self.spec.fmt

    @property
    def fmts(self) -> tuple[KVFormat, ...]:
        """Per layer, its format."""
        return tuple(self.spec.fmts)

    @property
    def kv(self) -> tuple[torch.Tensor, ...]:
        """Per layer its one contiguous uint8 ``[pages, ps, B]`` tensor (one-tensor layouts;
        empty for two_part: :attr:`parts`)."""
        return tuple(lb.kv for lb in self.spec.layers if lb.kv is not None)

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_pages(self) -> int:
        """Pages of each layer's buffers (the capacity)."""
        return self.spec.capacity

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of a full layer, latent and index-K together."""
        return self.fmt.page_bytes

    @property
    def parts(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per layer, the regions its pages live in, each a contiguous uint8 ``[pages, bytes of
        a page's part]`` view (row ``s`` is page ``s``'s part, one block at a page stride): what
        a one-sided transport registers and writes, region by region, each with its own page
        bytes (:meth:`~cpkv.kv.buffers.KVBufferSpec.regions`: one region per layer in a
        one-tensor layout, latent then index-K in ``two_part``)."""
        return tuple(self.spec.regions(i) for i in range(self.num_layers))

    def layer_page_bytes(self, layer: int) -> int:
        """Bytes of one page of ``layer`` in its own format."""
        return self.fmts[layer].page_bytes

    def nbytes(self, num_pages: int, layers: range | None = None) -> int:
        """Bytes of ``num_pages`` pages of every layer (or of ``layers``), each layer in its
        own format: what a part moves."""
        return pages_nbytes(self.spec.fmts, num_pages, layers)

    def pack(self, part: RankTransfer, layers: range | None = None) -> torch.Tensor:
        """The pages of ``part`` (at its runs' source slots) as one contiguous uint8 buffer on
        :attr:`device`, in the *packed part layout*: for each layer of ``layers`` (default
        every layer) the latent bytes of the part's pages ``[n, ps, latent bytes]``, then their
        index-K bytes ``[n, ps, index bytes]``; pages in the part's logical order; the same
        bytes whatever the pool's layout (:func:`~cpkv.kv.buffers.read_part`). Each byte is
        copied once in a one-tensor layout (``index_select`` into its place in the buffer), on
        the current stream."""
        src = [r.src_slot + i for r in part.runs for i in range(r.num_pages)]
        lays = range(self.num_layers) if layers is None else layers
        out = torch.empty(self.nbytes(len(src), lays), dtype=torch.uint8, device=self.device)
        if not src or not len(lays):
            return out
        idx = torch.tensor(src, dtype=torch.int64, device=self.device)
        n, off, ps = len(src), 0, self.fmt.page_size
        for layer in lays:  # gathered straight into the buffer: one copy of each byte, no cat
            f = self.fmts[layer]
            widths: tuple[tuple[KVPart, int], ...] = (("latent", f.latent_bytes_per_token),
                                                      ("index_k", f.index_bytes_per_token))
            for name, width in widths:
                size = n * ps * width
                if not size:  # a layer without index-K: nothing of it moves
                    continue
                read_part(self.spec, layer, name, idx, out=out[off:off + size].view(n, ps, width))
                off += size
        return out


def registered_buffers(store: KVStore) -> PoolBuffers:
    """The buffers view of a pool's ``store`` (its ``spec``: tensors, layout, formats; its
    device): the one place a :class:`PoolBuffers` is made."""
    return PoolBuffers(spec=store.spec, device=store.group.device)
