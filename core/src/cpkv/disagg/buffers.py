"""What a transfer plugin sees of an endpoint's KV: its registered buffers, not the pool.

A plugin moves page bytes; it has no business with page tables, reference counts or the
materializer. :func:`registered_buffers` is the one place this view is built from a pool's
store (``pool.store``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.contracts import KVFormat, PageLayout, pages_nbytes

from .plan import RankTransfer

if TYPE_CHECKING:
    from cpkv.kv import KVStore

__all__ = ["PoolBuffers", "registered_buffers"]


@dataclass(frozen=True)
class PoolBuffers:
    """One endpoint's KV buffers, as a transfer plugin reads, writes and registers them.

    Attributes:
        kv: per layer, a contiguous uint8 ``[pages, ps, latent + index bytes]`` tensor: page
            ``s`` of a layer is one block of :attr:`page_bytes` bytes at ``kv[layer][s]`` (what a
            one-sided transport registers and writes into).
        latent: per layer, the ``[pages, ps, latent bytes]`` view of ``kv`` (strided).
        index_k: per layer, the ``[pages, ps, index bytes]`` view of ``kv`` (strided).
        layout: the byte order inside a page block (token-major or part-major).
        fmt: the stored format (page size, bytes per token): a full layer's.
        device: where the buffers live.
        fmts: per layer, its format (a GLM-5 shared-indexer layer's has no index-K: its block
            and its part of a packed buffer are its latent bytes only).
    """

    kv: tuple[torch.Tensor, ...]
    latent: tuple[torch.Tensor, ...]
    index_k: tuple[torch.Tensor, ...]
    layout: PageLayout
    fmt: KVFormat
    device: torch.device
    fmts: tuple[KVFormat, ...]

    @property
    def num_layers(self) -> int:
        return len(self.kv)

    @property
    def num_pages(self) -> int:
        """Pages of each layer's buffer (the capacity)."""
        return int(self.kv[0].shape[0])

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of a full layer, latent and index-K together."""
        return self.fmt.page_bytes

    @property
    def parts(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per layer, the regions its pages live in, each a uint8 ``[pages, bytes of a page's
        part]`` view (row ``s`` is page ``s``'s part, one block at a page stride): what a
        one-sided transport registers and writes, region by region, each with its own page
        bytes. One region per layer here (the layer's ``kv`` buffer, in its own format)."""
        return tuple((b.view(b.shape[0], -1),) for b in self.kv)

    def layer_page_bytes(self, layer: int) -> int:
        """Bytes of one page of ``layer`` in its own format."""
        return self.fmts[layer].page_bytes

    def nbytes(self, num_pages: int, layers: range | None = None) -> int:
        """Bytes of ``num_pages`` pages of every layer (or of ``layers``), each layer in its
        own format: what a part moves."""
        return pages_nbytes(self.fmts, num_pages, layers)

    def pack(self, part: RankTransfer, layers: range | None = None) -> torch.Tensor:
        """The pages of ``part`` (at its runs' source slots) as one contiguous uint8 buffer on
        :attr:`device`, in the *packed part layout*: for each layer of ``layers`` (default
        every layer) the latent bytes of the part's pages ``[n, ps, latent bytes]``, then their
        index-K bytes ``[n, ps, index bytes]``; pages in the part's logical order. Each byte is
        copied once (``index_select`` into its place in the buffer), on the current stream."""
        src = [r.src_slot + i for r in part.runs for i in range(r.num_pages)]
        lays = range(self.num_layers) if layers is None else layers
        out = torch.empty(self.nbytes(len(src), lays), dtype=torch.uint8, device=self.device)
        if not src or not len(lays):
            return out
        idx = torch.tensor(src, dtype=torch.int64, device=self.device)
        n, off = len(src), 0
        for layer in lays:  # gathered straight into the buffer: one copy of each byte, no cat
            for part_view in (self.latent[layer], self.index_k[layer]):
                size = n * int(part_view[0].numel())
                if not size:  # a layer without index-K: nothing of it moves
                    continue
                torch.index_select(part_view, 0, idx,
                                   out=out[off:off + size].view(n, *part_view.shape[1:]))
                off += size
        return out


def registered_buffers(store: KVStore) -> PoolBuffers:
    """The buffers view of a pool's ``store`` (its ``kv`` / ``latent`` / ``index_k``,
    ``layout``, ``fmt`` and device): the one place a :class:`PoolBuffers` is made."""
    return PoolBuffers(kv=tuple(store.kv), latent=tuple(store.latent),
                       index_k=tuple(store.index_k), layout=PageLayout(store.layout), fmt=store.fmt,
                       device=store.group.device, fmts=tuple(store.fmts))
