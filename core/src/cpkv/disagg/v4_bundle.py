"""A DeepSeek-V4 request's decode state on the wire: each prefill rank's owned compressed
entries and the tail holder's bundle, as pages of a byte staging pool that the transfer protocol
(:mod:`cpkv.disagg.flow`: offers, grants, fences, publish only when complete) moves over any
transfer plugin.

The request's *image* is a run of logical pages: rank 0's owned entries, rank 1's, ..., then the
tail bundle (on the rank of the last token). Every piece's byte count follows from the model's
shapes, the entry owners and the length (:class:`V4Shapes`), so every endpoint builds the same
manifest without asking; a piece is its tensors' raw bytes back to back in a fixed order:

* owned entries: per layer, per compressor (main, index), the rank's entries ``[n, d]`` in its
  owner order;
* tail bundle: per layer the window ring ``[W - 1, D]``, then per compressor the open window's
  ``kv`` and ``gate`` ``[L % m, w]`` and, on an overlapping one once a window is complete, the
  prior window's ``kv`` and ``gate`` ``[m, w]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cpkv.contracts import KVDtype, KVFormat, cdiv
from cpkv.kv.buffers import read_pages, write_pages
from cpkv.kv.v4_state import (
    COMPRESSOR_NAMES,
    V4CompressorCarry,
    V4OwnedEntries,
    V4TailBundle,
    V4TailLayer,
)
from cpkv.models.deepseek_v4 import DeepseekV4

from .buffers import PoolBuffers
from .plan import RankTransfer, TransferManifest, coalesce

__all__ = ["V4_STAGE_FORMAT", "V4Image", "V4Shapes", "pack_owned", "pack_tail", "read_image",
           "unpack_owned", "unpack_tail", "write_piece"]

#: the staging pool's page format: 16 tokens of 256 bytes (4 KiB pages of raw bytes)
V4_STAGE_FORMAT = KVFormat(dtype=KVDtype.FP32, page_size=16, kv_lora_rank=64, rope_dim=0,
                           index_head_dim=1, index_k=False)


@dataclass(frozen=True)
class V4Comp:
    name: str
    rate: int
    dim: int  # entry width d
    width: int  # projection width w (2d on overlapping compressors)
    overlap: bool


@dataclass(frozen=True)
class V4Shapes:
    """What a piece's bytes mean: the element type, the window ring's rows and width, and per
    layer its compressors."""

    dtype: torch.dtype
    window_rows: int
    head_dim: int
    layers: tuple[tuple[V4Comp, ...], ...]

    @classmethod
    def of(cls, model: DeepseekV4) -> V4Shapes:
        layers = tuple(tuple(V4Comp(n, c.rate, c.dim, c.wkv.shape[0], c.overlap)
                             for n, c in zip(COMPRESSOR_NAMES, model.compressors(i), strict=True)
                             if c is not None) for i in range(model.kv_layers))
        return cls(model.dtype, model.config.sliding_window - 1, model.config.head_dim, layers)

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def owned_nbytes(self, owners: Mapping[int, Sequence[Sequence[int]]], rank: int) -> int:
        """Bytes of ``rank``'s owned entries (``owners[rate][rank]``: the entries it owns)."""
        return self.elem * sum(len(owners[c.rate][rank]) * c.dim
                               for comps in self.layers for c in comps)

    def tail_shapes(self, length: int) -> list[tuple[int, int]]:
        out = []
        for comps in self.layers:
            out.append((self.window_rows, self.head_dim))
            for c in comps:
                out += [(length % c.rate, c.width)] * 2
                if c.overlap and length >= c.rate:
                    out += [(c.rate, c.width)] * 2
        return out

    def tail_nbytes(self, length: int) -> int:
        """Bytes of the tail bundle of a request of ``length`` tokens."""
        return self.elem * sum(r * w for r, w in self.tail_shapes(length))


def _raw(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = [t.contiguous().view(torch.uint8).reshape(-1) for t in ts]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def _cut(buf: torch.Tensor, shapes: Sequence[tuple[int, int]], dtype: torch.dtype
         ) -> list[torch.Tensor]:
    elem = torch.empty((), dtype=dtype).element_size()
    total = sum(r * w for r, w in shapes) * elem
    if total != buf.numel():
        raise ValueError(f"a piece of {buf.numel()} bytes, its shapes take {total}")
    out, off = [], 0
    for r, w in shapes:
        n = r * w * elem
        out.append(buf[off:off + n].clone().view(dtype).view(r, w))
        off += n
    return out


def pack_owned(shapes: V4Shapes, owned: V4OwnedEntries) -> torch.Tensor:
    """A rank's owned entries as bytes (uint8, 1-D)."""
    return _raw([owned.entries[(i, c.name)][1] for i, comps in enumerate(shapes.layers)
                 for c in comps])


def unpack_owned(shapes: V4Shapes, buf: torch.Tensor, owners: Mapping[int, Sequence[Sequence[int]]],
                 rank: int) -> V4OwnedEntries:
    """:func:`pack_owned`'s inverse. Raises ValueError when the bytes do not fit."""
    keys = [(i, c) for i, comps in enumerate(shapes.layers) for c in comps]
    parts = _cut(buf, [(len(owners[c.rate][rank]), c.dim) for _, c in keys], shapes.dtype)
    return V4OwnedEntries(rank=rank, entries={
        (i, c.name): (tuple(owners[c.rate][rank]), t)
        for (i, c), t in zip(keys, parts, strict=True)})


def pack_tail(shapes: V4Shapes, tail: V4TailBundle) -> torch.Tensor:
    """The tail bundle as bytes (uint8, 1-D)."""
    ts: list[torch.Tensor] = []
    for comps, layer in zip(shapes.layers, tail.layers, strict=True):
        ts.append(layer.window)
        for c in comps:
            carry = layer.carry[c.name]
            ts += [carry.open_kv, carry.open_gate]
            if carry.prior_kv is not None and carry.prior_gate is not None:
                ts += [carry.prior_kv, carry.prior_gate]
    return _raw(ts)


def unpack_tail(shapes: V4Shapes, buf: torch.Tensor, length: int) -> V4TailBundle:
    """:func:`pack_tail`'s inverse. Raises ValueError when the bytes do not fit."""
    parts = iter(_cut(buf, shapes.tail_shapes(length), shapes.dtype))
    layers = []
    for comps in shapes.layers:
        layer = V4TailLayer(window=next(parts))
        for c in comps:
            carry = V4CompressorCarry(rate=c.rate, entries=length // c.rate,
                                      open_kv=next(parts), open_gate=next(parts))
            if c.overlap and length >= c.rate:
                carry.prior_kv, carry.prior_gate = next(parts), next(parts)
            layer.carry[c.name] = carry
        layers.append(layer)
    return V4TailBundle(length=length, layers=layers)


@dataclass(frozen=True)
class V4Image:
    """Where each piece of one request lies among its logical pages: per rank the first page
    and page count of its owned entries, and the tail bundle's (on ``tail_rank``)."""

    request: str
    length: int
    tail_rank: int
    owners: Mapping[int, tuple[tuple[int, ...], ...]]
    owned_bytes: tuple[int, ...]
    tail_bytes: int
    page_bytes: int

    @classmethod
    def plan(cls, request: str, shapes: V4Shapes, owners: Mapping[int, Sequence[Sequence[int]]],
             length: int, tail_rank: int, fmt: KVFormat = V4_STAGE_FORMAT) -> V4Image:
        own = {m: tuple(tuple(x) for x in per) for m, per in owners.items()}
        size = len(next(iter(own.values()))) if own else tail_rank + 1
        return cls(request, length, tail_rank, own,
                   tuple(shapes.owned_nbytes(own, r) for r in range(size)),
                   shapes.tail_nbytes(length), fmt.page_bytes)

    def pages(self, nbytes: int) -> int:
        return cdiv(nbytes, self.page_bytes)

    def first_pages(self) -> list[int]:
        """Per rank its owned entries' first logical page, then the tail bundle's."""
        out = [0]
        for b in self.owned_bytes:
            out.append(out[-1] + self.pages(b))
        return out

    def local_pages(self, rank: int) -> int:
        """Staging pages ``rank`` writes (its owned entries, then the tail if it holds it)."""
        return self.pages(self.owned_bytes[rank]) + (
            self.pages(self.tail_bytes) if rank == self.tail_rank else 0)

    def manifest(self, fmt: KVFormat = V4_STAGE_FORMAT) -> TransferManifest:
        """The transfer manifest: rank r sends its staging slots ``0 ..`` to its logical pages."""
        first = self.first_pages()
        parts = []
        for r, b in enumerate(self.owned_bytes):
            pages = [(first[r] + k, k) for k in range(self.pages(b))]
            if r == self.tail_rank:
                n = self.pages(b)
                pages += [(first[-1] + k, n + k) for k in range(self.pages(self.tail_bytes))]
            if pages:
                parts.append(RankTransfer(request=self.request, rank=r,
                                          runs=tuple(coalesce(pages))))
        total = first[-1] + self.pages(self.tail_bytes)
        return TransferManifest(request=self.request, page_size=fmt.page_size,
                                valid_len=total * fmt.page_size, num_pages=total,
                                parts=tuple(parts))


def _blocks(buf: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    n = cdiv(buf.numel(), fmt.page_bytes)
    out = torch.zeros(n * fmt.page_bytes, dtype=torch.uint8, device=buf.device)
    out[: buf.numel()] = buf
    return out.view(n, fmt.page_size, fmt.page_bytes // fmt.page_size)


def write_piece(buffers: PoolBuffers, first_slot: int, buf: torch.Tensor) -> int:
    """Write the bytes ``buf`` into staging pages ``first_slot ..``; the pages written."""
    blocks = _blocks(buf.to(buffers.device), buffers.fmt)
    slots = torch.arange(first_slot, first_slot + blocks.shape[0], device=buffers.device)
    if blocks.shape[0]:
        write_pages(buffers.spec, 0, slots, blocks)
    return int(blocks.shape[0])


def read_image(buffers: PoolBuffers, slots: Sequence[int], image: V4Image, shapes: V4Shapes
               ) -> tuple[list[V4OwnedEntries], V4TailBundle]:
    """The pieces of a published request out of its decode staging pages ``slots`` (in logical
    order).

    Raises:
        ValueError: the pages do not hold the image's bytes.
    """
    first = image.first_pages()
    if len(slots) != first[-1] + image.pages(image.tail_bytes):
        raise ValueError(f"request {image.request!r}: {len(slots)} pages, its image has "
                         f"{first[-1] + image.pages(image.tail_bytes)}")
    idx = torch.tensor(list(slots), dtype=torch.long, device=buffers.device)
    raw = read_pages(buffers.spec, 0, idx).reshape(-1).cpu() if len(slots) else \
        torch.empty(0, dtype=torch.uint8)
    pb = image.page_bytes
    owned = [unpack_owned(shapes, raw[first[r] * pb: first[r] * pb + b], image.owners, r)
             for r, b in enumerate(image.owned_bytes)]
    tail = unpack_tail(shapes, raw[first[-1] * pb: first[-1] * pb + image.tail_bytes],
                       image.length)
    return owned, tail
