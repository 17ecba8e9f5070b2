"""Issue 33, item 6: progress on long work (tokens done, tokens/s, time left), a status line on a
terminal and a line every 10 s otherwise; the ranks' notes reach the parent's sink."""

from __future__ import annotations

import time

import pytest

from cpkv.cli._progress import ProgressLine
from cpkv.comm import CPGroup, last_progress, note_progress
from cpkv.runtime import run_ranks
from cpkv.runtime.progress import BatchProgress, relayed_progress


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


# ---- inside a prefill batch --------------------------------------------------------------------
def test_a_batch_counts_its_tokens_per_unit_of_each_layer() -> None:
    """Host counters: tokens done rise with each unit of each layer, from the progress noted
    before the batch to its end, never past the total."""
    note_progress("prefill", 1000, 4000)
    p = BatchProgress(tokens=3000, layers=3)
    seen = []
    for _ in range(3):
        p.start_layer(4)
        for _ in range(4):
            p.step()
            seen.append(last_progress().done)
        p.end_layer()
        seen.append(last_progress().done)
    assert seen == sorted(seen) and len(set(seen)) > 9
    assert seen[0] > 1000 and seen[-1] == 4000
    assert last_progress().what == "prefill" and last_progress().total == 4000
    p.step()  # past the batch's units: still capped
    assert last_progress().done == 4000


def test_without_a_total_a_batch_notes_bare_progress() -> None:
    note_progress("work", 7, 0)
    p = BatchProgress(tokens=100, layers=2)
    seq = last_progress().seq
    p.start_layer(2)
    p.step()
    p.end_layer()
    assert last_progress().seq == seq + 2 and last_progress().done == 7


def test_a_one_piece_prefill_notes_progress_per_layer_and_row_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt in one piece on one rank, a small logits budget (many indexer row chunks):
    the notes inside the batch rise chunk by chunk (not 0 % until the batch ends)."""
    from cpkv.fallback import recording
    from cpkv.models import load_model, resolve_checkpoint
    from cpkv.runtime import progress as progress_mod
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    n = 2048
    s = load_settings(None, cp={"size": 1}, kv={"dtype": "fp32"},
                      backend={"preference": ["torch"]}, runtime={"logits_budget_mb": 1})
    model = load_model(str(resolve_checkpoint("tiny")))
    done: list[int] = []

    def noted(what: str | None = None, d: int | None = None, total: int | None = None) -> None:
        note_progress(what, d, total)
        done.append(last_progress().done)

    monkeypatch.setattr(progress_mod, "note_progress", lambda **kw: noted(kw.get("what"),
                                                                          kw.get("done"),
                                                                          kw.get("total")))
    with recording():
        session = PrefillSession(model, s, CPGroup.single())
        note_progress("prefill", 0, n)
        session.prefill([("a", [(i * 31) % 512 for i in range(n)])])
    # 1 MiB / (4 B x 2048 keys) = 128 rows a chunk: 16 indexer chunks a layer, 3 layers
    assert len(done) >= 3 * 16
    assert done == sorted(done) and done[-1] == n
    assert len(set(done)) >= 3 * 16 and done[0] < n // (3 * 8)


def test_the_relay_hands_this_processs_notes_to_a_sink() -> None:
    got: list[tuple[int, str, int, int]] = []
    with relayed_progress(lambda *a: got.append(a), prefix="reference ", every_s=0.05):
        for k in range(1, 4):
            note_progress("prefill", 10 * k, 30)
            time.sleep(0.15)
    assert got and all(w == "reference prefill" and r == 0 and t == 30 for r, w, _, t in got)
    assert got[-1][2] == 30 and len(got) >= 2
    with relayed_progress(None):  # no sink: nothing to do
        note_progress("prefill", 1, 2)
