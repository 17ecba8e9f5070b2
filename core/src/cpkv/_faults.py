"""A fault hook for tests: make one rank hang at a named point, to show that the bounds catch it.

Honoured only when a test sets the environment variable :data:`HANG_ENV` (no settings key, no
command-line flag): ``_CPKV_FAULT_HANG="prefill:1"`` makes CP rank 1 stop making progress at the
start of its first prefill batch (it sleeps until it is killed). The rank processes inherit it.
"""

from __future__ import annotations

import os
import time

__all__ = ["HANG_ENV", "hang_if_asked"]

#: ``"<point>:<rank>"``; not a ``CPKV_`` name, so the settings never see it
HANG_ENV = "_CPKV_FAULT_HANG"


def hang_if_asked(point: str, rank: int) -> None:
    """Sleep forever when :data:`HANG_ENV` names ``point`` and ``rank`` (tests only)."""
    if os.environ.get(HANG_ENV) == f"{point}:{rank}":
        while True:
            time.sleep(3600)
