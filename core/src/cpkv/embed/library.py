"""cpkv's per-layer calls as ``torch.library`` custom ops, so an engine's forward that calls
them compiles with ``torch.compile(fullgraph=True)`` (each op is one opaque node with a fake
implementation for tracing) and replays under CUDA graphs (device work only, no host sync).

The ops take tensors and integers only. What they need beyond the layer's tensors (each layer's
format, the layout, the CP group) is registered once under an integer handle (:func:`register`)
and the layer is named by its index:

* ``cpkv::put_bytes(latent_buf, index_buf?, rows, latent, index_k?, handle, layer)``: already-packed
  rows into token rows ``rows`` of the layer's tensors, in the layout's format (mutates the
  buffers).
* ``cpkv::take_bytes(latent_buf, index_buf?, rows, handle, layer) -> (latent, index_k)``: packed rows
  back out (``index_k`` is [N, 0] for a layer without one).
* ``cpkv::all_gather_pages(latent_buf, index_buf?, send_slots, view_index, handle, layer)``:
  ``-> rows``: this rank's pages ``send_slots`` as canonical blocks, one all-gather over the group, the
  full view's rows [T, latent + index bytes] in natural order (``view_index``: the token row of
  each view key in the gathered pages).
* ``cpkv::gather_rows(x, handle, max_rows) -> [C * max_rows, ...]``: the group's all-gather of
  packed rows (rank-major, padded), for owner writes.

For one-tensor layouts ``latent_buf`` is the layer's ``[pages, ps, B]`` tensor and ``index_buf``
None.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

import torch

from cpkv.comm import CPGroup
from cpkv.kv.buffers import (
    BufferLayout,
    KVBufferSpec,
    LayerBuffers,
    read_pages,
    read_rows,
    write_rows,
)

__all__ = ["Registered", "register", "registered", "unregister"]


@dataclass(frozen=True)
class Registered:
    """What the ops read by handle: the buffers' spec (format, layout) and the CP group."""

    spec: KVBufferSpec
    group: CPGroup


_HANDLES: dict[int, Registered] = {}
_NEXT = count(1)


def register(spec: KVBufferSpec, group: CPGroup) -> int:
    """A handle for the ops over ``spec``'s buffers and ``group`` (host work, once)."""
    h = next(_NEXT)
    _HANDLES[h] = Registered(spec=spec, group=group)
    return h


def registered(handle: int) -> Registered:
    """What ``handle`` stands for.

    Raises:
        KeyError: an unknown (or unregistered) handle.
    """
    try:
        return _HANDLES[handle]
    except KeyError:
        raise KeyError(f"no cpkv buffers are registered under handle {handle}") from None


def unregister(handle: int) -> None:
    """Forget ``handle`` (an engine that closes its KV)."""
    _HANDLES.pop(handle, None)


def _one_layer(handle: int, layer: int, latent_buf: torch.Tensor, index_buf: torch.Tensor | None
               ) -> KVBufferSpec:
    """A one-layer spec over the tensors the op was given (``layer``'s format and the layout of
    ``handle``)."""
    spec = registered(handle).spec
    if spec.layout is BufferLayout.TWO_PART:
        lb = LayerBuffers(latent=latent_buf, index_k=index_buf)
    else:
        lb = LayerBuffers(kv=latent_buf)
    return KVBufferSpec(fmts=(spec.fmts[layer],), layout=spec.layout, layers=(lb,),
                        capacity=int(latent_buf.shape[0]))


@torch.library.custom_op("cpkv::put_bytes", mutates_args=("latent_buf", "index_buf"))
def put_bytes(latent_buf: torch.Tensor, index_buf: torch.Tensor | None, rows: torch.Tensor,
              latent: torch.Tensor, index_k: torch.Tensor | None, handle: int, layer: int) -> None:
    """Store packed rows (uint8 [N, latent bytes], [N, index bytes] or None) at token rows
    ``rows`` (int64 [N]) of one layer's buffers, in their layout."""
    write_rows(_one_layer(handle, layer, latent_buf, index_buf), 0, rows, latent, index_k)


@put_bytes.register_fake
def _(latent_buf: torch.Tensor, index_buf: torch.Tensor | None, rows: torch.Tensor,
      latent: torch.Tensor, index_k: torch.Tensor | None, handle: int, layer: int) -> None:
    return None


@torch.library.custom_op("cpkv::take_bytes", mutates_args=())
def take_bytes(latent_buf: torch.Tensor, index_buf: torch.Tensor | None, rows: torch.Tensor,
               handle: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed rows at token rows ``rows`` of one layer: (uint8 [N, latent bytes], uint8
    [N, index bytes], or [N, 0] for a layer without index-K)."""
    lat, idx = read_rows(_one_layer(handle, layer, latent_buf, index_buf), 0, rows)
    return lat, idx if idx is not None else lat.new_zeros(lat.shape[0], 0)


@take_bytes.register_fake
def _(latent_buf: torch.Tensor, index_buf: torch.Tensor | None, rows: torch.Tensor,
      handle: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    fmt, n = registered(handle).spec.fmts[layer], rows.shape[0]
    return (latent_buf.new_empty(n, fmt.latent_bytes_per_token),
            latent_buf.new_empty(n, fmt.index_bytes_per_token))


@torch.library.custom_op("cpkv::all_gather_pages", mutates_args=())
def all_gather_pages(latent_buf: torch.Tensor, index_buf: torch.Tensor | None,
                     send_slots: torch.Tensor, view_index: torch.Tensor,
                     handle: int, layer: int) -> torch.Tensor:
    """A layer's full view: uint8 [T, latent + index bytes], natural order (see the module
    docstring). One collective over the handle's group."""
    reg = registered(handle)
    spec = _one_layer(handle, layer, latent_buf, index_buf)
    send = read_pages(spec, 0, send_slots)
    recv = reg.group.all_gather_rows(send, send.shape[0])
    return recv.view(-1, spec.fmts[0].bytes_per_token).index_select(0, view_index)


@all_gather_pages.register_fake
def _(latent_buf: torch.Tensor, index_buf: torch.Tensor | None, send_slots: torch.Tensor,
      view_index: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
    fmt = registered(handle).spec.fmts[layer]
    return latent_buf.new_empty(view_index.shape[0], fmt.bytes_per_token)


@torch.library.custom_op("cpkv::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, handle: int, max_rows: int) -> torch.Tensor:
    """Every rank's rows of ``x`` ([n <= max_rows, ...]), rank-major, each block padded to
    ``max_rows`` (padding rows are never read): one collective."""
    return registered(handle).group.all_gather_rows(x, max_rows)


@gather_rows.register_fake
def _(x: torch.Tensor, handle: int, max_rows: int) -> torch.Tensor:
    c = registered(handle).group.size
    return x.new_empty(c * max_rows, *x.shape[1:])
