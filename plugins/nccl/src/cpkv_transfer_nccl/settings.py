"""The ``nccl`` transfer's own settings: the ``[transfer.nccl]`` table (pydantic only, light)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["NcclSettings"]


class NcclSettings(BaseModel):
    """``[transfer.nccl]``: closed, so a misspelt key is an error that names it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hostname: str = Field("127.0.0.1", min_length=1,
                          description="the address the decode endpoint hosts the side channel's "
                                      "TCP store on")
