"""The example backend's op: ``rerange`` with ``torch.take_along_dim`` (the torch reference uses
``index_select``); the result is the same bit for bit, which ``cpkv.testing.conformance`` checks."""

from __future__ import annotations

import math

import torch

__all__ = ["ExampleOps"]


class ExampleOps:
    """Provides exactly the ops listed in the plugin's ``OPS``: one method per op."""

    def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """Rank-major padded rows back to natural order: ``natural[n] = gathered[perm[n]]``.

        Args:
            gathered: [R, ...] all-gathered rows (any dtype, any trailing shape).
            perm: int64 [N] on ``gathered.device``.

        Returns:
            a new contiguous [N, ...] tensor. No host sync.
        """
        # [R, F] with F spelled out: reshape(R, -1) is ambiguous when R == 0
        rows = gathered.reshape(gathered.shape[0], math.prod(gathered.shape[1:]))
        index = perm.reshape(-1, 1).expand(perm.shape[0], rows.shape[1])
        out = torch.take_along_dim(rows, index, dim=0)
        return out.reshape(perm.shape[0], *gathered.shape[1:])
