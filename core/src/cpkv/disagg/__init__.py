"""Prefill -> decode transfer of owned pages (contract rules 25-27).

Transfer plugins import from :mod:`cpkv.disagg.api` only (the transfer SDK).
"""

from . import transport
from .buffers import PoolBuffers, registered_buffers
from .connect import open_link, select_transport
from .errors import TransferError, TransferFenced, TransferRefused
from .flow import PIPELINES, DecodeTransfer, PrefillTransfer, Received, Sent
from .plan import PageRun, RankTransfer, TransferManifest, coalesce, manifest_for, rank_transfer
from .receiver import DecodeReceiver, pack_part, page_checksums, part_nbytes
from .sender import SendWorker, Stream
from .transport import *  # noqa: F403  (the transport protocol, listed once in transport.__all__)

__all__ = [
    "PIPELINES",
    "DecodeReceiver",
    "DecodeTransfer",
    "PageRun",
    "PoolBuffers",
    "PrefillTransfer",
    "RankTransfer",
    "Received",
    "SendWorker",
    "Sent",
    "Stream",
    "TransferError",
    "TransferFenced",
    "TransferManifest",
    "TransferRefused",
    "coalesce",
    "manifest_for",
    "open_link",
    "pack_part",
    "page_checksums",
    "part_nbytes",
    "rank_transfer",
    "registered_buffers",
    "select_transport",
    *transport.__all__,
]
