"""Typed contracts of cpkv: frozen pydantic values that every layer agrees on.

Nothing here holds a tensor or imports torch; tensors travel as arguments next to these models.
The backend op Protocol (:class:`KVOps`) lives here too, its tensor types for type checkers only.
"""

from ._base import Contract, Count, CPSize, PageIndex, PageSize, Position, Rank
from .fallback import FallbackEvent, FallbackPolicy, FallbackReason
from .formats import (
    BufferLayout,
    KVDtype,
    KVFormat,
    LayerFormats,
    MaterializeMode,
    PageLayout,
    layer_formats,
    pages_nbytes,
)
from .ops import KVOps, KVPart, Op, OpDeclined, RopeStyle
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
from .plugin import Availability, PluginInfo, PluginKind

__all__ = [
    "Availability",
    "BufferLayout",
    "CPPlan",
    "CPSize",
    "Contract",
    "Count",
    "FallbackEvent",
    "FallbackPolicy",
    "FallbackReason",
    "KVDtype",
    "KVFormat",
    "KVOps",
    "KVPart",
    "LayerFormats",
    "MaterializeMode",
    "Op",
    "OpDeclined",
    "OwnerMap",
    "PageExtent",
    "PageIndex",
    "PageLayout",
    "PageSize",
    "PluginInfo",
    "PluginKind",
    "Position",
    "Rank",
    "RequestPlan",
    "RequestSpec",
    "RopeStyle",
    "RowBlock",
    "Segment",
    "SplitMode",
    "cdiv",
    "layer_formats",
    "pages_nbytes",
]
