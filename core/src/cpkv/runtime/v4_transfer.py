"""DeepSeek-V4 prefill -> decode transfer: each prefill rank sends the entries it owns and the
tail holder the tail bundle (:mod:`cpkv.disagg.v4_bundle`), through the transfer protocol over
the selected transfer plugin; the decode rank publishes a request only when every part arrived
and checks out, then assembles its decode state.

Both sides stage the bytes in a small one-layer pool of raw pages
(:data:`~cpkv.disagg.v4_bundle.V4_STAGE_FORMAT`): the protocol moves pages of a pool, and the
V4 pieces are written into (and read out of) such pages once a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cpkv.comm import CPGroup
from cpkv.disagg import (
    DecodeReceiver,
    DecodeTransfer,
    PrefillTransfer,
    Received,
    Sent,
    open_link,
    registered_buffers,
)
from cpkv.disagg.v4_bundle import (
    V4_STAGE_FORMAT,
    V4Image,
    V4Shapes,
    pack_owned,
    pack_tail,
    read_image,
    write_piece,
)
from cpkv.kv import ShardedKVPool
from cpkv.kv.v4_state import V4DecodeState, V4OwnedEntries, V4TailBundle, assemble_v4_state

from .setup import resolve_ops

if TYPE_CHECKING:
    from cpkv.disagg import Transport
    from cpkv.settings import Settings

__all__ = ["V4StateReceiver", "V4StateSender", "v4_stage_pool"]

#: the meta key the image rides under (next to e.g. ``first_token``)
IMAGE_KEY = "v4_image"


def v4_stage_pool(settings: Settings, pages: int) -> ShardedKVPool:
    """A one-rank pool of ``pages`` raw staging pages (:data:`V4_STAGE_FORMAT`)."""
    group = CPGroup.single()
    table, _ = resolve_ops(settings, group)
    return ShardedKVPool(V4_STAGE_FORMAT, 1, group, table, pages_per_rank=max(1, pages))


class V4StateSender:
    """A prefill rank's sending side (endpoint ``group.rank`` of the transfer). ``pages``: the
    staging pages it may need for one request (:meth:`V4Image.local_pages`)."""

    def __init__(self, transport: Transport, settings: Settings, group: CPGroup, pages: int,
                 world_ranks: tuple[int, ...] | None = None) -> None:
        self.rank, self.pool = group.rank, v4_stage_pool(settings, pages)
        link = open_link(transport, settings, endpoint=group.rank, cp_size=group.size,
                         pool=self.pool, world_ranks=world_ranks)
        self.sender = PrefillTransfer(link, self.pool, group.rank, group.size,
                                      debug=settings.debug,
                                      max_inflight_bytes=settings.transfer.max_inflight_mb << 20)

    def send(self, shapes: V4Shapes, image: V4Image, owned: V4OwnedEntries,
             tail: V4TailBundle | None, meta: Mapping[str, Any] | None = None) -> Sent:
        """Send this rank's part of ``image`` (every prefill rank calls it with the same image
        and meta); returns once the decode rank published the request.

        Raises:
            ValueError: the pieces do not match the image, or need more staging pages.
            TransferError: the decode rank refused or did not publish it.
        """
        need = image.local_pages(self.rank)
        if need > self.pool.store.capacity:
            raise ValueError(f"request {image.request!r}: {need} staging pages on rank "
                             f"{self.rank}, the stage holds {self.pool.store.capacity}")
        bufs = registered_buffers(self.pool.store)
        own = pack_owned(shapes, owned)
        if own.numel() != image.owned_bytes[self.rank]:
            raise ValueError(f"rank {self.rank}: {own.numel()} bytes of owned entries, the image "
                             f"says {image.owned_bytes[self.rank]}")
        n = write_piece(bufs, 0, own)
        if self.rank == image.tail_rank:
            if tail is None:
                raise ValueError(f"rank {self.rank} holds the tail of {image.request!r} but "
                                 f"was given no bundle")
            raw = pack_tail(shapes, tail)
            if raw.numel() != image.tail_bytes:
                raise ValueError(f"tail bundle of {raw.numel()} bytes, the image says "
                                 f"{image.tail_bytes}")
            write_piece(bufs, n, raw)
        return self.sender.send(image.manifest(), {**(meta or {}), IMAGE_KEY: image})

    def close(self) -> None:
        self.sender.close()


class V4StateReceiver:
    """The decode rank's receiving side (endpoint ``cp_size``); ``pages``: staging pages for
    the largest request."""

    def __init__(self, transport: Transport, settings: Settings, cp_size: int, pages: int,
                 world_ranks: tuple[int, ...] | None = None) -> None:
        self.pool = v4_stage_pool(settings, pages)
        self.receiver = DecodeReceiver(self.pool.pages, self.pool.store, debug=settings.debug)
        link = open_link(transport, settings, endpoint=cp_size, cp_size=cp_size, pool=self.pool,
                         world_ranks=world_ranks)
        self.transfer = DecodeTransfer(link, self.receiver, cp_size)

    def receive(self, shapes: V4Shapes) -> tuple[V4DecodeState, Received]:
        """Receive, check and publish the next request, then assemble its decode state (its
        staging pages are free again).

        Raises:
            TransferError: refused or failed (nothing published).
            ValueError: the published pages do not assemble (an entry without an owner).
        """
        got = self.transfer.receive()
        rid = got.manifest.request
        image: V4Image = got.meta[IMAGE_KEY]
        try:
            slots = self.receiver.pages.requests[rid].slots
            owned, tail = read_image(registered_buffers(self.pool.store), slots, image, shapes)
        finally:
            self.receiver.free(rid)
        return assemble_v4_state(owned, tail), got

    def close(self) -> None:
        self.transfer.close()
