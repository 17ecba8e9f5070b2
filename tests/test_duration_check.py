"""The fast subset stays fast: tests/conftest.py fails a test not marked ``slow`` (nor ``gpu``)
whose call takes longer than ``unmarked_test_limit_s`` (default 20 s)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

_TESTS = '''
import time

import pytest


def test_quick():
    pass


def test_unmarked_sleeper():
    time.sleep(0.6)


@pytest.mark.slow
def test_marked_sleeper():
    time.sleep(0.6)
'''


def test_the_limit_is_set_with_a_margin_over_the_slow_rule(pytestconfig: pytest.Config) -> None:
    assert float(pytestconfig.getini("unmarked_test_limit_s")) >= 10


@pytest.mark.multiprocess
def test_an_unmarked_slow_test_fails_and_a_marked_one_passes(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sleepers.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nunmarked_test_limit_s = 0.3\n"
                                         "markers =\n    slow: x\n    gpu: y\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_sleepers.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "test_unmarked_sleeper took" in out and "over the 0.3 s limit" in out, out
