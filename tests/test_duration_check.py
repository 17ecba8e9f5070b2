"""The fast subset stays fast: tests/conftest.py fails a test not marked ``slow`` (nor ``gpu``)
whose call uses more than ``unmarked_test_limit_s`` (default 30 s) of CPU time, its own and its
children's, or waits past 4 times that in wall time; time spent waiting for a core on a busy
machine counts for neither, so load does not fail correct tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import UNMARKED_TEST_LIMIT_S, WAITING_FACTOR, over_the_limit

HERE = Path(__file__).resolve().parent

_TESTS = '''
import subprocess
import sys
import time

import pytest


def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_quick():
    pass


def test_unmarked_burner():
    _burn(0.6)


def test_unmarked_burner_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\n"
                    "while time.process_time() < end: pass"], check=True)


def test_unmarked_short_sleeper():
    time.sleep(0.6)  # wall time, no CPU: what a loaded machine adds to a correct test


def test_unmarked_long_waiter():
    time.sleep(1.5)  # past 4 x the limit: waiting is slow too


@pytest.mark.slow
def test_marked_burner():
    _burn(0.6)
'''


def test_the_limit_is_set_with_a_margin_over_the_slow_rule(pytestconfig: pytest.Config) -> None:
    assert UNMARKED_TEST_LIMIT_S >= 10
    limit = float(pytestconfig.getini("unmarked_test_limit_s"))
    assert limit == 0 or limit >= 10  # 0: turned off for this run (-o unmarked_test_limit_s=0)


def test_wall_time_under_load_is_not_cpu_time() -> None:
    assert not over_the_limit(cpu=8.0, wall=31.0, limit=30.0)  # a correct test on a busy machine
    assert over_the_limit(cpu=32.0, wall=16.0, limit=30.0)  # two cores busy for 16 s
    assert over_the_limit(cpu=0.5, wall=WAITING_FACTOR * 30.0 + 1, limit=30.0)  # a long wait
    assert not over_the_limit(cpu=99.0, wall=99.0, limit=0.0)  # the check off


@pytest.mark.multiprocess
def test_unmarked_cpu_heavy_and_waiting_tests_fail_and_a_marked_one_passes(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sleepers.py").write_text(_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nunmarked_test_limit_s = 0.3\n"
                                         "markers =\n    slow: x\n    gpu: y\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_sleepers.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "3 failed, 3 passed" in out, out
    assert "test_unmarked_burner used" in out and "over the 0.3 s limit" in out, out
    assert "test_unmarked_burner_in_a_child used" in out, out
    assert "test_unmarked_long_waiter waited" in out, out
    assert "test_unmarked_short_sleeper" not in out, out
