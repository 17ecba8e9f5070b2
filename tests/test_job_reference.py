"""The job's reference check (``run.reference``): "full" computes every prompt whole on one
rank and compares everything, "sample" computes each prompt up to ``run.reference_tokens`` and
compares what that allows, "off" compares nothing; the report says which, and the reference's
progress reaches the caller's sink with the CP ranks'."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.models import resolve_checkpoint
from cpkv.runtime.job import Check, JobReport, JobSpec
from cpkv.runtime.job.reference import reference_plan
from cpkv.runtime.job.results import CPRun, compare_topk, overlap_rows
from cpkv.runtime.job.run import cp_run, job_report, job_spec, reference_run
from cpkv.settings import load_settings

#: a prompt longer than the sample (whose last batch it is), after a short one (whole)
LONG, SHORT, SAMPLE = 700, 150, 256


def _spec(reference: str, *, decode: int = 2, prefix: tuple[int, ...] = ()) -> JobSpec:
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (SHORT, LONG)]
    s = load_settings(None, run={"reference": reference, "reference_tokens": SAMPLE},
                      kv={"dtype": "fp32"}, backend={"preference": ["torch"]})
    spec, _ = job_spec(s, str(resolve_checkpoint("tiny")), prompts, decode_tokens=decode,
                       prefix_lens=prefix)
    return spec


# ---- what each mode computes (host only) -------------------------------------------------------
def test_the_plan_of_each_mode() -> None:
    full = reference_plan(_spec("full"))
    assert full.lengths == (SHORT, LONG) and full.whole == (True, True) and not full.sampled
    sample = reference_plan(_spec("sample"))
    assert sample.lengths == (SHORT, SAMPLE) and sample.sampled == [1]
    assert sample.spec is not None and [len(p) for p in sample.spec.prompts] == [SHORT, SAMPLE]
    assert sample.spec.settings.cp.size == 1 and not sample.spec.settings.cache.enabled
    off = reference_plan(_spec("off"))
    assert off.spec is None and off.lengths == (0, 0)


def test_a_sampled_prefix_chunk_leaves_the_last_batch_a_token() -> None:
    plan = reference_plan(_spec("sample", prefix=(100, 600)))
    assert plan.spec is not None and plan.spec.prefix_lens == (100, SAMPLE - 1)
    assert [n for n in plan.spec.batches()[-1]] == [SHORT - 100, 1]


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50),
                          st.integers(0, 50)), max_size=5))
def test_overlap_rows_pair_the_same_positions(spans: list[tuple[int, int, int, int]]) -> None:
    a = [(min(x, y), max(x, y)) for x, y, _, _ in spans]
    b = [(min(x, y), max(x, y)) for _, _, x, y in spans]
    ia, ib = overlap_rows(a, b)
    pos_a = [p for s, e in a for p in range(s, e)]
    pos_b = [p for s, e in b for p in range(s, e)]
    req_a = [i for i, (s, e) in enumerate(a) for _ in range(s, e)]
    req_b = [i for i, (s, e) in enumerate(b) for _ in range(s, e)]
    got = [(req_a[i], pos_a[i]) for i in ia.tolist()]
    assert got == [(req_b[j], pos_b[j]) for j in ib.tolist()]
    want = [(i, p) for i, ((sa, ea), (sb, eb)) in enumerate(zip(a, b, strict=True))
            for p in range(max(sa, sb), min(ea, eb))]
    assert got == want


def _naive_compare(a: list[torch.Tensor], sa: list[torch.Tensor], b: list[torch.Tensor],
                   sb: list[torch.Tensor], rel_tie: float) -> int:
    """compare_topk's rule, row by row."""
    bad = 0
    for ia, xa, ib, xb in zip(a, sa, b, sb, strict=True):
        for r in range(ia.shape[0]):
            pa = {int(i): float(s) for i, s in zip(ia[r], xa[r], strict=True) if i >= 0}
            pb = {int(i): float(s) for i, s in zip(ib[r], xb[r], strict=True) if i >= 0}
            if pa.keys() == pb.keys():
                continue
            both = [*pa.values(), *pb.values()]
            tol = rel_tie * max(1.0, max(abs(v) for v in both))
            diff = [pa.get(i, pb.get(i)) for i in pa.keys() ^ pb.keys()]
            bad += any(abs(s - min(both)) > tol for s in diff if s is not None)
    return bad


@given(st.integers(0, 2**16), st.integers(1, 6), st.integers(1, 4))
def test_compare_topk_counts_as_row_by_row(seed: int, rows: int, k: int) -> None:
    g = torch.Generator().manual_seed(seed)
    keys = 6
    sc = torch.randint(0, 3, (rows, keys), generator=g).float()  # ties on purpose
    def pick(noise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = sc + (torch.rand(rows, keys, generator=g) * 1e-9 if noise else 0)
        top = x.topk(k, dim=1).indices
        perm = torch.argsort(torch.rand(rows, k, generator=g), dim=1)  # any order in a row
        top = top.gather(1, perm)
        if noise:  # some rows hold fewer keys: -1 padded
            top[: rows // 2, k - 1] = -1
        return top.to(torch.int32), torch.where(top >= 0, sc.gather(1, top.clamp_min(0)),
                                                float("-inf"))
    ia, xa = pick(False)
    ib, xb = pick(True)
    assert compare_topk([ia], [xa], [ib], [xb]) == _naive_compare([ia], [xa], [ib], [xb], 1e-6)


# ---- real runs: one CP run, the three references --------------------------------------------
@pytest.fixture(scope="module")
def job() -> tuple[JobSpec, Any, CPRun, list[tuple[int, str, int, int]]]:
    """One CP2 run (Gloo) with its decode rank, its progress notes."""
    spec = _spec("sample")
    _, place = job_spec(spec.settings, spec.model_dir, spec.prompts, decode_tokens=2)
    notes: list[tuple[int, str, int, int]] = []
    cp = cp_run(spec, place, on_progress=lambda *a: notes.append(a))
    return spec, place, cp, notes


def _report(job: Any, mode: str) -> tuple[JobReport, list[tuple[int, str, int, int]]]:
    spec, place, cp, _ = job
    s = spec.settings
    spec = replace(spec, settings=s.model_copy(update={"run": s.run.model_copy(
        update={"reference": mode})}))
    notes: list[tuple[int, str, int, int]] = []
    ref = reference_run(spec, lambda *a: notes.append(a))
    return job_report(spec, place, cp, ref), notes


def _shown(rep: JobReport) -> str:
    """What ``cpkv run`` prints of the report."""
    from rich.console import Console

    from cpkv.cli.run import _render

    console = Console(record=True, width=200)
    _render(rep, rep.verdict(), console)
    return console.export_text()


@pytest.mark.multiprocess
@pytest.mark.slow  # a CP2 run with a decode rank and three references: ~25 s on 2 cores
def test_each_mode_checks_what_it_says(job: Any) -> None:
    full, _ = _report(job, "full")
    v = full.verdict()
    assert v.passed and v.checked == {Check.LOGITS, Check.TOPK, Check.DECODE_TOKENS}
    # one batch (JobSpec.batch_size 0): both prompts' rows are captured
    assert full.topk_rows_compared == SHORT + LONG and full.topk_rows_differing == 0
    assert full.decode is not None and full.decode.tokens_match_reference is True
    assert full.reference is not None and full.reference.mode == "full"
    assert full.reference.prompt_tokens == [SHORT, LONG] and not full.reference.not_checked
    assert full.seconds.reference_prefill > 0

    sample, notes = _report(job, "sample")
    v = sample.verdict()
    assert v.passed and v.checked == {Check.LOGITS, Check.TOPK, Check.DECODE_TOKENS}
    # the short prompt's rows and the long one's first SAMPLE; not the long one's logits
    assert sample.topk_rows_compared == SHORT + SAMPLE and sample.topk_rows_differing == 0
    assert sample.reference is not None and sample.reference.prompt_tokens == [SHORT, SAMPLE]
    assert sample.decode is not None and sample.decode.reference_tokens[1] is None
    assert sample.decode.reference_tokens[0] == sample.decode.tokens[0]
    assert sample.reference_logits is not None
    assert torch.allclose(sample.logits[0], sample.reference_logits[0], rtol=1e-4, atol=1e-4)
    assert any("prompt(s) [1]" in n and "run.reference_tokens = 256" in n
               for n in sample.reference.not_checked)
    assert "last-token logits of 1 of 2 prompts" in sample.reference.checked
    # its progress reached the sink as rank 0's, ending at every token it computed
    mine = [n for n in notes if n[1] == "reference prefill"]
    assert mine and mine[-1][2:] == (SHORT + SAMPLE, SHORT + SAMPLE)
    assert [d for _, _, d, _ in mine] == sorted(d for _, _, d, _ in mine)

    text = _shown(sample)
    assert "reference check: run.reference = 'sample' (each prompt up to 256 tokens)" in text
    assert "not compared: the last-token logits, decode tokens of prompt(s) [1]" in text

    off, notes = _report(job, "off")
    v = off.verdict()
    assert v.passed and not v.checked and not notes
    assert off.max_rel_err_vs_reference is None and off.topk_rows_differing is None
    assert off.decode is not None and off.decode.tokens_match_reference is None
    assert off.reference is not None and off.reference.mode == "off"
    assert off.seconds.reference_total == 0.0 and off.to_json()["reference"]["mode"] == "off"
    text = _shown(off)
    assert "CP logits vs one rank" not in text and "not checked: decode greedy tokens" in text


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_sample_catches_a_difference_in_its_rows_and_says_what_it_left(job: Any) -> None:
    """A wrong top-k choice in a sampled row fails the check; one past the sample is not
    compared (the report says the long prompt's rows past reference_tokens were not)."""
    spec, place, cp, _ = job
    r0, ref = cp.rank0, reference_run(spec)
    # the capture holds the short prompt's rows, then the long one's
    for row, caught in ((SHORT + SAMPLE - 1, True), (SHORT + LONG - 1, False)):
        idx = [t.clone() for t in r0.topk_indices]
        pos = row - SHORT + 1  # the long prompt's keys 0..pos-1 (one view: after the short's)
        keys = idx[0][row]
        idx[0][row] = torch.where(keys >= 0, SHORT + (keys - SHORT + 1) % pos, -1)
        bad = replace(cp, prefill=(replace(cp.prefill[0], report=replace(
            r0, topk_indices=idx)), *cp.prefill[1:]))
        rep = job_report(spec, place, bad, ref)
        assert (Check.TOPK in rep.verdict().failed) is caught, row


@pytest.mark.multiprocess
@pytest.mark.slow  # one `cpkv run`: ~15 s on 2 cores
def test_cpkv_run_with_the_reference_off_says_so(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "cpkv.cli", "run", "--decode-tokens", "0",
                        "--reference", "off", "--report", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "reference check: run.reference = 'off'" in p.stdout
    assert "not compared: anything: run.reference = 'off'" in p.stdout
    rep = json.loads(out.read_text())
    assert rep["correct"] is None and rep["reference"]["mode"] == "off"
    assert rep["max_rel_err_vs_reference"] is None and rep["seconds"]["reference_total"] == 0
