"""The one exception the model package raises for a checkpoint it cannot load."""

from __future__ import annotations

__all__ = ["ModelLoadError"]


class ModelLoadError(ValueError):
    """A checkpoint directory cannot be loaded: missing files, wrong model type, bad or missing weights.

    The message names the path and what is wrong (a few of the offending weight names when there are many).
    """
