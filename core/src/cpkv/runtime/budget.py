"""The indexer's logits/scratch memory budget (``runtime.logits_budget_mb``), sized from the device.

The budget bounds the rows the driver hands the indexer and the top-k at once (rule 21: rows x
keys x 4 B of fp32 logits, plus the top-k's scratch). A larger budget means fewer, longer kernel
launches: at 512K keys the top-k took 3.44 s of a 5.48 s chunk at 512 MiB and 1.05 s of 3.10 s at
4 GiB. ``"auto"`` therefore takes a fixed fraction of the memory the device still has
free once the model and the pool are allocated, within bounds.

The budget may differ between the ranks of a CP group (each reads its own free memory). That is
safe because it only sets the row chunking of rank-local compute (the indexer, the top-k and the
sparse-MLA calls over this rank's rows): no collective, plan or shape another rank sees depends on
it (contract rule 1: free memory never changes a plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["AUTO_FRACTION", "AUTO_MAX_MB", "AUTO_MIN_MB", "CPU_AUTO_MB", "LogitsBudget",
           "auto_budget_mb", "logits_budget"]

#: "auto" on CUDA: this fraction of the free device memory at session start. The rest is for
#: what a chunk's rows allocate besides the logits (a 128K-token chunk's activations at DeepSeek
#: sizes: ~50 GB) and the allocator's slack. Measured on one GPU (135 GB free, 2-layer
#: v32-attention stack, 1M tokens in 128K chunks): a quarter (32 GiB) ran out of memory with 57
#: GB reserved but unallocated; 16 GiB peaked at 82 GB and ran as fast (``cpkv bench long``)
AUTO_FRACTION = 0.125
#: "auto" on CUDA: never below (today's fixed default) ...
AUTO_MIN_MB = 512
#: ... nor above this many MiB (the top-k's launches are few long before this: at 1M keys 16 GiB
#: is 4K rows a launch)
AUTO_MAX_MB = 16 << 10
#: "auto" on a CPU: the fixed default (host memory is not the bound there; cache-sized row pieces
#: inside the torch backend are)
CPU_AUTO_MB = 512


@dataclass(frozen=True)
class LogitsBudget:
    """The effective budget of a session: ``mb`` MiB, and whether ``"auto"`` chose it."""

    mb: int
    auto: bool

    @property
    def bytes(self) -> int:
        """The budget in bytes."""
        return self.mb << 20


def auto_budget_mb(free_bytes: int) -> int:
    """``AUTO_FRACTION`` of ``free_bytes`` in MiB, clamped to ``[AUTO_MIN_MB, AUTO_MAX_MB]``.

    Raises:
        ValueError: ``free_bytes`` is negative.
    """
    if free_bytes < 0:
        raise ValueError(f"free memory cannot be negative (got {free_bytes} bytes)")
    return min(AUTO_MAX_MB, max(AUTO_MIN_MB, int(free_bytes * AUTO_FRACTION) >> 20))


def logits_budget(setting: int | Literal["auto"], device: torch.device,
                  free_bytes: int | None = None) -> LogitsBudget:
    """The budget for ``runtime.logits_budget_mb = setting`` on ``device``: a number as it is;
    ``"auto"``: :func:`auto_budget_mb` of the device's free memory on CUDA (``free_bytes``, or
    ``torch.cuda.mem_get_info`` read now: one call, a host query, no device sync), else
    ``CPU_AUTO_MB``.

    Raises:
        ValueError: ``setting`` is neither a positive integer nor ``"auto"``.
    """
    if setting == "auto":
        if device.type != "cuda":
            return LogitsBudget(CPU_AUTO_MB, auto=True)
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(device)
        return LogitsBudget(auto_budget_mb(free_bytes), auto=True)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"runtime.logits_budget_mb must be a whole number of MiB >= 1 or 'auto' "
                         f"(got {setting!r})")
    return LogitsBudget(setting, auto=False)
