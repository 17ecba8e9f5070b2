"""The ``mooncake`` transfer's own settings: the ``[transfer.mooncake]`` table, validated once
(when a link connects) with the limits written here only. Light: pydantic, no torch, no engine.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DIRECT_PROTOCOLS", "ENGINE_MAX_IN_FLIGHT", "STAGE_MAX_MB", "MooncakeSettings",
           "batch_limit"]

#: entries in flight to one peer past which the engine's TCP path to it breaks (-1 with part of
#: the data written; the path stays broken until a new engine is made)
ENGINE_MAX_IN_FLIGHT = 2048
#: the largest staging buffer, MiB
STAGE_MAX_MB = 4096
#: protocols whose engine reads device memory itself (GPUDirect RDMA, CUDA IPC): ``auto`` does not
#: stage for them. Every other one (``tcp``...) copies device memory through the host with a
#: synchronous ``cudaMemcpy`` per slice (tcp_transport: ``ClientSession::writeBody``), which
#: waits for the prefill's queued kernels on the legacy default stream and blocks the later ones.
DIRECT_PROTOCOLS = ("rdma", "nvlink", "nvlink_intra")


def batch_limit() -> int:
    """The largest allowed ``max_batch_entries``: 1024 (half the engine's per-peer queue), or half
    of ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` when that is set."""
    raw = os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "")
    queue = int(raw) if raw.strip().isdigit() else ENGINE_MAX_IN_FLIGHT
    return max(1, min(queue, 65535) // 2)


class MooncakeSettings(BaseModel):
    """``[transfer.mooncake]``: closed, so a misspelt key is an error that names it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: Literal["tcp", "rdma", "nvlink", "nvlink_intra"] = Field(
        "tcp", description="the engine's transport: 'tcp', 'rdma' (RDMA NIC), 'nvlink' "
                           "(multi-node NVLink) or 'nvlink_intra' (GPUs of one host: CUDA IPC "
                           "over NVLink; refused at connect where the wheel, the device or the "
                           "memory cannot do it)")
    hostname: str = Field("127.0.0.1", min_length=1,
                          description="the address this host's engine (and the decode's side "
                                      "channel store) listens on")
    retries: int = Field(0, ge=0, le=10, description="retries of a failed batch write, each on a "
                                                     "fresh sender engine")
    max_batch_entries: int = Field(
        1024, description="entries per batch write, 1..batch_limit() (1024 unless "
                          "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER says otherwise): the engine "
                          "breaks a peer path past ~2048 entries in flight")
    stage: Literal["auto", "host", "none"] = Field(
        "auto", description="sender side: 'host' gathers the pages it sends into a pinned host "
                            "buffer (on a side stream) and the engine writes from there; 'none' "
                            "lets the engine read the pool itself; 'auto': 'host' for CUDA pools "
                            "unless the protocol reads device memory itself ('rdma', 'nvlink', "
                            "'nvlink_intra')")
    stage_mb: float = Field(64.0, gt=0, le=STAGE_MAX_MB,
                            description="the sender's staging buffer (MiB, at least one page is "
                                        "used); a larger send is staged and written in pieces")

    @field_validator("max_batch_entries")
    @classmethod
    def _within_engine_limit(cls, v: int) -> int:
        limit = batch_limit()
        if not 1 <= v <= limit:
            raise ValueError(f"max_batch_entries = {v} is outside 1..{limit}: the Mooncake engine "
                             f"breaks a peer path past ~{ENGINE_MAX_IN_FLIGHT} entries in flight")
        return v
