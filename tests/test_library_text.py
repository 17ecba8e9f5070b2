"""Library code states reasons, not places: no development machine's name and no absolute path
to notes outside the repository in the shipped sources (core, backends, plugins)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the distributions' sources (``*/src``: not a wheel build's ``build/lib`` copies)
SOURCES = [p for d in ("core", "backends", "plugins") for p in sorted((ROOT / d).rglob("*.py"))
           if "src" in p.relative_to(ROOT).parts]
#: a machine named by who lent it, or a path that exists only where the code was written
PLACES = re.compile(r"lent machine|/work/|shared/notes|the GPU machine", re.IGNORECASE)


def test_library_sources_name_no_places() -> None:
    assert SOURCES
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in SOURCES
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if PLACES.search(line)]
    assert not hits, "\n".join(hits)
