"""Prefill -> decode transfer of owned pages (contract rules 25-27)."""

from .connect import open_link, select_transport
from .flow import PIPELINES, DecodeTransfer, PrefillTransfer, Received, Sent
from .plan import PageRun, RankTransfer, TransferManifest, coalesce, manifest_for, rank_transfer
from .receiver import DecodeReceiver, TransferError, pack_part, page_checksums, part_nbytes
from .sender import SendWorker, Stream
from .transport import (
    Ack,
    DistSideChannel,
    Done,
    Grant,
    Link,
    LinkSpec,
    Offer,
    SideChannel,
    StoreSideChannel,
    Transport,
    store_side_channel,
)

__all__ = [
    "PIPELINES",
    "Ack",
    "DecodeReceiver",
    "DecodeTransfer",
    "DistSideChannel",
    "Done",
    "Grant",
    "Link",
    "LinkSpec",
    "Offer",
    "PageRun",
    "PrefillTransfer",
    "RankTransfer",
    "Received",
    "SendWorker",
    "Sent",
    "SideChannel",
    "StoreSideChannel",
    "Stream",
    "TransferError",
    "TransferManifest",
    "Transport",
    "coalesce",
    "manifest_for",
    "open_link",
    "pack_part",
    "page_checksums",
    "part_nbytes",
    "rank_transfer",
    "select_transport",
    "store_side_channel",
]
