"""Chunked prefill (``runtime.chunk_tokens``): a long request prefilled in chunks, one batch each,
gives the one-piece prefill's logits and top-k choices bit for bit, on one rank and on CP2; the
draft layer too; chunks end on page boundaries; ``cpkv run --chunk`` end to end."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.comm import CPGroup
from cpkv.fallback import recording
from cpkv.models import load_model, write_tiny_checkpoint
from cpkv.models.tiny import ARCHS
from cpkv.runtime import run_ranks
from cpkv.runtime.chunked import chunk_rounds
from cpkv.runtime.job import compare_topk
from cpkv.runtime.session import PrefillSession
from cpkv.settings import load_settings

PAGE = 8
#: chunk sizes (multiples of PAGE) that cut a 700-token prompt into 1, 2 and 5 chunks
CHUNKINGS = {1: 0, 2: 352, 5: 144}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}") / "ckpt", seed=3,
                                 **ARCHS[arch])


def _prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def _settings(cp: int, chunk: int) -> Any:
    return load_settings(cp={"size": cp}, kv={"page_size": PAGE, "dtype": "fp32"},
                         backend={"preference": ["torch"]}, runtime={"chunk_tokens": chunk})


# ---- where chunks end ---------------------------------------------------------------------------
@given(prefix=st.integers(0, 300), extend=st.integers(1, 900),
       chunk=st.sampled_from([PAGE, 3 * PAGE, 16 * PAGE, 44 * PAGE]))
def test_chunks_cover_the_extend_on_page_boundaries(prefix: int, extend: int, chunk: int) -> None:
    rounds = chunk_rounds([(prefix, extend)], chunk, PAGE)
    pieces = [p for r in rounds for p in r]
    assert all(len(r) == 1 for r in rounds)
    # contiguous, in order, covering [0, extend) once; only the last is the request's last
    assert [p.start for p in pieces] == [0] + [p.end for p in pieces[:-1]]
    assert pieces[-1].end == extend and [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    for p in pieces:
        assert 0 < p.end - p.start <= chunk
        if not p.last:  # a non-final chunk ends on a page: it writes and sends whole pages only
            assert (prefix + p.end) % PAGE == 0
    if extend <= chunk:
        assert len(pieces) == 1
    else:  # no chunk shorter than needed: every non-final one reaches its last page boundary
        assert all(prefix + p.end + PAGE > prefix + p.start + chunk for p in pieces[:-1])


def test_rounds_hold_each_requests_next_chunk() -> None:
    """Short requests run whole in round 0; long ones continue in later rounds, in batch order."""
    # (prefix, extend): 20 + 50 starts mid-page (its first chunk ends on the page at 48); 9 + 30
    # fits one chunk
    rounds = chunk_rounds([(0, 40), (0, 100), (20, 50), (9, 30), (0, 64)], 32, PAGE)
    assert [[(p.index, p.start, p.end, p.last) for p in r] for r in rounds] == [
        [(0, 0, 32, False), (1, 0, 32, False), (2, 0, 28, False), (3, 0, 30, True),
         (4, 0, 32, False)],
        [(0, 32, 40, True), (1, 32, 64, False), (2, 28, 50, True), (4, 32, 64, True)],
        [(1, 64, 96, False)],
        [(1, 96, 100, True)],
    ]
    assert chunk_rounds([(0, 40), (5, 100)], 0, PAGE) == [[p for r in chunk_rounds(
        [(0, 40), (5, 100)], 1000, PAGE) for p in r]]  # off: one round of whole requests
    with pytest.raises(ValueError, match="multiple of the page size"):
        chunk_rounds([(0, 40)], 12, PAGE)


def test_a_session_refuses_chunks_off_the_page_grid(tiny: Path) -> None:
    s = _settings(1, 0)
    bad = s.model_copy(update={"runtime": s.runtime.model_copy(update={"chunk_tokens": 12})})
    with recording(), pytest.raises(ValueError, match=r"runtime\.chunk_tokens"):
        PrefillSession(load_model(str(tiny)), bad, CPGroup.single())


# ---- chunking changes nothing -------------------------------------------------------------------
def _chunkings(group: CPGroup, model_dir: str, mtp: bool = False) -> list[dict[str, Any]]:
    """The 700-token prompt prefilled in 1, 2 and 5 chunks on ``group``: per chunking its last
    logits, draft logits, top-k capture and chunk times (host tensors)."""
    model = load_model(model_dir, mtp=mtp)
    prompt = _prompt(700)
    out = []
    for chunks, size in CHUNKINGS.items():
        with recording():
            session = PrefillSession(model, _settings(group.size, size), group)
        res = session.prefill([("a", prompt)], capture_topk=True)
        assert len(res.chunk_seconds) == (chunks if chunks > 1 else 0)
        assert res.topk is not None
        out.append({"logits": res.last_logits.cpu(),
                    "draft": None if res.draft_logits is None else res.draft_logits.cpu(),
                    "indices": [t.cpu() for t in res.topk.indices],
                    "scores": [t.cpu() for t in res.topk.scores],
                    "held": session.pool.pages.requests["a"].valid_len})
    return out


def _assert_identical(runs: list[dict[str, Any]], where: str) -> None:
    whole = runs[0]
    assert whole["indices"][0].shape[0] == 700  # every row's choice, natural order
    for chunks, run in zip(list(CHUNKINGS)[1:], runs[1:], strict=True):
        name = f"{where}, {chunks} chunks"
        assert run["held"] == 700, name
        assert torch.equal(run["logits"], whole["logits"]), name
        if whole["draft"] is not None:
            assert torch.equal(run["draft"], whole["draft"]), name
        assert all(torch.equal(a, b) for a, b in zip(run["indices"], whole["indices"],
                                                     strict=True)), name
        # an earlier chunk's rows went through matmuls of other shapes: their scores may differ
        # in the last bits (CPU BLAS is not batch-invariant), never enough to change a choice
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for a, b in zip(run["scores"], whole["scores"], strict=True)), name


@pytest.mark.slow
@pytest.mark.parametrize("mtp", [False, True])
def test_one_rank_chunkings_are_bit_identical(tiny: Path, mtp: bool) -> None:
    """CP1: whole, 2 and 5 chunks: the same last-token logits and top-k indices at every layer
    (bit for bit; scores within float32 rounding); with the MTP layer the same draft logits (a
    non-final chunk's last draft row takes the prompt's next token)."""
    runs = _chunkings(CPGroup.single(), str(tiny), mtp)
    assert (runs[0]["draft"] is not None) is mtp
    _assert_identical(runs, "CP1")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cp2_chunkings_are_bit_identical(tiny: Path) -> None:
    """CP2 over Gloo: whole, 2 and 5 chunks give the same logits and top-k on every rank."""
    results = run_ranks(_chunkings, 2, args=(str(tiny), True), timeout_s=600)
    for r in results:
        _assert_identical(r.value, f"CP2 rank {r.rank}")


def test_a_batch_of_several_requests_chunks_each_and_stitches_the_rows(tiny: Path) -> None:
    """A batch of a long request continuing a cached prefix that ends mid-page, a short one and
    a medium one: chunked, its last logits, every row's logits and top-k equal the one-piece
    batch's (rows in natural order, request by request)."""
    model = load_model(str(tiny))
    first, long_, short, medium = _prompt(21, 2), _prompt(150, 3), _prompt(9, 4), _prompt(70, 5)
    out = []
    for size in (0, 32):
        with recording():
            session = PrefillSession(model, _settings(1, size), CPGroup.single())
        session.prefill([("a", first)])  # "a" then continues from 21 tokens: mid-page
        res = session.prefill([("a", long_), ("b", short), ("c", medium)], all_logits=True,
                              capture_topk=True)
        assert res.all_logits is not None and res.topk is not None
        assert res.all_logits.shape[0] == 150 + 9 + 70
        assert [session.pool.pages.requests[r].valid_len for r in "abc"] == [171, 9, 70]
        out.append(res)
    whole, chunked = out
    # "a" (from 21): 27 + 3 x 32 + 27 tokens; "c": 32 + 32 + 6; "b" whole in the first round
    assert whole.chunk_seconds == () and len(chunked.chunk_seconds) == 5
    assert torch.equal(whole.last_logits, chunked.last_logits)
    # rows of other chunks went through other matmul shapes: equal within float32 rounding
    assert torch.allclose(whole.all_logits, chunked.all_logits, rtol=1e-5, atol=1e-6)
    # ... so keys tied at the k-th score within that rounding may swap (docs/contract.md, departure E)
    assert compare_topk(chunked.topk.indices, chunked.topk.scores, whole.topk.indices,
                        whole.topk.scores) == 0


# ---- cpkv run --chunk ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("pipeline", ["request", "layer"])
def test_cpkv_run_with_chunks_passes_its_checks(tmp_path: Path, pipeline: str) -> None:
    """``cpkv run --chunk 256`` (CP2, transfer and decode): the checks pass, the report lists
    each chunk's time and the budget, and every KV byte moves once (chunks send whole pages)."""
    prompts = [_prompt(600, 7), _prompt(130, 8)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "cpkv.cli", "run", "--cp", "2", "--chunk", "256",
         "--prompts", str(tmp_path / "prompts.json"), "--decode-tokens", "4",
         "--report", str(report)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "CPKV_TRANSFER__PIPELINE": pipeline, "CPKV_KV__DTYPE": "fp32"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "chunked prefill (256 tokens)" in out.stdout
    rep = json.loads(report.read_text())
    assert rep["correct"] is True and rep["topk_rows_differing"] == 0
    assert rep["decode"]["tokens_match_reference"] is True
    assert rep["chunks"]["chunk_tokens"] == 256
    times = rep["chunks"]["seconds_per_batch"]
    assert [len(t) for t in times] == [3, 0] and all(x > 0 for x in times[0])
    assert rep["logits_budget"] == {"mb_per_rank": [512, 512], "auto": True}
    # distinct prompts, nothing cached twice: what moved is what the ranks hold, once
    assert rep["transfer"]["bytes_per_rank"] == rep["kv_bytes_per_rank"]
    assert rep["transfer"]["pipeline"] == pipeline


@pytest.mark.multiprocess
def test_cpkv_run_refuses_a_chunk_off_the_page_grid() -> None:
    out = subprocess.run([sys.executable, "-m", "cpkv.cli", "run", "--chunk", "100"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert ("--chunk (runtime.chunk_tokens): must be 0 (off) or a multiple of kv.page_size = 64 "
            "(got 100)") in out.stderr
