"""Base class and bounded integer types shared by every contract model."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CPSize", "Contract", "Count", "PageIndex", "PageSize", "Position", "Rank"]


class Contract(BaseModel):
    """Frozen, closed pydantic model: contracts are values, never mutated, never extended."""

    model_config = ConfigDict(frozen=True, extra="forbid")


Rank = Annotated[int, Field(ge=0, description="CP rank, 0..C-1")]
CPSize = Annotated[int, Field(ge=1, description="CP group size C")]
PageSize = Annotated[int, Field(ge=1, description="tokens per KV page")]
PageIndex = Annotated[int, Field(ge=0, description="logical page number inside a request")]
Position = Annotated[int, Field(ge=0, description="absolute token position inside a request")]
Count = Annotated[int, Field(ge=0)]
