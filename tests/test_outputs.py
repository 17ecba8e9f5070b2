"""Issue 33, item 2: output files are checked before any rank starts (one line naming the
option, exit 1) and written atomically (a failed write leaves no truncated file)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpkv.cli._outputs import TMP_PREFIX, output_problem, write_atomic


def _cpkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpkv.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("args", "option", "fix"), [
    (["run", "--report", "/proc/x.json"], "--report /proc/x.json", "writable directory"),
    (["run", "--report", "/dev/full"], "--report /dev/full", "writable directory"),
    (["run", "--save-logits", "/proc/x.pt"], "--save-logits /proc/x.pt", "writable directory"),
    (["bench", "cache", "--out", "/proc/x.json"], "--out /proc/x.json", "writable directory"),
    (["run", "--report", "/nonexistent-cpkv/dir/r.json"], "--report /nonexistent-cpkv/dir/r.json",
     "does not exist (cpkv creates none); create it first"),
])
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/full")
def test_an_output_that_cannot_be_written_fails_first_in_one_line(args: list[str], option: str,
                                                                  fix: str) -> None:
    t0 = time.monotonic()
    res = _cpkv(*args)
    elapsed = time.monotonic() - t0
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {option}: "), res.stderr
    assert fix in lines[0]
    assert not Path("/nonexistent-cpkv").exists()  # a misspelt directory is never created
    assert "Traceback" not in res.stderr and res.stdout.count("\n") <= 1  # no report, no run
    assert elapsed < 30, f"{elapsed:.0f} s: the check must come before the ranks"


def test_output_problem_names_non_files_and_unwritable_directories(tmp_path: Path) -> None:
    assert "does not exist" in (output_problem(tmp_path / "new" / "r.json") or "")
    assert not (tmp_path / "new").exists()  # never made
    assert output_problem(tmp_path / "r.json") is None
    assert "directory" in (output_problem(tmp_path) or "")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.geteuid() != 0:  # root writes anywhere
            assert "cannot write in" in (output_problem(ro / "r.json") or "")
    finally:
        ro.chmod(0o700)
    assert not [p for p in tmp_path.rglob(f"{TMP_PREFIX}*")]  # the probe file is gone


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text('{"old": true}\n')

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text('{"new": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(target, half_then_fail)
    assert target.read_text() == '{"old": true}\n'
    assert list(tmp_path.iterdir()) == [target]
    write_atomic(target, lambda tmp: tmp.write_text('{"new": true}\n'))
    assert target.read_text() == '{"new": true}\n'
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_only_cpkvs_own_cache_directory_is_created(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bench = tmp_path / "cache" / "cpkv" / "bench"
    assert output_problem(bench / "r.json") is None  # a default --out of cpkv bench
    assert bench.is_dir()
    elsewhere = tmp_path / "cache" / "other" / "r.json"
    assert "does not exist" in (output_problem(elsewhere) or "")
    with pytest.raises(FileNotFoundError):
        write_atomic(elsewhere, lambda tmp: tmp.write_text("{}"))
    assert not elsewhere.parent.exists()
