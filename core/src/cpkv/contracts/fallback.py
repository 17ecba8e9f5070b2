"""Fallback reasons and events (contract rule 30)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from ._base import Contract

__all__ = ["FallbackEvent", "FallbackPolicy", "FallbackReason"]


class FallbackReason(StrEnum):
    """Why cpkv took a slower or different path than asked. Values are stable identifiers."""

    #: the extend spans fewer than 2C pages: token-balanced split, not page-aligned (rule 5)
    SHORT_EXTEND = "short_extend"
    #: a request is not page-aligned: owners write their pages from the full view (rule 14)
    OWNER_WRITE = "owner_write"
    #: a plugin's entry point raised while loading
    PLUGIN_LOAD_FAILED = "plugin_load_failed"
    #: a plugin loaded but its availability probe said no
    PLUGIN_UNAVAILABLE = "plugin_unavailable"
    #: a plugin is switched off by the settings
    PLUGIN_DISABLED = "plugin_disabled"
    #: the preferred backend does not provide this op
    OP_NOT_PROVIDED = "op_not_provided"
    #: a plugin named in the settings was not discovered at all
    PLUGIN_NOT_FOUND = "plugin_not_found"
    #: a kernel runs a slower variant than configured (fewer pipeline stages after an
    #: out-of-resources compile, a dense copy for a strided destination)
    KERNEL_VARIANT = "kernel_variant"
    #: a transfer batch failed and is retried (``transfer.mooncake.retries``) on a fresh engine
    TRANSFER_RETRY = "transfer_retry"
    #: ``MC_FORCE_TCP`` overrides ``transfer.mooncake.protocol = "nvlink_intra"``: plain TCP
    TRANSFER_FORCED_TCP = "transfer_forced_tcp"
    #: draft (MTP) layer without usable plan metadata embeds the full prompt (rule 32)
    DRAFT_PLAN_MISSING = "draft_plan_missing"
    #: ``kv.materialize = "p2p"`` but the ranks cannot map each other's memory: all-gather path
    PEER_MEMORY_UNAVAILABLE = "peer_memory_unavailable"
    #: a rank can serve less of a cached prefix than the others (e.g. it lost a host page):
    #: every rank uses the shortest hit and recomputes the rest
    CACHE_HIT_SHORTENED = "cache_hit_shortened"
    #: a host tier page this rank owns is gone (a failed lower-tier read, a fault): its hit stops
    #: before it, and the ranks then agree on the shorter hit (``cache_hit_shortened``)
    HOST_PAGE_MISSING = "host_page_missing"
    #: the selected backend cannot take a call (shape, dtype, device: ``OpDeclined``); the next
    #: backend of the preference that provides the op runs it
    OP_DECLINED = "op_declined"
    #: a decode step runs eagerly on a CUDA device instead of replaying a CUDA graph
    #: (``decode.cuda_graphs = false``, a batch past ``decode.max_batch``, a capture that failed)
    DECODE_EAGER = "decode_eager"
    #: the model's KV has no pool in the requested ``kv.dtype`` (DeepSeek-V4's FP8 entries are
    #: not built): it is kept in the model's dtype
    KV_DTYPE_UNAVAILABLE = "kv_dtype_unavailable"


class FallbackPolicy(StrEnum):
    """What a fallback does: log a warning and continue, or raise."""

    WARN = "warn"
    ERROR = "error"


class FallbackEvent(Contract):
    """One fallback, as logged (event ``cpkv.fallback``) and counted in a run's report."""

    op: str = Field(min_length=1, description="what was being chosen or done, e.g. 'split_plan'")
    requested: str = Field(description="what was asked for")
    selected: str = Field(description="what runs instead")
    reason: FallbackReason
    detail: str = ""
