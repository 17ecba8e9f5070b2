"""KV buffers given by the caller: a spec of each layer's tensors, page strides and in-page order.

A :class:`KVBufferSpec` names, per layer, the tensors that hold the pool's pages and how a page's
bytes are ordered in them (:class:`BufferLayout`):

* ``token_major`` / ``part_major``: cpkv's own layouts, one uint8 tensor ``[pages, ps, B]`` per
  layer (``B`` = latent + index-K bytes per token; :class:`~cpkv.contracts.PageLayout`).
* ``two_part``: the engines' layout (SGLang's ``NSATokenToKVPool``, vLLM's
  ``DeepseekV32IndexerCache``): per layer a latent tensor ``[pages, ps, latent bytes]`` (what
  FlashMLA's fp8 sparse decode reads) and an index-K tensor ``[pages, ps * index bytes]`` in
  DeepGEMM's page order: the page's ``ps x D`` values first, then its ``ps`` scales (fp8: 64 x
  128 e4m3 then 64 fp32 ue8m0 scales per 64-token page; float formats have no scale part).
  A layer may have no index-K tensor (a layer that shares another layer's indexer).

The tensors are the caller's: nothing here allocates them (but :meth:`KVBufferSpec.allocate`,
for tests and a pool that owns its storage) and nothing copies them. Token rows are
``slot * ps + offset``. :func:`write_rows` stores already-packed rows (the stored format of
:class:`~cpkv.contracts.KVFormat`: fp8 latent 656 B, index-K 132 B = 128 fp8 + one fp32 scale)
into their place in any layout; :func:`read_pages` / :func:`write_pages` move whole pages as
canonical token-major blocks ``[n, ps, B]`` (what materialization, transfer and the host tier
move), so every layout round-trips bit-exactly through them. Device ops only, no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpkv.contracts import (
    BufferLayout,
    KVDtype,
    KVFormat,
    KVOps,
    KVPart,
    LayerFormats,
    layer_formats,
)

__all__ = [
    "BufferLayout",
    "KVBufferSpec",
    "LayerBuffers",
    "index_split",
    "quantize_rows",
    "read_pages",
    "read_part",
    "read_rows",
    "region_bytes",
    "write_pages",
    "write_part",
    "write_rows",
]


def index_split(fmt: KVFormat) -> tuple[int, int]:
    """(value bytes, scale bytes) of one token's stored index-K: fp8 ``(D, 4)``, float ``(D x
    width, 0)``; a two-part index-K page holds ``ps`` value rows then ``ps`` scale rows."""
    n = fmt.index_bytes_per_token
    if fmt.dtype is KVDtype.FP8:
        return fmt.index_head_dim, n - fmt.index_head_dim
    return n, 0


def region_bytes(fmt: KVFormat, layout: BufferLayout) -> tuple[int, ...]:
    """Bytes of one page in each region of a layer in ``fmt``: one-tensor layouts one region
    (the page's block, latent and index-K together); ``two_part`` the latent's, then the
    index-K's (none for a layer without index-K). What the page movers copy, region by region
    (:meth:`KVBufferSpec.regions`, the host tier, the transfers)."""
    if layout is not BufferLayout.TWO_PART:
        return (fmt.page_bytes,)
    ps = fmt.page_size
    lat = ps * fmt.latent_bytes_per_token
    return (lat, ps * fmt.index_bytes_per_token) if fmt.index_k else (lat,)


@dataclass(frozen=True)
class LayerBuffers:
    """One layer's tensors. One-tensor layouts: ``kv`` [pages, ps, B], ``latent``/``index_k``
    None. ``two_part``: ``latent`` [pages, ps, latent bytes], ``index_k`` [pages, ps * index
    bytes] or None (the layer has no index-K), ``kv`` None."""

    kv: torch.Tensor | None = None
    latent: torch.Tensor | None = None
    index_k: torch.Tensor | None = None

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tensors the layer's pages live in (what a caller checks ``data_ptr`` of)."""
        return tuple(t for t in (self.kv, self.latent, self.index_k) if t is not None)


def _check(t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if t.dtype != torch.uint8 or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous uint8 tensor of shape {shape}, got "
                         f"{t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()})")


@dataclass(frozen=True)
class KVBufferSpec:
    """Per layer, the tensors of a pool's pages (see the module docstring).

    Attributes:
        fmts: each layer's stored format (:func:`~cpkv.contracts.layer_formats`: a layer with
            ``index_k = False`` caches no index-K; its two-part index tensor is None, its
            one-tensor pages hold the latent only).
        layout: how page bytes are ordered.
        layers: one :class:`LayerBuffers` per KV layer.
        capacity: pages per tensor (the same for every layer and part).
    """

    fmts: LayerFormats
    layout: BufferLayout
    layers: tuple[LayerBuffers, ...]
    capacity: int

    def __post_init__(self) -> None:
        n = self.capacity
        if not self.layers or n < 1 or len(self.fmts) != len(self.layers):
            raise ValueError(f"a buffer spec needs >= 1 layer, >= 1 page and one format per "
                             f"layer, got {len(self.layers)} layers of {n} pages, "
                             f"{len(self.fmts)} formats")
        layer_formats(self.fmts, len(self.fmts))  # one pool's formats (differ in index_k only)
        dev = self.layers[0].parts()[0].device
        for i, (lb, fmt) in enumerate(zip(self.layers, self.fmts, strict=True)):
            ps = fmt.page_size
            if self.layout is BufferLayout.TWO_PART:
                if lb.kv is not None or lb.latent is None:
                    raise ValueError(f"layer {i}: two_part needs a latent tensor (and no kv)")
                _check(lb.latent, (n, ps, fmt.latent_bytes_per_token), f"layer {i} latent")
                if (lb.index_k is not None) != fmt.index_k:
                    raise ValueError(f"layer {i}: an index_k tensor exactly when its format "
                                     f"caches index-K (index_k={fmt.index_k})")
                if lb.index_k is not None:
                    _check(lb.index_k, (n, ps * fmt.index_bytes_per_token), f"layer {i} index_k")
            else:
                if lb.kv is None or lb.latent is not None or lb.index_k is not None:
                    raise ValueError(f"layer {i}: {self.layout.value} needs one kv tensor")
                _check(lb.kv, (n, ps, fmt.bytes_per_token), f"layer {i} kv")
            if any(t.device != dev for t in lb.parts()):
                raise ValueError(f"layer {i}: every tensor must be on {dev}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def fmt(self) -> KVFormat:
        """The pool's format (dtype, dims, page size): its first layer with index-K."""
        return next((f for f in self.fmts if f.index_k), self.fmts[0])

    @property
    def device(self) -> torch.device:
        return self.layers[0].parts()[0].device

    def regions(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``layer``'s page regions: uint8 ``[capacity, bytes]`` views of its tensors (row ``s``
        is page ``s``'s part, :func:`region_bytes` each), in place. Every page mover (the
        all-gather's send buffer, copies on write, the host tier, the transfers) iterates them:
        one region per layer in a one-tensor layout, latent then index-K in ``two_part``."""
        return tuple(t.view(self.capacity, -1) for t in self.layers[layer].parts())

    def has_index_k(self, layer: int) -> bool:
        """Whether ``layer`` stores index-K (a layer may share another's indexer)."""
        return self.fmts[layer].index_k

    @classmethod
    def wrap(cls, fmt: KVFormat | Sequence[KVFormat], layout: BufferLayout | str,
             tensors: Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]],
             ) -> KVBufferSpec:
        """A spec over the caller's tensors: per layer one ``[pages, ps, B]`` tensor (one-tensor
        layouts) or a ``(latent, index_k or None)`` pair (``two_part``: a None index-K makes
        that layer's format latent-only). ``fmt``: one for every layer or one per layer.
        Nothing is copied.

        Raises:
            ValueError: a tensor of the wrong dtype, shape, device or contiguity (naming it).
        """
        lay = BufferLayout(layout)
        fmts = list(layer_formats(fmt, len(tensors))) if tensors else []
        layers: list[LayerBuffers] = []
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor):
                layers.append(LayerBuffers(kv=t))
            else:
                layers.append(LayerBuffers(latent=t[0], index_k=t[1]))
                if t[1] is None:
                    fmts[i] = fmts[i].latent_only()
        first = layers[0].parts()[0] if layers else None
        return cls(fmts=tuple(fmts), layout=lay, layers=tuple(layers),
                   capacity=0 if first is None else int(first.shape[0]))

    @classmethod
    def allocate(cls, fmt: KVFormat | Sequence[KVFormat], num_layers: int, capacity: int,
                 layout: BufferLayout | str = BufferLayout.TOKEN_MAJOR,
                 device: torch.device | str = "cpu") -> KVBufferSpec:
        """Zeroed tensors for ``num_layers`` layers of ``capacity`` pages in ``layout``, each
        layer in its format (``fmt``: one for all or one per layer; a latent-only layer gets no
        index-K bytes)."""
        lay, fmts = BufferLayout(layout), layer_formats(fmt, num_layers)

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.uint8, device=device)

        layers = tuple(
            LayerBuffers(latent=z(capacity, f.page_size, f.latent_bytes_per_token),
                         index_k=z(capacity, f.page_size * f.index_bytes_per_token)
                         if f.index_k else None)
            if lay is BufferLayout.TWO_PART else
            LayerBuffers(kv=z(capacity, f.page_size, f.bytes_per_token)) for f in fmts)
        return cls(fmts=fmts, layout=lay, layers=layers, capacity=capacity)


# ---- row and page movement ------------------------------------------------------------------
def _part_rows(spec: KVBufferSpec, layer: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                         torch.Tensor | None]:
    """Writable views of a two-part layer, each [pages, ps, bytes] (a token at (page, offset)):
    latent rows, index-K value rows (None without index-K), index-K scale rows (None without
    index-K or for a float format). The index views are strided, so they are addressed by
    (page, offset), never flattened (that would copy)."""
    fmt, lb = spec.fmts[layer], spec.layers[layer]
    assert lb.latent is not None
    ps, (vb, sb) = fmt.page_size, index_split(fmt)
    if lb.index_k is None:
        return lb.latent, None, None
    n = lb.index_k.shape[0]
    vals = lb.index_k[:, :ps * vb].view(n, ps, vb)
    scales = lb.index_k[:, ps * vb:].view(n, ps, sb) if sb else None
    return lb.latent, vals, scales


def _one_tensor_parts(spec: KVBufferSpec, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Writable [pages, ps, latent] and [pages, ps, index] views of a one-tensor layer."""
    from cpkv.ops import page_blocks

    kv = spec.layers[layer].kv
    assert kv is not None
    lay = spec.layout.page_layout
    assert lay is not None
    return page_blocks(kv, lay, spec.fmts[layer].latent_bytes_per_token)


def write_rows(spec: KVBufferSpec, layer: int, rows: torch.Tensor, latent: torch.Tensor,
               index_k: torch.Tensor | None) -> None:
    """Store packed rows at token rows ``rows`` (int64 [N]: slot x ps + offset) of ``layer``.

    ``latent``: uint8 [N, latent bytes]; ``index_k``: uint8 [N, index bytes] in the stored
    format (fp8: 128 e4m3 values then the fp32 scale), or None for a layer without index-K.
    Rows are written where the layout keeps them (two_part: a token's index values and its scale
    in the two halves of its page). Device ops only.

    Raises:
        ValueError: index-K rows for a layer without index-K or the reverse.
    """
    ps = spec.fmt.page_size
    if (index_k is None) == spec.has_index_k(layer):
        raise ValueError(f"layer {layer}: index-K rows "
                         f"{'missing' if index_k is None else 'given'} for a layer "
                         f"{'with' if spec.has_index_k(layer) else 'without'} index-K")
    page, off = rows // ps, rows % ps
    if spec.layout is BufferLayout.TWO_PART:
        lat, vals, scales = _part_rows(spec, layer)
        lat.index_put_((page, off), latent)
        if index_k is not None and vals is not None:
            vb = vals.shape[2]
            vals.index_put_((page, off), index_k[:, :vb])
            if scales is not None:
                scales.index_put_((page, off), index_k[:, vb:])
        return
    lat3, idx3 = _one_tensor_parts(spec, layer)
    lat3.index_put_((page, off), latent)
    if index_k is not None:
        idx3.index_put_((page, off), index_k)


def quantize_rows(spec: KVBufferSpec, layer: int, rows: torch.Tensor, latent: torch.Tensor,
                  index_k: torch.Tensor | None, rotate: bool, ops: KVOps) -> None:
    """:func:`write_rows` of an fp8 layer from compute rows ([N, D]) in one pass a part: the
    ``fp8_store`` op quantizes them into their place in any layout (two_part: the index-K's
    scales into their own rows); ``rotate``: the index-K Hadamard-rotated first. Device ops.

    Raises:
        ValueError: the layer is not fp8, or index-K rows are missing for a layer with index-K.
    """
    fmt = spec.fmts[layer]
    if fmt.dtype is not KVDtype.FP8:
        raise ValueError(f"layer {layer} is {fmt.dtype.value}: quantize_rows writes fp8 layers")
    if spec.has_index_k(layer) and index_k is None:
        raise ValueError(f"layer {layer} caches index-K: its index_k rows are needed")
    scales: torch.Tensor | None = None
    idx: torch.Tensor | None
    if spec.layout is BufferLayout.TWO_PART:  # the index-K's values, then its scales
        lat, idx, scales = _part_rows(spec, layer)
    else:
        lat, idx = _one_tensor_parts(spec, layer)
    ops.fp8_store(latent, fmt, "latent", lat, rows, False)
    if spec.has_index_k(layer) and idx is not None and index_k is not None:
        ops.fp8_store(index_k, fmt, "index_k", idx, rows, rotate, scales)


def read_rows(spec: KVBufferSpec, layer: int, rows: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed rows at token rows ``rows`` (int64 [N]) of ``layer``: uint8 [N, latent bytes]
    and [N, index bytes] (None without index-K), copies in the stored format."""
    ps = spec.fmt.page_size
    page, off = rows // ps, rows % ps
    if spec.layout is BufferLayout.TWO_PART:
        lat, vals, scales = _part_rows(spec, layer)
        la = lat[page, off]
        if vals is None:
            return la, None
        v = vals[page, off]
        return la, v if scales is None else torch.cat([v, scales[page, off]], dim=1)
    lat3, idx3 = _one_tensor_parts(spec, layer)
    return lat3[page, off], idx3[page, off] if spec.has_index_k(layer) else None


def _part_pages(spec: KVBufferSpec, layer: int, part: KVPart
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Writable ``[pages, ps, bytes]`` views of one part of ``layer``: the part's token rows
    (one-tensor layouts, a two-part latent or float index-K: the second is None), or a two-part
    fp8 index-K's value rows and scale rows (a token's stored row is their concatenation)."""
    if spec.layout is not BufferLayout.TWO_PART:
        lat3, idx3 = _one_tensor_parts(spec, layer)
        return (lat3 if part == "latent" else idx3), None
    lat, vals, scales = _part_rows(spec, layer)
    if part == "latent":
        return lat, None
    if vals is None:  # no index-K: an empty part
        return lat[..., :0], None
    return vals, scales


def read_part(spec: KVBufferSpec, layer: int, part: KVPart, slots: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Pages ``slots`` (int64 [n]) of one part of ``layer`` as its stored token rows, uint8
    ``[n, ps, part bytes]`` (``[n, ps, 0]``: the index-K of a layer without it), the same bytes
    in every layout: the packed part layout a two-sided transfer moves. ``out``: a contiguous
    buffer of that shape to fill (one copy of each byte in the one-tensor layouts)."""
    a, b = _part_pages(spec, layer, part)
    if b is None:
        if out is None:
            return a.index_select(0, slots)
        return torch.index_select(a, 0, slots, out=out)
    vb = a.shape[2]
    if out is None:
        return torch.cat([a.index_select(0, slots), b.index_select(0, slots)], dim=2)
    out[..., :vb].copy_(a.index_select(0, slots))
    out[..., vb:].copy_(b.index_select(0, slots))
    return out


def write_part(spec: KVBufferSpec, layer: int, part: KVPart, slots: torch.Tensor,
               rows: torch.Tensor) -> None:
    """Store one part's token rows (uint8 ``[n, ps, part bytes]``, :func:`read_part`'s) at
    pages ``slots`` of ``layer`` in the spec's layout (nothing for an absent index-K)."""
    a, b = _part_pages(spec, layer, part)
    if b is None:
        if a.shape[2]:
            a.index_copy_(0, slots, rows)
        return
    vb = a.shape[2]
    a.index_copy_(0, slots, rows[..., :vb])
    b.index_copy_(0, slots, rows[..., vb:])


def read_pages(spec: KVBufferSpec, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Pages ``slots`` (int64 [n]) of ``layer`` as canonical token-major blocks uint8 [n, ps, B]
    (each token's latent bytes then its index-K bytes; ``B`` is the layer's: a latent-only
    layer's blocks are its latent rows): what materialization, transfer and the host tier move,
    the same bytes in every layout (a token-major pool's ``kv[layer]`` pages). Each part's
    rows once (:func:`read_part`), then joined."""
    if spec.layout is BufferLayout.TOKEN_MAJOR:
        kv = spec.layers[layer].kv
        assert kv is not None
        return kv.index_select(0, slots)
    lat = read_part(spec, layer, "latent", slots)
    if not spec.has_index_k(layer):
        return lat
    return torch.cat([lat, read_part(spec, layer, "index_k", slots)], dim=2)


def write_pages(spec: KVBufferSpec, layer: int, slots: torch.Tensor, blocks: torch.Tensor
                ) -> None:
    """Store canonical token-major blocks (uint8 [n, ps, B], :func:`read_pages`'s) at pages
    ``slots`` of ``layer`` in the spec's layout (each part's rows into their place,
    :func:`write_part`)."""
    if spec.layout is BufferLayout.TOKEN_MAJOR:
        kv = spec.layers[layer].kv
        assert kv is not None
        kv.index_copy_(0, slots, blocks)
        return
    nl = spec.fmts[layer].latent_bytes_per_token
    write_part(spec, layer, "latent", slots, blocks[..., :nl])
    if spec.has_index_k(layer):
        write_part(spec, layer, "index_k", slots, blocks[..., nl:])
