"""Split and gather of per-token rows (hidden states, new KV rows) across the CP group.

``RowLayout`` is built once per batch from the plan: the natural-order rows this rank computes
(split) and the permutation that turns the rank-major padded all-gather back into natural order
(rerange, rule 8/24). Both are device tensors, so the per-layer path never builds host tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.contracts import CPPlan

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.ops import OpTable

__all__ = ["RowLayout"]


@dataclass(frozen=True)
class RowLayout:
    """Where this rank's rows come from and how gathered rows go back to natural order."""

    rank: int
    cp_size: int
    num_local: int
    max_rank_len: int
    #: int64 [num_local]: natural-order row of each local row
    local_index: torch.Tensor
    #: int64 [num_tokens]: row of natural token n inside the rank-major padded gather
    perm: torch.Tensor

    @classmethod
    def build(cls, plan: CPPlan, rank: int, device: torch.device | str = "cpu") -> RowLayout:
        """From the plan's row blocks, with torch ops on the host (once per batch); equal to
        ``plan.local_row_indices(rank)`` and ``plan.gather_permutation()``."""
        offs = plan.natural_offsets()
        width = plan.max_rank_len
        nat: list[torch.Tensor] = []
        slot: list[torch.Tensor] = []
        local = torch.zeros(0, dtype=torch.int64)
        for r in range(plan.cp_size):
            parts = [torch.arange(b.start, b.end, dtype=torch.int64)
                     + (offs[b.request] - plan.requests[b.request].prefix_len)
                     for b in plan.rank_blocks(r)]
            rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            if r == rank:
                local = rows
            nat.append(rows)
            slot.append(r * width + torch.arange(rows.numel(), dtype=torch.int64))
        perm = torch.empty(plan.num_tokens, dtype=torch.int64)
        perm[torch.cat(nat)] = torch.cat(slot)
        return cls(rank=rank, cp_size=plan.cp_size, num_local=local.numel(), max_rank_len=width,
                   local_index=local.to(device), perm=perm.to(device))

    def split(self, x: torch.Tensor, ops: OpTable) -> torch.Tensor:
        """This rank's rows of a natural-order tensor ``x`` [num_tokens, ...]."""
        return ops.page_gather(x, self.local_index)

    def gather(self, local: torch.Tensor, group: CPGroup, ops: OpTable) -> torch.Tensor:
        """Every rank's rows back in natural order: one all-gather, then one rerange pass (on a
        one-rank group the local rows are every row in natural order: ``local`` itself)."""
        if local.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} has {self.num_local} local rows, got a tensor of "
                             f"{local.shape[0]}")
        if self.cp_size == 1:
            return local
        gathered = group.all_gather_rows(local, self.max_rank_len)
        return ops.rerange(gathered, self.perm)

    def gather_rows(self, local: torch.Tensor, rows: torch.Tensor, group: CPGroup) -> torch.Tensor:
        """The natural-order rows ``rows`` (int64 ``[m]`` on the group's device) of every rank's
        rows, without gathering the rest: ``gather(local)[rows]`` for ``m`` rows' bytes (a
        prefill's last rows: a few rows instead of the whole batch's hidden states).

        Each rank puts the selected rows it owns in an ``[m, ...]`` buffer (the others are never
        read), one all-gather moves ``size * m`` rows, and each row is taken from its owner's
        block: exact, device ops only (no host sync)."""
        if local.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} has {self.num_local} local rows, got a tensor of "
                             f"{local.shape[0]}")
        if self.cp_size == 1:
            return local[rows]
        slot = self.perm[rows]  # row in the rank-major padded gather
        owner, at = slot // self.max_rank_len, slot % self.max_rank_len
        m = rows.numel()
        mine = local[at.clamp(max=max(self.num_local - 1, 0))] if self.num_local else \
            local.new_zeros((m, *local.shape[1:]))
        gathered = group.all_gather_rows(mine.contiguous(), m)
        return gathered[owner * m + torch.arange(m, device=rows.device)]
