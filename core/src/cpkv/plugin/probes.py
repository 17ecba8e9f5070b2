"""Availability checks that several plugins' probes share. Importing this module imports no
torch: a check imports it when called, so a plugin's probe stays light until it runs."""

from __future__ import annotations

__all__ = ["cuda_device_missing"]


def cuda_device_missing() -> str | None:
    """Why this process can use no CUDA device (torch does not import, or it sees no device), or
    None when one is visible. A broken torch install is a reason, not a crash."""
    try:
        import torch
    except Exception as exc:
        return f"torch cannot be imported ({exc!r}), so no CUDA device can be used"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None
