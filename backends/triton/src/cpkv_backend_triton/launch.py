"""What the wrappers share: a launch's padded power of two, whether a kernel runs on the CPU
interpreter, the launcher that retries with fewer stages when a specialisation runs out of
shared memory, and the once-per-reason report (fallback ``kernel_variant``, contract rule 30)
of a kernel variant that cannot take a call (Gluon absent, a ROCm device without inline PTX).
"""

from __future__ import annotations

import math
from typing import Any

import triton

from cpkv.ops.api import FallbackReason, report_fallback

__all__ = ["Launcher", "interpreted", "pow2", "report_variant_declined"]


def pow2(x: int, lo: int = 16) -> int:
    """The power of two at or above ``x``, at least ``lo``."""
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` runs on Triton's CPU interpreter (defined under ``TRITON_INTERPRET=1``)."""
    return type(kernel).__name__ == "InterpretedFunction"


def report_variant_declined(said: set[str], op: str, requested: str, selected: str,
                            why: str) -> None:
    """Report fallback ``kernel_variant`` for ``why`` unless ``said`` holds it (then add it):
    each reason once per ``said`` (a module's or an object's)."""
    if why in said:
        return
    said.add(why)
    report_fallback(op=op, requested=requested, selected=selected,
                    reason=FallbackReason.KERNEL_VARIANT, detail=why)


class Launcher:
    """``launcher(key, kernel, grid, args, constexprs, num_warps, num_stages)`` launches
    ``kernel[grid](*args, **constexprs, ...)``; a specialisation ``key`` that runs out of shared
    memory is retried with fewer stages (on the host, before any device work), reported once as
    fallback ``kernel_variant``, and launched with them from then on."""

    def __init__(self) -> None:
        self._stages: dict[tuple[Any, ...], int] = {}

    def __call__(self, key: tuple[Any, ...], kernel: Any, grid: tuple[int, ...],
                 args: tuple[Any, ...], consts: dict[str, Any], num_warps: int,
                 num_stages: int) -> None:
        stages = self._stages.get(key, num_stages)
        while True:
            try:
                kernel[grid](*args, **consts, num_warps=num_warps, num_stages=stages)
            except triton.runtime.errors.OutOfResources:
                if stages <= 1:
                    raise
                stages -= 1
                continue
            if key not in self._stages and stages != num_stages:  # once per specialisation
                report_fallback(op=f"triton:{getattr(kernel, '__name__', 'kernel')}",
                                requested=f"num_stages={num_stages}",
                                selected=f"num_stages={stages}",
                                reason=FallbackReason.KERNEL_VARIANT,
                                detail=f"out of shared memory for {key}")
            self._stages[key] = stages
            return
