"""Prefill -> decode transfer of owned pages (contract rules 25-27)."""

from .connect import open_link, select_transport
from .flow import DecodeTransfer, PrefillTransfer, Received, Sent
from .plan import PageRun, RankTransfer, TransferManifest, coalesce, manifest_for, rank_transfer
from .receiver import DecodeReceiver, TransferError, pack_part, page_checksums, part_nbytes
from .transport import (
    Ack,
    DistSideChannel,
    Grant,
    Link,
    LinkSpec,
    Offer,
    SideChannel,
    StoreSideChannel,
    Transport,
)

__all__ = ["Ack", "DecodeReceiver", "DecodeTransfer", "DistSideChannel", "Grant", "Link",
           "LinkSpec", "Offer", "PageRun", "PrefillTransfer", "RankTransfer", "Received", "Sent",
           "SideChannel", "StoreSideChannel", "TransferError", "TransferManifest", "Transport",
           "coalesce", "manifest_for", "open_link", "pack_part", "page_checksums", "part_nbytes",
           "rank_transfer", "select_transport"]
