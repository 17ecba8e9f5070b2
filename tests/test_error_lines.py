"""Issue 33, item 5: one error convention. A user's bad input is one line naming its source (the
option or the TOML key, the file, the prompt index) with the fix, exit 1; click's usage block
only for malformed command lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cpkv.cli import main


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
    ({"c.toml": "[runtime]\ntimout_s = 5\n"}, ["run", "--config", "c.toml"],
     "Error: runtime.timout_s (in c.toml): unknown key", "did you mean runtime.timeout_s?"),
    ({}, ["run", "--chunk", "100"], "Error: --chunk (runtime.chunk_tokens): must be 0 (off) or a "
     "multiple of kv.page_size = 64", "(got 100)"),
    ({}, ["warmup", "--tokens", "300", "--chunk", "100"], "Error: --chunk (runtime.chunk_tokens): ",
     "multiple of kv.page_size = 64"),
    ({}, ["run", "--model", "does-not-exist"], "Error: --model (run.model) = 'does-not-exist': no "
     "such directory", "`cpkv init-model does-not-exist`"),
    ({"c.toml": '[run]\nmodel = "nowhere"\n'}, ["warmup", "--config", "c.toml", "--tokens", "64"],
     "Error: run.model (in c.toml) = 'nowhere': no such directory", "or 'tiny'"),
    ({"c.toml": '[transfer]\nname = "nccll"\n'}, ["run", "--config", "c.toml"],
     "Error: transfer.name (in c.toml) = 'nccll': no installed transfer plugin", "available: "),
    ({"c.toml": "[plugins]\ndisabel = []\n"}, ["plugins", "--config", "c.toml"],
     "Error: plugins.disabel (in c.toml): unknown key", "did you mean plugins.disable?"),
])
def test_bad_input_is_one_line_naming_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 files: dict[str, str], args: list[str],
                                                 starts: str, has: str) -> None:
    """In this process (no rank starts before these errors; a subprocess per case cost seconds
    of imports each): the exit status and stderr the command gives."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts) and has in lines[0], res.stderr


def test_one_error_line_end_to_end(tmp_path: Path) -> None:
    """The same through the installed entry point, in its own process."""
    (tmp_path / "c.toml").write_text("[runtime]\ntimout_s = 5\n")
    res = _cpkv("run", "--config", "c.toml", cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    assert res.stderr == ("Error: runtime.timout_s (in c.toml): unknown key; did you mean "
                          "runtime.timeout_s?\n")


def test_a_malformed_command_line_keeps_the_usage_block(tmp_path: Path) -> None:
    res = _cpkv("run", "--bogus", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("Usage: ")
    assert "No such option" in res.stderr


@pytest.mark.parametrize(("env", "starts", "has"), [
    ({"CPKV_TRANSFER__NAME": "nccll"},
     "Error: transfer.name (CPKV_TRANSFER__NAME) = 'nccll': no installed transfer plugin",
     "available: "),
    ({"CPKV_RUNTIME__TIMOUT_S": "5"}, "Error: runtime.timout_s (CPKV_RUNTIME__TIMOUT_S): no such "
     "settings key", "did you mean CPKV_RUNTIME__TIMEOUT_S?"),
])
def test_a_bad_environment_variable_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             env: dict[str, str], starts: str, has: str) -> None:
    monkeypatch.chdir(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(main, ["run"])
    assert res.exit_code == 1, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts) and has in lines[0], res.stderr


def test_piped_output_is_not_wrapped(tmp_path: Path) -> None:
    """Tables and lines come out whole when stdout is no terminal (rich would fold at 80)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([sys.executable, "-m", "cpkv.cli", "plugins"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("│")]
    assert any("cpkv-backend-torch" in ln and "indexer_topk" in ln for ln in rows), res.stdout
    assert len({len(ln) for ln in rows}) == 1 and len(rows[0]) > 80, res.stdout


def test_piped_help_keeps_long_defaults_whole(tmp_path: Path) -> None:
    """``--help`` piped: wider than click's 80 columns, so a default path is not broken mid-word."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([sys.executable, "-m", "cpkv.cli", "bench", "long", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert "~/.cache/cpkv/bench/long{,_glm5}_<card>.json" in res.stdout, res.stdout
    assert max(len(ln) for ln in res.stdout.splitlines()) <= 120
