"""cpkv's per-layer calls as ``torch.library`` custom ops, so an engine's forward that calls
them compiles with ``torch.compile(fullgraph=True)`` (each op is one opaque node with a fake
implementation for tracing) and replays under CUDA graphs (device work only, no host sync).

The ops take tensors, integers and a string only. What they need beyond the layer's tensors (the
formats, the layout, the CP group) is registered once under a string handle (:func:`register`);
a layer is named by its tensors alone (its format is the one whose byte widths they have:
:func:`layer_format`), never by an index, so that a compiled forward calling them for every
layer is one graph (an int argument would be a constant the compiler specializes on):

* ``cpkv::put_bytes(latent_buf, index_buf, rows, latent, index_k?, handle)``: already-packed
  rows into token rows ``rows`` of the layer's tensors, in the layout's format (mutates the
  buffers).
* ``cpkv::take_bytes(latent_buf, index_buf, rows, handle) -> (latent, index_k)``: packed rows
  back out (``index_k`` is [N, 0] for a layer without one).
* ``cpkv::all_gather_pages(latent_buf, index_buf, send_slots, view_index, handle)``:
  ``-> rows``: this rank's pages ``send_slots`` as canonical blocks, one all-gather over the group, the
  full view's rows [T, latent + index bytes] in natural order (``view_index``: the token row of
  each view key in the gathered pages).
* ``cpkv::owner_put_bytes(latent_buf, index_buf, rows, src, dst, handle, max_rows)``:
  owner writes: every rank's packed rows all-gathered, this rank's stored (the collective and
  the writes in one op that mutates the buffers: a compiler keeps it on every rank).

For one-tensor layouts ``latent_buf`` is the layer's ``[pages, ps, B]`` tensor; ``index_buf`` is
an empty uint8 tensor there and for a two-part layer without index-K (a mutated argument is a
tensor, never None: inductor orders the ops through their mutations).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import KVFormat
from cpkv.kv.buffers import (
    BufferLayout,
    KVBufferSpec,
    LayerBuffers,
    read_pages,
    read_rows,
    write_rows,
)

__all__ = ["Registered", "layer_format", "register", "registered", "unregister"]


@dataclass(frozen=True)
class Registered:
    """What the ops read by handle: the buffers' spec (format, layout) and the CP group."""

    spec: KVBufferSpec
    group: CPGroup


_HANDLES: dict[str, Registered] = {}
_NEXT = count(1)


def register(spec: KVBufferSpec, group: CPGroup) -> str:
    """A handle for the ops over ``spec``'s buffers and ``group`` (host work, once). A string:
    a compiler keeps it a constant (an int that differs between two compiled engines would be
    made symbolic, and the fake kernels look it up)."""
    h = f"cpkv-kv-{next(_NEXT)}"
    _HANDLES[h] = Registered(spec=spec, group=group)
    return h


def registered(handle: str) -> Registered:
    """What ``handle`` stands for.

    Raises:
        KeyError: an unknown (or unregistered) handle.
    """
    try:
        return _HANDLES[handle]
    except KeyError:
        raise KeyError(f"no cpkv buffers are registered under handle {handle}") from None


def unregister(handle: str) -> None:
    """Forget ``handle`` (an engine that closes its KV)."""
    _HANDLES.pop(handle, None)


def layer_format(handle: str, latent_buf: torch.Tensor, index_buf: torch.Tensor) -> KVFormat:
    """The format of the layer whose tensors are ``latent_buf`` / ``index_buf``: the registered
    format whose byte widths they have (the layers of one spec differ only in whether they cache
    index-K; shapes only, so it also runs on a compiler's fake tensors).

    Raises:
        ValueError: no registered format fits the tensors.
    """
    spec = registered(handle).spec
    two = spec.layout is BufferLayout.TWO_PART
    width = int(latent_buf.shape[-1])
    has_idx = index_buf.numel() > 0
    for f in dict.fromkeys(spec.fmts):
        if (width == f.latent_bytes_per_token and has_idx == (f.index_bytes_per_token > 0)
                if two else width == f.bytes_per_token):
            return f
    raise ValueError(f"no format of handle {handle} stores {width}-byte rows "
                     f"({'with' if has_idx else 'without'} index-K)")


def _one_layer(handle: str, latent_buf: torch.Tensor, index_buf: torch.Tensor) -> KVBufferSpec:
    """A one-layer spec over the tensors the op was given (their format, the layout of
    ``handle``)."""
    spec = registered(handle).spec
    fmt = layer_format(handle, latent_buf, index_buf)
    if spec.layout is BufferLayout.TWO_PART:
        lb = LayerBuffers(latent=latent_buf, index_k=index_buf if index_buf.numel() else None)
    else:
        lb = LayerBuffers(kv=latent_buf)
    return KVBufferSpec(fmts=(fmt,), layout=spec.layout, layers=(lb,),
                        capacity=int(latent_buf.shape[0]))


@torch.library.custom_op("cpkv::put_bytes", mutates_args=("latent_buf", "index_buf"))
def put_bytes(latent_buf: torch.Tensor, index_buf: torch.Tensor, rows: torch.Tensor,
              latent: torch.Tensor, index_k: torch.Tensor | None, handle: str) -> None:
    """Store packed rows (uint8 [N, latent bytes], [N, index bytes] or None) at token rows
    ``rows`` (int64 [N]) of one layer's buffers, in their layout."""
    write_rows(_one_layer(handle, latent_buf, index_buf), 0, rows, latent, index_k)


@put_bytes.register_fake
def _(latent_buf: torch.Tensor, index_buf: torch.Tensor, rows: torch.Tensor,
      latent: torch.Tensor, index_k: torch.Tensor | None, handle: str) -> None:
    return None


@torch.library.custom_op("cpkv::take_bytes", mutates_args=())
def take_bytes(latent_buf: torch.Tensor, index_buf: torch.Tensor, rows: torch.Tensor,
               handle: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed rows at token rows ``rows`` of one layer: (uint8 [N, latent bytes], uint8
    [N, index bytes], or [N, 0] for a layer without index-K)."""
    lat, idx = read_rows(_one_layer(handle, latent_buf, index_buf), 0, rows)
    return lat, idx if idx is not None else lat.new_zeros(lat.shape[0], 0)


@take_bytes.register_fake
def _(latent_buf: torch.Tensor, index_buf: torch.Tensor, rows: torch.Tensor,
      handle: str) -> tuple[torch.Tensor, torch.Tensor]:
    fmt, n = layer_format(handle, latent_buf, index_buf), rows.shape[0]
    return (latent_buf.new_empty(n, fmt.latent_bytes_per_token),
            latent_buf.new_empty(n, fmt.index_bytes_per_token))


@torch.library.custom_op("cpkv::all_gather_pages", mutates_args=())
def all_gather_pages(latent_buf: torch.Tensor, index_buf: torch.Tensor,
                     send_slots: torch.Tensor, view_index: torch.Tensor,
                     handle: str) -> torch.Tensor:
    """A layer's full view: uint8 [T, latent + index bytes], natural order (see the module
    docstring). One collective over the handle's group."""
    reg = registered(handle)
    spec = _one_layer(handle, latent_buf, index_buf)
    send = read_pages(spec, 0, send_slots)
    recv = reg.group.all_gather_rows(send, send.shape[0])
    return recv.view(-1, spec.fmts[0].bytes_per_token).index_select(0, view_index)


@all_gather_pages.register_fake
def _(latent_buf: torch.Tensor, index_buf: torch.Tensor, send_slots: torch.Tensor,
      view_index: torch.Tensor, handle: str) -> torch.Tensor:
    fmt = layer_format(handle, latent_buf, index_buf)
    return latent_buf.new_empty(view_index.shape[0], fmt.bytes_per_token)


@torch.library.custom_op("cpkv::owner_put_bytes", mutates_args=("latent_buf", "index_buf"))
def owner_put_bytes(latent_buf: torch.Tensor, index_buf: torch.Tensor, rows: torch.Tensor,
                    src: torch.Tensor, dst: torch.Tensor, handle: str, max_rows: int) -> None:
    """Owner writes (rule 14): every rank's packed rows (``rows``: uint8 [n <= max_rows, latent
    + index bytes]) gathered rank-major (one collective), then the rows ``src`` of the gathered
    rows this rank owns stored at token rows ``dst``. One op with the collective inside and the
    buffers as its mutated arguments, so a compiler never drops it on a rank that owns none of
    the rows (a collective every rank must make)."""
    got = registered(handle).group.all_gather_rows(rows, max_rows)
    spec = _one_layer(handle, latent_buf, index_buf)
    mine = got.index_select(0, src)
    n = spec.fmts[0].latent_bytes_per_token
    write_rows(spec, 0, dst, mine[:, :n], mine[:, n:] if spec.has_index_k(0) else None)


@owner_put_bytes.register_fake
def _(latent_buf: torch.Tensor, index_buf: torch.Tensor, rows: torch.Tensor, src: torch.Tensor,
      dst: torch.Tensor, handle: str, max_rows: int) -> None:
    return None
