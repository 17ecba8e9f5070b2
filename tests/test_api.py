"""The library API engines embed: ``import cpkv`` and the example that drives it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cpkv

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_import_cpkv_is_light() -> None:
    code = "import sys, cpkv; assert 'torch' not in sys.modules, 'import cpkv pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_public_name_resolves() -> None:
    for name in cpkv.__all__:
        assert getattr(cpkv, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cpkv.nope  # noqa: B018


@pytest.mark.slow  # 4 s: the whole example
@pytest.mark.multiprocess
def test_library_api_example_runs() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "library_api.py")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "head fragment on the tail page's owner: Segment(start=330, end=384, rank=" in out.stdout
    assert "of a replica" in out.stdout
