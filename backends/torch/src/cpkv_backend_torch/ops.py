"""The torch reference ops: one method per :class:`cpkv.contracts.Op` the backend provides.

No ops yet (they land in a later issue); the plugin's ``ops`` set lists exactly what is here.
"""

from __future__ import annotations

__all__ = ["TorchOps"]


class TorchOps:
    """Reference implementation of cpkv's compute ops in plain torch (CPU and GPU)."""
