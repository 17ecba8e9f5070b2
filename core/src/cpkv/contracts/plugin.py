"""Plugin descriptions: what `cpkv plugins` shows and what selection reasons about."""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import model_validator

from ._base import Contract

__all__ = ["Availability", "PluginInfo", "PluginKind"]


class PluginKind(StrEnum):
    BACKEND = "backend"
    TRANSFER = "transfer"


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
