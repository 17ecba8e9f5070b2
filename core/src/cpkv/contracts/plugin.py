"""Plugin descriptions: what `cpkv plugins` shows and what selection reasons about."""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import model_validator

from ._base import Contract

__all__ = ["Availability", "Op", "OpDeclined", "PluginInfo", "PluginKind"]


class OpDeclined(Exception):
    """Raised by a backend's op, before it touches anything, when it cannot take this call
    (a shape, dtype or device its kernel does not support): the next backend of the preference
    that provides the op runs it instead, reported once per reason as fallback ``op_declined``.
    The message says why (it is the event's detail). The decision must depend only on what is
    the same on every rank (shapes, dtypes, settings)."""


class PluginKind(StrEnum):
    BACKEND = "backend"
    TRANSFER = "transfer"


class Op(StrEnum):
    """Compute ops a backend may provide. A backend lists the ops it implements."""

    PAGE_GATHER = "page_gather"
    PAGE_SCATTER = "page_scatter"
    PAGE_COPY = "page_copy"
    RERANGE = "rerange"
    FP8_PACK = "fp8_pack"
    FP8_UNPACK = "fp8_unpack"
    PEER_GATHER = "peer_gather"
    INDEXER_LOGITS = "indexer_logits"
    INDEXER_LOGITS_PAGED = "indexer_logits_paged"
    TOPK = "topk"
    SPARSE_MLA = "sparse_mla"
    SPARSE_MLA_PAGED = "sparse_mla_paged"
    ROPE = "rope"


class Availability(Contract):
    """Result of a plugin's availability probe. ``reason`` says precisely why not."""

    available: bool
    reason: str = ""

    @model_validator(mode="after")
    def _reason_when_unavailable(self) -> Self:
        if not self.available and not self.reason:
            raise ValueError("an unavailable plugin must say why (reason is empty)")
        return self

    @classmethod
    def yes(cls) -> Availability:
        return cls(available=True)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(available=False, reason=reason)


class PluginInfo(Contract):
    """One discovered plugin, as listed by `cpkv plugins`."""

    name: str
    kind: PluginKind
    distribution: str
    version: str
    entry_point: str
    ops: tuple[str, ...] = ()
    availability: Availability
    description: str = ""
