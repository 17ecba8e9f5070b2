"""Issue 33, item 5: one error convention. A user's bad input is one line naming its source (the
option or the TOML key, the file, the prompt index) with the fix, exit 1; click's usage block
only for malformed command lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _cpkv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpkv.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize(("files", "args", "starts", "has"), [
    ({"p.json": ""}, ["run", "--prompts", "p.json"], "Error: --prompts p.json: the file is empty",
     "JSON list of prompts"),
    ({"p.json": "[[1, 2"}, ["run", "--prompts", "p.json"], "Error: --prompts p.json: not JSON",
     "line 1 column"),
    ({"p.json": "[[1, 2], [900]]"}, ["run", "--prompts", "p.json"],
     "Error: --prompts p.json: prompt 1 has token ids [900]", "outside the vocabulary [0, 512)"),
    ({"p.json": "[[1], []]", "c.toml": '[run]\nprompts = "p.json"\n'},
     ["run", "--config", "c.toml"], "Error: run.prompts (in c.toml) p.json: prompt 1 is not",
     "JSON list of prompts"),
    ({}, ["run", "--cp", "0"], "Error: --cp: 0 is not in the range x>=1", "--help"),
    ({}, ["plan", "--cp", "4", "--extend", "1010,x"], "Error: --extend: expected", "--help"),
])
def test_bad_input_is_one_line_naming_its_source(tmp_path: Path, files: dict[str, str],
                                                 args: list[str], starts: str, has: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    res = _cpkv(*args, cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts) and has in lines[0], res.stderr


def test_a_malformed_command_line_keeps_the_usage_block(tmp_path: Path) -> None:
    res = _cpkv("run", "--bogus", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("Usage: ")
    assert "No such option" in res.stderr
