"""The transfer SDK: every cpkv name a transfer plugin may import, in one place.

A transfer plugin (``cpkv_transfer_nccl``, ``cpkv_transfer_mooncake``, a third party's: see
docs/transfer.md) implements :class:`Transport` and its :class:`Link` with its own engine and
takes from cpkv only what is listed here; anything else in cpkv may change without notice
(``tests/test_backend_api.py`` checks that the plugins import nothing else). Its ``plugin``
module, the entry point, registers through :mod:`cpkv.plugin` (``hookimpl``, ``TransferSpec``,
``TransferRegistrar``) and :class:`cpkv.contracts.Availability`, as a backend's does: discovery
imports it, and this module imports torch (the transport modules need it anyway).

What a plugin implements
    :class:`Transport` (what ``TransferSpec.load()`` returns; ``connect`` takes a
    :class:`LinkSpec`), :class:`Link` (``send_part`` / ``recv_part``, a :class:`SideChannel`),
    the optional capabilities :class:`FencingChannel` and :class:`DrainingLink`.

What a link is handed
    :class:`LinkSpec` (endpoint, buffers, timeouts, the plugin's settings table), its
    :class:`PoolBuffers` (the pool's :class:`KVBufferSpec`: per layer its page regions, each a
    contiguous uint8 ``[pages, bytes]`` view, and the packed part layout), a
    :class:`RankTransfer` per part (its :class:`PageRun` runs of owned pages), and on
    the decode side a :class:`PartSink` (``recv_part`` puts the received bytes there with
    ``place_packed``; the decode receiver itself stays in the core).

Side channels the core provides
    :func:`store_side_channel` (a :class:`StoreSideChannel` on a TCP store the decode endpoint
    hosts), :class:`StoreSideChannel`, :class:`DistSideChannel` (``torch.distributed`` object
    point-to-point).

Errors and reporting
    :class:`TransferError` (any failure of a send or receive), :class:`TransferFenced` (a send
    stopped by the decode's fence), :class:`TransferTimeout` (no part and no endpoint's progress
    for ``transfer.timeout_s``: waits bound silence, with a :class:`SilenceClock` over the side
    channel's progress beacons, polled every :data:`WAIT_SLICE_S` seconds); :func:`get_logger`
    (cpkv's events through standard logging until structlog is configured);
    :func:`report_fallback` with a :class:`FallbackReason` for every visible step away from what
    was asked.

Page bytes
    :class:`PageLayout` (token-major or part-major blocks), :func:`page_blocks` (writable latent
    / index-K views of page blocks in either layout), :class:`KVFormat` (bytes per token and
    page); :class:`BufferLayout` (how a pool's pages lie in its tensors: the one-tensor layouts
    or the engines' ``two_part``), :class:`KVBufferSpec` (a pool's tensors, or one laid over a
    staging buffer), :func:`region_bytes` (a layer's page bytes per region), :func:`read_pages`
    / :func:`write_pages` (canonical token-major page blocks out of and into any layout).
"""

from __future__ import annotations

from cpkv.contracts import BufferLayout, FallbackReason, KVFormat, PageLayout
from cpkv.fallback import report_fallback
from cpkv.kv.buffers import KVBufferSpec, read_pages, region_bytes, write_pages
from cpkv.logs import get_logger
from cpkv.ops import page_blocks

from .buffers import PoolBuffers
from .errors import TransferError, TransferFenced
from .plan import PageRun, RankTransfer
from .transport import (
    WAIT_SLICE_S,
    DistSideChannel,
    DrainingLink,
    FencingChannel,
    Link,
    LinkSpec,
    PartSink,
    SideChannel,
    SilenceClock,
    StoreSideChannel,
    TransferTimeout,
    Transport,
    store_side_channel,
)

__all__ = [
    "WAIT_SLICE_S",
    "BufferLayout",
    "DistSideChannel",
    "DrainingLink",
    "FallbackReason",
    "FencingChannel",
    "KVBufferSpec",
    "KVFormat",
    "Link",
    "LinkSpec",
    "PageLayout",
    "PageRun",
    "PartSink",
    "PoolBuffers",
    "RankTransfer",
    "SideChannel",
    "SilenceClock",
    "StoreSideChannel",
    "TransferError",
    "TransferFenced",
    "TransferTimeout",
    "Transport",
    "get_logger",
    "page_blocks",
    "read_pages",
    "region_bytes",
    "report_fallback",
    "store_side_channel",
    "write_pages",
]
