"""Typed contracts of cpkv: frozen pydantic values that every layer agrees on.

Nothing here holds a tensor or imports torch; tensors travel as arguments next to these models.
"""

from ._base import Contract, Count, CPSize, PageIndex, PageSize, Position, Rank
from .fallback import FallbackEvent, FallbackPolicy, FallbackReason
from .formats import KVDtype, KVFormat
from .plan import (
    CPPlan,
    OwnerMap,
    PageExtent,
    RequestPlan,
    RequestSpec,
    RowBlock,
    Segment,
    SplitMode,
    cdiv,
)
from .plugin import Availability, Op, PluginInfo, PluginKind

__all__ = [
    "Availability",
    "CPPlan",
    "CPSize",
    "Contract",
    "Count",
    "FallbackEvent",
    "FallbackPolicy",
    "FallbackReason",
    "KVDtype",
    "KVFormat",
    "Op",
    "OwnerMap",
    "PageExtent",
    "PageIndex",
    "PageSize",
    "PluginInfo",
    "PluginKind",
    "Position",
    "Rank",
    "RequestPlan",
    "RequestSpec",
    "RowBlock",
    "Segment",
    "SplitMode",
    "cdiv",
]
