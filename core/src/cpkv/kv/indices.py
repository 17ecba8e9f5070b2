"""Top-k index translation (rule 20).

The indexer's top-k columns are RAGGED indices already: offsets into the flat full view, which
sparse attention over the view consumes directly, so nothing is built for them. PAGED indices
(physical token rows in the owner's pool, for kernels that read the paged pool) are built only
when a PAGED consumer asks, from the per-batch table, with one gather and no host sync.
"""

from __future__ import annotations

import torch

from .batch import BatchKV

__all__ = ["ragged_to_paged"]


def ragged_to_paged(indices: torch.Tensor, batch: BatchKV) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner rank, physical token row) of every RAGGED index; -1 stays -1 in both.

    Args:
        indices: int32/int64 [N, k] offsets into the batch's full view, -1 padded.
    Returns:
        int64 owner [N, k] and int64 physical row [N, k] (``slot * page_size + offset`` in the
        owner's buffers; on a replicated pool every rank holds that row).
    """
    m = batch.materialize
    valid = indices >= 0
    safe = indices.long().clamp_min(0)
    owner = torch.where(valid, m.view_owner[safe], -1)
    phys = torch.where(valid, m.view_physical[safe], -1)
    return owner, phys
