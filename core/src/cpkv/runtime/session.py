"""PrefillSession: what an engine embeds on each rank of its CP group."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from cpkv.kv import RequestPages
from cpkv.ops import ALL_OPS
from cpkv.plugin import PluginHost

from .prefill import CPPrefill, PrefillResult
from .setup import create_pool

if TYPE_CHECKING:
    from cpkv.models import DeepseekV32
    from cpkv.settings import Settings

    from .group import CPGroup

__all__ = ["PrefillSession"]


class PrefillSession:
    """CP prefill of a loaded model on one rank: the sharded pool, the ops, the driver.

    Every rank of the CP group creates one with the same settings and calls :meth:`prefill`
    with the same batches (the calls are collectives).

    Args:
        model: the loaded model (``cpkv.models.load_model``).
        settings: run settings (``cpkv.load_settings``).
        group: this rank's CP group (``CPGroup.from_process_group()``, ``CPGroup.single()``).

    Raises:
        StartupError: the settings cannot work with this model/group (before any allocation).
    """

    def __init__(self, model: DeepseekV32, settings: Settings, group: CPGroup,
                 host: PluginHost | None = None) -> None:
        self.model, self.settings, self.group = model, settings, group
        fmt = model.kv_format(settings.kv.dtype, settings.kv.page_size)
        self.pool = create_pool(settings, fmt, model.num_layers, group, host, ops=ALL_OPS)
        self.ops = self.pool.ops
        self.driver = CPPrefill(model, self.pool, self.ops, mode=settings.cp.mode,
                                logits_budget_bytes=settings.runtime.logits_budget_mb << 20,
                                prefetch=settings.runtime.prefetch)

    def prefill(self, batch: Sequence[tuple[Hashable, Sequence[int]]], *, all_logits: bool = False,
                capture_topk: bool = False) -> PrefillResult:
        """Prefill ``[(request id, new token ids), ...]``; a request the session already holds
        continues from its cached tokens (the prefix may end inside a page)."""
        return self.driver.run(batch, all_logits=all_logits, capture_topk=capture_topk)

    def pages(self, rid: Hashable) -> RequestPages:
        """The request's logical page table: owner rank and physical slot of each page."""
        return self.pool.table[rid]

    def release(self, rid: Hashable) -> None:
        """Free a finished request's pages on every rank (call on every rank)."""
        self.pool.free(rid)
