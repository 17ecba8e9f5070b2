"""A kernel variant the tuning table asks for that cannot take a call (Gluon absent, a ROCm
device without inline PTX, a shape the variant does not cover): the backend runs its plain
kernel and says so once per reason through cpkv's fallback choke point (contract rule 30)."""

from __future__ import annotations

from cpkv.ops.api import FallbackReason, report_fallback


def report_variant_declined(said: set[str], op: str, requested: str, selected: str,
                            why: str) -> None:
    """Report fallback ``kernel_variant`` for ``why`` unless ``said`` holds it (then add it):
    each reason once per ``said`` (a module's or an object's)."""
    if why in said:
        return
    said.add(why)
    report_fallback(op=op, requested=requested, selected=selected,
                    reason=FallbackReason.KERNEL_VARIANT, detail=why)
