"""DeepSeek-V4's top-k over compressed entries (contract rule 39): the formula of the
``v4_topk`` op (the torch reference backend calls it, as it calls
:func:`cpkv.models.rope.apply_rope` for ``rope``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["stable_topk"]


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` column indices per row of ``scores`` ``[N, E]`` (-inf: not selectable), ties
    broken by the lower index (contract rule 39); -1 where fewer than ``k`` are selectable.

    A stable sort of each row: the choice and its order depend on the row's values alone (not
    on E, the entries past the row's causal ones being -inf), so a chunk and the one-piece
    prefill select alike."""
    n, e = scores.shape
    if k == 0 or e == 0:
        return torch.full((n, k), -1, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx = order.indices[:, :k]
    ok = torch.isfinite(order.values[:, :k])
    out = torch.where(ok, idx, torch.full_like(idx, -1))
    if out.shape[1] < k:
        out = F.pad(out, (0, k - out.shape[1]), value=-1)
    return out
