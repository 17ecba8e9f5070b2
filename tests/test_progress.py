"""Issue 33, item 6: progress on long work (tokens done, tokens/s, time left), a status line on a
terminal and a line every 10 s otherwise; the ranks' notes reach the parent's sink."""

from __future__ import annotations

import time

import pytest

from cpkv.cli._progress import ProgressLine
from cpkv.comm import CPGroup, note_progress
from cpkv.runtime import run_ranks


def test_progress_text_has_tokens_rate_and_time_left() -> None:
    p = ProgressLine(None)
    assert p.text("prefill", 0, 65536, 100.0) == "prefill: 0 of 65,536 tokens (0.0%)"
    line = p.text("prefill", 16384, 65536, 120.0)  # 16,384 tokens in 20 s
    assert line == "prefill: 16,384 of 65,536 tokens (25.0%), 819 tokens/s, about 60 s left"


def test_lines_every_period_off_a_terminal_and_each_note_on_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    p = ProgressLine(None, every_s=3600)
    for done in (0, 100, 200):
        p(0, "prefill", done, 400)
    p(1, "prefill", 300, 400)  # another CP rank: the same work, not shown twice
    p(0, "prefill", 400, 400)  # the last one always
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(" tokens")[0] for ln in lines] == ["progress prefill: 0 of 400",
                                                         "progress prefill: 400 of 400"]
    shown: list[str] = []
    live = ProgressLine(shown.append, decode_rank=2)
    live(0, "prefill", 10, 20)
    live(2, "decode", 4, 16)
    live(0, "decode", 4, 16)  # only the decode rank's decode
    assert [s.split(":")[0] for s in shown] == ["prefill", "decode"]
    quiet = ProgressLine(shown.append, quiet=True)
    quiet(0, "prefill", 1, 2)
    assert len(shown) == 2


def _notes(group: CPGroup) -> None:
    for k in range(1, 5):
        note_progress("prefill", 100 * k, 400)
        time.sleep(0.6)  # the watchdog looks every 0.5 s


@pytest.mark.multiprocess
def test_the_ranks_notes_reach_the_parents_sink() -> None:
    got: list[tuple[int, str, int, int]] = []
    run_ranks(_notes, 2, timeout_s=60, on_progress=lambda *a: got.append(a))
    mine = [g for g in got if g[0] == 0]
    assert mine and all(w == "prefill" and t == 400 for _, w, _, t in mine)
    assert [d for _, _, d, _ in mine] == sorted(d for _, _, d, _ in mine)
    assert mine[-1][2] >= 300
