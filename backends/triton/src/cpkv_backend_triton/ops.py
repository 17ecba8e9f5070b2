"""``TritonOps``: the object the ``triton`` backend loads, composed of one mixin per kernel module.

Each kernel module is imported on its own, inside a try: a module that is missing or cannot be
imported (``ImportError``) contributes an empty mixin and its error is kept in
:data:`IMPORT_ERRORS`, so the KV kernels (``kv.py``) and the attention kernels (``attention.py``)
land independently. The plugin lists the ops statically (``plugin.OPS``) and ``plugin.load``
checks that every listed op is a method here, naming these import errors otherwise.
"""

from __future__ import annotations

__all__ = ["IMPORT_ERRORS", "TritonOps"]

#: kernel module name -> repr of the ImportError that kept its mixin out
IMPORT_ERRORS: dict[str, str] = {}

try:
    from .kv import KVKernels
except ImportError as exc:
    IMPORT_ERRORS["kv"] = repr(exc)

    class KVKernels:  # type: ignore[no-redef]
        """Empty stand-in: ``cpkv_backend_triton.kv`` did not import."""

try:
    from .attention import AttentionKernels  # type: ignore[attr-defined]
except ImportError as exc:
    IMPORT_ERRORS["attention"] = repr(exc)

    class AttentionKernels:  # type: ignore[no-redef]
        """Empty stand-in: ``cpkv_backend_triton.attention`` did not import."""


try:
    from .rope import RopeKernels
except ImportError as exc:
    IMPORT_ERRORS["rope"] = repr(exc)

    class RopeKernels:  # type: ignore[no-redef]
        """Empty stand-in: ``cpkv_backend_triton.rope`` did not import."""


class TritonOps(KVKernels, AttentionKernels, RopeKernels):
    """cpkv's compute ops as Triton kernels (one method per op the plugin lists)."""
