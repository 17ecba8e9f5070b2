"""Prefill -> decode transfer of owned pages (contract rules 25-27).

Transfer plugins import from :mod:`cpkv.disagg.api` only (the transfer SDK).
"""

from .buffers import PoolBuffers, registered_buffers
from .connect import open_link, select_transport
from .errors import TransferError, TransferFenced, TransferRefused
from .flow import PIPELINES, DecodeTransfer, PrefillTransfer, Received, Sent
from .plan import PageRun, RankTransfer, TransferManifest, coalesce, manifest_for, rank_transfer
from .receiver import DecodeReceiver, pack_part, page_checksums, part_nbytes
from .sender import SendWorker, Stream
from .transport import (
    Ack,
    DistSideChannel,
    Done,
    DrainingLink,
    FencingChannel,
    Grant,
    Link,
    LinkFeatures,
    LinkSpec,
    Offer,
    PartSink,
    SideChannel,
    SilenceClock,
    StoreSideChannel,
    TransferTimeout,
    Transport,
    link_features,
    store_side_channel,
)

__all__ = [
    "PIPELINES",
    "Ack",
    "DecodeReceiver",
    "DecodeTransfer",
    "DistSideChannel",
    "Done",
    "DrainingLink",
    "FencingChannel",
    "Grant",
    "Link",
    "LinkFeatures",
    "LinkSpec",
    "Offer",
    "PageRun",
    "PartSink",
    "PoolBuffers",
    "PrefillTransfer",
    "RankTransfer",
    "Received",
    "SendWorker",
    "Sent",
    "SideChannel",
    "SilenceClock",
    "StoreSideChannel",
    "Stream",
    "TransferError",
    "TransferFenced",
    "TransferManifest",
    "TransferRefused",
    "TransferTimeout",
    "Transport",
    "coalesce",
    "link_features",
    "manifest_for",
    "open_link",
    "pack_part",
    "page_checksums",
    "part_nbytes",
    "rank_transfer",
    "registered_buffers",
    "select_transport",
    "store_side_channel",
]
