"""``cpkv.runtime.warmup.warm_up``: the warm-up prompts run on the session, in its chunks, and
leave nothing in the pool; the session option ``runtime.warmup_tokens`` runs it once at start;
``cpkv warmup`` runs it alone and prints its time and kernel count."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from cpkv.cli import main
from cpkv.comm.group import CPGroup
from cpkv.kv import PoolExhausted
from cpkv.models import load_model
from cpkv.runtime.session import PrefillSession
from cpkv.runtime.warmup import compile_cache_dirs, compiled_kernels, warm_up
from cpkv.settings import SettingsError, load_settings


def _session(chunk_tokens: int = 0) -> PrefillSession:
    model = load_model("tiny", dtype=torch.float32)
    settings = load_settings(cp={"size": 1}, kv={"page_size": 64, "pages_per_rank": 16},
                             runtime={"chunk_tokens": chunk_tokens})
    return PrefillSession(model, settings, CPGroup.single())


def test_warm_up_prefills_in_the_sessions_chunks_and_releases_its_prompts() -> None:
    session = _session(chunk_tokens=128)
    rep = warm_up(session, 300, chunk=64)
    assert rep.chunk == 128  # the session's chunk_tokens wins over the argument
    assert len(rep.chunk_seconds) == 3  # 299 tokens in chunks of 128
    assert rep.seconds >= sum(rep.chunk_seconds) > 0
    assert session.pool.footprint().pages_held == 0
    # the session serves afterwards
    res = session.prefill([("r", list(range(1, 70)))])
    assert res.last_logits.shape[0] == 1


def test_warm_up_refuses_a_chunk_off_the_pages() -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        warm_up(_session(), 300, chunk=100)


def _option_session(warmup_tokens: int, chunk_tokens: int = 0, pages: int = 16
                    ) -> PrefillSession:
    model = load_model("tiny", dtype=torch.float32)
    settings = load_settings(cp={"size": 1}, kv={"page_size": 64, "pages_per_rank": pages},
                             runtime={"chunk_tokens": chunk_tokens,
                                      "warmup_tokens": warmup_tokens})
    return PrefillSession(model, settings, CPGroup.single())


def test_the_session_option_warms_up_once_at_start_and_reports_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = PrefillSession.prefill

    def counted(self: PrefillSession, batch: Any, **kw: Any) -> Any:
        calls.append(sum(len(ids) for _, ids in batch))
        return real(self, batch, **kw)

    monkeypatch.setattr(PrefillSession, "prefill", counted)
    session = _option_session(300, chunk_tokens=128)
    # the long prompt (299 tokens) in the session's chunks, then the short one; nothing else
    assert calls == [128, 128, 43, 299]
    rep = session.warmup
    assert rep is not None and (rep.tokens, rep.chunk) == (300, 128)
    assert len(rep.chunk_seconds) == 3 and rep.seconds >= sum(rep.chunk_seconds) > 0
    assert session.pool.footprint().pages_held == 0
    res = session.prefill([("r", list(range(1, 70)))])
    assert res.last_logits.shape[0] == 1 and len(calls) == 5  # serving adds no warm-up


def test_without_chunks_the_option_warms_up_whole_prompts_and_off_means_none() -> None:
    rep = _option_session(300).warmup
    assert rep is not None and rep.chunk == 320 and len(rep.chunk_seconds) == 1
    assert _option_session(0).warmup is None


def test_a_warm_up_the_pool_cannot_hold_names_the_option() -> None:
    with pytest.raises(PoolExhausted, match=r"runtime\.warmup_tokens = 5000"):
        _option_session(5000, pages=16)  # 16 pages of 64 tokens


def test_one_warm_up_token_is_refused_by_the_settings() -> None:
    with pytest.raises(SettingsError, match="warmup_tokens"):
        load_settings(runtime={"warmup_tokens": 1})


def _kernel(root: Path, name: str) -> None:
    d = root / name[:8].ljust(8, "0")
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text("{}")
    (d / f"__grp__{name}.json").write_text("{}")  # a group file: not a kernel


def test_the_report_counts_the_kernels_the_caches_gained(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    tri, dg = tmp_path / "triton", tmp_path / "dg"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tri))
    monkeypatch.setenv("DG_JIT_CACHE_DIR", f"{dg}:{tmp_path / 'other'}")
    assert compile_cache_dirs() == (tri, dg)
    _kernel(tri, "old_kernel")
    (dg / "cache" / "kernel.abc").mkdir(parents=True)
    assert compiled_kernels() == {"old_kern:old_kernel", "deepgemm:kernel.abc"}
    session = _session(chunk_tokens=128)
    real = PrefillSession.prefill

    def compiling(self: PrefillSession, batch: Any, **kw: Any) -> Any:
        _kernel(tri, "new_kernel")  # what a first launch of a kernel leaves on disk
        return real(self, batch, **kw)

    monkeypatch.setattr(PrefillSession, "prefill", compiling)
    rep = warm_up(session, 300)
    assert (rep.compiled, rep.cached) == (1, 3)


def test_cpkv_warmup_prints_its_time_and_kernels(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    res = CliRunner().invoke(main, ["warmup", "--tokens", "300", "--chunk", "128",
                                    "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "warming up for 300 tokens" in res.output
    assert re.search(r"warm-up: \d+\.\d\d s \(3 chunk\(s\) in 128-token chunks", res.output)
    assert f"0 kernel(s) compiled, 0 in the compile caches (Triton's {tmp_path / 'triton'}" in res.output


def test_cpkv_warmup_needs_a_token_count() -> None:
    res = CliRunner().invoke(main, ["warmup", "--device", "cpu"])
    assert res.exit_code == 2 and "--tokens" in res.output


def test_the_decode_ranks_session_does_not_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpkv.runtime.decode import DecodeWorker

    model = load_model("tiny", dtype=torch.float32)
    settings = load_settings(cp={"size": 1}, kv={"page_size": 64, "pages_per_rank": 16},
                             runtime={"warmup_tokens": 300})
    calls: list[int] = []
    real = PrefillSession.prefill

    def counted(self: PrefillSession, batch: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(self, batch, **kw)

    monkeypatch.setattr(PrefillSession, "prefill", counted)
    worker = DecodeWorker(model, settings)
    assert worker.session.warmup is None and calls == []
