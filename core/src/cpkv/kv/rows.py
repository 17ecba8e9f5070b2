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
    from cpkv.ops import OpTable
    from cpkv.runtime.group import CPGroup

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
        local = plan.local_row_indices(rank)
        return cls(
            rank=rank,
            cp_size=plan.cp_size,
            num_local=len(local),
            max_rank_len=plan.max_rank_len,
            local_index=torch.tensor(local, dtype=torch.int64).to(device),
            perm=torch.tensor(plan.gather_permutation(), dtype=torch.int64).to(device),
        )

    def split(self, x: torch.Tensor, ops: OpTable) -> torch.Tensor:
        """This rank's rows of a natural-order tensor ``x`` [num_tokens, ...]."""
        return ops.page_gather(x, self.local_index)

    def gather(self, local: torch.Tensor, group: CPGroup, ops: OpTable) -> torch.Tensor:
        """Every rank's rows back in natural order: one all-gather, then one rerange pass."""
        if local.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} has {self.num_local} local rows, got a tensor of "
                             f"{local.shape[0]}")
        gathered = group.all_gather_rows(local, self.max_rank_len)
        return ops.rerange(gathered, self.perm)
