"""The job's report: its JSON layout is the one ``cpkv run --report`` wrote before its sections
became dataclasses (tests/report_layout.json), and its verdict is one function, which fails
each kind of disagreement with its own message."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from cpkv.contracts import FallbackEvent, FallbackReason
from cpkv.runtime.decode import DecodeSteps
from cpkv.runtime.job import Check, DecodeReport, JobReport, RankReport, SenderReport, Tolerances
from cpkv.runtime.job.results import Backends, CPRun, PrefillResult, ReferenceRun
from cpkv.runtime.speculative import SpeculationStats
from cpkv.settings import Settings, load_settings

LAYOUT = json.loads((Path(__file__).parent / "report_layout.json").read_text())["runs"]
#: what ``cpkv run`` adds to the report's own JSON
CLI_KEYS = {"model": "x", "tolerance": 1e-3, "correct": True, "settings": {}, "version": "x",
            "machine": "x"}
#: the last batch's phases a prefill rank reports (besides "load" and "prefill")
PHASES = ("plan", "attn_inputs", "write", "materialize", "indexer", "sparse_mla", "mlp",
          "gather_logits")


def layout(v: Any, key: str = "") -> Any:
    """Keys in order and value types; a list: the distinct layouts of its items, in order."""
    if key in ("settings", "machine"):
        return type(v).__name__
    if key == "chosen":
        return {"<op>": "str"}
    if isinstance(v, dict):
        return {k: layout(x, k) for k, x in v.items()}
    if isinstance(v, list):
        seen: list[Any] = []
        for x in v:
            if (item := layout(x)) not in seen:
                seen.append(item)
        return seen
    return type(v).__name__


def _rank(rank: int, *, draft: bool, chunks: bool, seed: int = 0) -> RankReport:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 16, generator=g)
    idx = [torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)]
    score = [torch.tensor([[2.0, 1.0], [3.0, 1.0]])]
    return RankReport(
        rank=rank, last_logits=logits, kv_bytes=100 + rank, kv_bytes_replicated=200,
        seconds={**dict.fromkeys(PHASES, 0.5), **({"draft": 0.1} if draft else {}),
                 "load": 1.0, "prefill": 2.0},
        topk_indices=idx, topk_scores=score, topk_extends=[2], hits=[0, 100, 0, 600],
        cache={"pages_evicted": 0, "pages_saved_to_host": 0, "pages_loaded_from_host": 0,
               "recomputed_tokens": 0},
        backends=Backends({"rerange": "torch"}, ("triton: no CUDA device",)),
        draft_logits=logits.clone() if draft else None, logits_budget_mb=512,
        logits_budget_auto=True, chunk_seconds=[[0.1, 0.2], []] if chunks else [[], []])


def _event(op: str) -> FallbackEvent:
    return FallbackEvent(op=op, requested="a", selected="b", reason=FallbackReason.SHORT_EXTEND,
                         detail="why")


def _runs(*, decode: bool, mtp: bool, chunks: bool) -> tuple[CPRun, ReferenceRun]:
    ranks = [_rank(r, draft=mtp, chunks=chunks) for r in range(2)]
    prefill = tuple(PrefillResult(r, rep, (_event("split_plan"),), 0.5)
                    for r, rep in enumerate(ranks))
    tokens = [[1, 2], [3, 4], [5, 6], [7, 8]]
    ref = ReferenceRun(report=_rank(0, draft=mtp, chunks=False), tokens=tokens if decode else [],
                       fallbacks=(), wall_seconds=3.0, mode="sample")
    ref.report.seconds["decode"] = 0.25
    if not decode:
        return CPRun(prefill=prefill, wall_seconds=4.0), ref
    senders = tuple(SenderReport(prefill=rep, bytes_sent=10 * (r + 1), entries=3, seconds=0.2,
                                 ready_seconds=[0.1] * 4, overlap_seconds=0.0, send_seconds=0.1)
                    for r, rep in enumerate(ranks))
    stats = SpeculationStats(steps=7, plain_steps=7, proposed=28, request_steps=28)
    dec = DecodeReport(tokens=tokens, bytes_per_rank=[10, 20], entries=6,
                       seconds={"load": 1.0, "receive": 0.5, "decode": 0.75},
                       speculation=stats if mtp else None, kv_layers=4,
                       steps=DecodeSteps(graphs=False, captured=0))
    return CPRun(prefill=prefill, wall_seconds=4.0, senders=senders, decode=dec,
                 decode_fallbacks=(_event("kv_write"),), decode_startup_seconds=0.5), ref


def _settings(chunks: bool) -> Settings:
    return load_settings(None, **({"runtime": {"chunk_tokens": 128}} if chunks else {})
                         ).resolved(False)


def _report(*, decode: bool = True, mtp: bool = True, chunks: bool = True) -> JobReport:
    cp, ref = _runs(decode=decode, mtp=mtp, chunks=chunks)
    prompts = [[0] * n for n in (600, 300, 40, 660)]
    return JobReport.of(_settings(chunks), prompts, cp, ref, capture_topk=True, mtp=mtp,
                        draft_tokens=1, device="cpu", gpus=None)


def _json(rep: JobReport) -> Any:
    """The JSON the CLI writes, read back."""
    return json.loads(json.dumps({**rep.to_json(), **CLI_KEYS}))


@pytest.mark.parametrize(("run", "kw"), [
    ("default", {"mtp": False, "chunks": False}),
    ("mtp_chunk", {}),
    ("no_decode_mtp", {"decode": False, "chunks": False}),
])
def test_report_json_keeps_its_layout(run: str, kw: dict[str, bool]) -> None:
    """The sections' JSON: the keys (in order) and value types the report had as dicts."""
    got = layout(_json(_report(**kw)))
    # one fallback row per rank here: "rank" int (a prefill rank) and str ("decode") both occur
    want = LAYOUT[run]["layout"]
    got_rows = got.pop("fallbacks")
    want_rows = want["fallbacks"]
    assert all(r in got_rows for r in want_rows)
    assert got == {k: v for k, v in want.items() if k != "fallbacks"}


def test_report_sections_are_built_from_what_the_ranks_handed_back() -> None:
    d = _json(_report())
    assert d["fallbacks"] == [
        {"rank": 0, "op": "split_plan", "requested": "a", "selected": "b",
         "reason": "short_extend", "detail": "why"},
        {"rank": 1, "op": "split_plan", "requested": "a", "selected": "b",
         "reason": "short_extend", "detail": "why"},
        {"rank": "decode", "op": "kv_write", "requested": "a", "selected": "b",
         "reason": "short_extend", "detail": "why"}]
    s = d["seconds"]
    # startup: the slowest process's spawn + model load; the decode rank's phases prefixed
    assert s["cp_startup"] == 1.5 and s["cp_decode"] == 0.75 and s["decode_receive"] == 0.5
    assert s["cp_plan"] == 0.5 and s["reference_decode"] == 0.25 and s["cp_total"] == 4.0
    tr = d["transfer"]
    assert tr["bytes_per_rank"] == [10, 20] and tr["ready_seconds"] == pytest.approx(0.4)
    assert d["cache"]["hit_fraction"] == pytest.approx(700 / 1600)
    assert d["chunks"]["seconds_per_batch"] == [[0.1, 0.2], []]
    assert d["draft"]["steps"] == 7 and d["draft"]["tokens_match_reference"] is True
    assert d["logits_budget"] == {"mb_per_rank": [512, 512], "auto": True}


def test_transfer_accounting_mismatch_is_an_error() -> None:
    cp, ref = _runs(decode=True, mtp=False, chunks=False)
    assert cp.decode is not None
    bad = replace(cp, decode=replace(cp.decode, bytes_per_rank=[10, 21]))
    with pytest.raises(RuntimeError, match="transfer accounting"):
        JobReport.of(_settings(False), [[0]] * 4, bad, ref, capture_topk=False, mtp=False,
                     draft_tokens=1, device="cpu", gpus=None)


def test_a_report_that_agrees_passes() -> None:
    v = _report().verdict()
    assert v.passed and v.failures == () and v.failed == frozenset()
    assert v.tolerance == Tolerances().logits("bf16", "cpu")


def _failing() -> list[tuple[Check, JobReport, str]]:
    rep = _report()
    assert rep.decode is not None and rep.draft is not None
    other = [[9, 9]] * 4
    return [
        (Check.LOGITS, replace(rep, max_rel_err_vs_reference=0.5), "max relative error 5.00e-01"),
        (Check.LOGITS, replace(rep, max_rel_err_vs_reference=math.nan), "nan"),
        (Check.TOPK, replace(rep, topk_rows_differing=3), "3 rows have different"),
        (Check.DECODE_TOKENS, replace(rep, decode=replace(rep.decode, reference_tokens=other)),
         "decode greedy tokens differ"),
        (Check.DRAFT_LOGITS, replace(rep, draft=replace(rep.draft,
                                                        prefill_max_rel_err_vs_reference=1.0)),
         "MTP draft logits"),
        (Check.SPECULATIVE_TOKENS, replace(rep, draft=replace(rep.draft,
                                                              tokens_match_reference=False)),
         "speculative decoding's tokens differ"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_each_disagreement_fails_with_its_message(case: int) -> None:
    check, rep, words = _failing()[case]
    v = rep.verdict()
    assert not v.passed and v.failed == {check} and len(v.failures) == 1
    assert words in v.failures[0]


def test_tolerances_decide_the_verdict() -> None:
    rep = replace(_report(), max_rel_err_vs_reference=5e-3)
    assert not rep.verdict().passed
    assert rep.verdict(Tolerances(bf16=1e-2)).passed
    # on GPUs the bfloat16 model's tolerance is the floor
    assert Tolerances().logits("fp32", "cuda") == Tolerances().bf16_compute
    assert Tolerances().tie("cpu") < Tolerances().tie("cuda")


def test_cli_marks_each_check_as_the_verdict_decided_and_prints_the_failures() -> None:
    from cpkv.cli.run import _render

    _, rep, _ = _failing()[3]  # the decode tokens differ
    console = Console(record=True, width=400)
    _render(rep, rep.verdict(), console)
    text = console.export_text()
    assert "correct: CP logits vs one rank" in text
    assert "MISMATCH: decode greedy tokens" in text
    assert "failed: decode greedy tokens differ" in text


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("run", sorted(LAYOUT))
def test_cpkv_run_report_has_the_recorded_layout(run: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "cpkv", "-q", "run", "--report", str(out),
                        *LAYOUT[run]["args"]], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert layout(json.loads(out.read_text())) == LAYOUT[run]["layout"]


def test_the_warm_up_section_lists_each_ranks_time_and_the_cli_prints_it() -> None:
    from cpkv.cli.run import _render
    from cpkv.runtime.warmup import WarmupReport

    cp, ref = _runs(decode=True, mtp=False, chunks=False)
    warm = [WarmupReport(tokens=300, chunk=128, seconds=1.5 + r, compiled=4 - 4 * r)
            for r in range(2)]
    cp = replace(cp, prefill=tuple(replace(p, report=replace(p.report, warmup=w))
                                   for p, w in zip(cp.prefill, warm, strict=True)))
    rep = JobReport.of(_settings(False), [[0] * n for n in (600, 300, 40, 660)], cp, ref,
                       capture_topk=True, mtp=False, draft_tokens=1, device="cpu", gpus=None)
    assert _json(rep)["warmup"] == {"tokens": 300, "seconds_per_rank": [1.5, 2.5],
                                    "compiled_per_rank": [4, 0]}
    assert _json(_report())["warmup"] is None  # the option off
    console = Console(record=True, width=400)
    _render(rep, rep.verdict(), console)
    assert "warm-up (300 tokens) at session start: 1.50, 2.50 s per rank, kernels compiled 4, 0" \
        in console.export_text()
