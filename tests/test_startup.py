"""Startup checks, op resolution with agreement, and the rerange fallback (rule 24)."""

from __future__ import annotations

import pytest
import structlog

from cpkv.comm import CPGroup
from cpkv.contracts import Availability, FallbackReason, KVDtype, KVFormat, Op
from cpkv.fallback import recording
from cpkv.plugin import BackendSpec, PluginHost, hookimpl
from cpkv.runtime.setup import StartupError, check_startup, create_pool, resolve_ops
from cpkv.settings import load_settings

SMALL = {"kv_lora_rank": 64, "rope_dim": 16, "index_head_dim": 32, "quant_block": 32}


def test_defaults_pass_over_backends_that_cannot_run_here_quietly() -> None:
    """``backend.name = "auto"`` with the default preference (cuda, triton, torch) on a CPU run:
    cuda and triton cannot run here, which is information (an info log, ``OpTable.skipped``),
    not a fallback; so the defaults run under ``fallback.policy = "error"``."""
    settings = load_settings()
    with recording("error") as rec, structlog.testing.capture_logs() as logs:
        ops, _ = resolve_ops(settings, CPGroup.single())
    assert set(ops.chosen.values()) == {"torch"} and rec.events == []
    assert any(s.startswith("cuda: ") for s in ops.skipped)
    assert any(s.startswith("triton: ") for s in ops.skipped)
    info = [e for e in logs if e["event"] == "cpkv.backend.skipped"]
    assert len(info) == 1 and info[0]["log_level"] == "info"


def test_a_named_backend_that_cannot_run_is_a_fallback_once() -> None:
    settings = load_settings(backend={"name": "triton"})
    with recording() as rec, structlog.testing.capture_logs() as logs:
        ops, _ = resolve_ops(settings, CPGroup.single())
    assert ops.chosen["rerange"] == "torch"
    events = [e for e in rec.events if "rerange" in e.detail]
    assert len(events) == 1  # said once, for every op it covers
    ev = events[0]
    assert ev.reason is FallbackReason.PLUGIN_UNAVAILABLE
    assert (ev.requested, ev.selected) == ("triton", "torch")
    assert "triton:" in ev.detail
    assert sum(1 for e in logs if e["event"] == "cpkv.fallback") == len(rec.events)
    with recording("error"), pytest.raises(Exception, match="triton"):
        resolve_ops(settings, CPGroup.single())


def test_default_settings_create_a_sharded_pool() -> None:
    settings = load_settings(cp={"size": 1})
    fmt = KVFormat(page_size=64)
    with recording():
        pool = create_pool(settings, fmt, 2, CPGroup.single())
    assert pool.store.shared and pool.store.capacity == settings.kv.pages_per_rank
    off = load_settings(cp={"size": 1}, kv={"shared": False, "pages_per_rank": 8})
    with recording():
        assert not create_pool(off, fmt, 1, CPGroup.single()).store.shared


class _Picky:
    """A backend whose kernels only take 64-token pages (as DeepSeek kernels do)."""

    @hookimpl
    def cpkv_register_backends(self, registrar):  # type: ignore[no-untyped-def]
        registrar.add(BackendSpec(name="picky", ops=frozenset({Op.RERANGE}),
                                  probe=Availability.yes, load=lambda: self,
                                  page_sizes=frozenset({64})))

    def rerange(self, gathered, perm):  # type: ignore[no-untyped-def]
        return gathered[perm]


def test_startup_rejects_what_cannot_work_before_allocating() -> None:
    host = PluginHost()
    host.register(_Picky(), "picky")
    settings = load_settings(cp={"size": 2}, kv={"page_size": 16, "dtype": "fp8"},
                             backend={"preference": ["picky", "torch"]})
    fmt = KVFormat(dtype=KVDtype.BF16, page_size=32, **SMALL)
    with recording():
        ops, registry = resolve_ops(settings, CPGroup.single(), host)
    with pytest.raises(StartupError) as exc:
        check_startup(settings, fmt, CPGroup.single(), ops, registry)
    msg = str(exc.value)
    assert "backend 'picky' (rerange) supports page sizes [64], not kv.page_size=32" in msg
    assert "cp.size=2 but the CP group has 1 ranks" in msg
    assert "kv.page_size=16 but the format has 32-token pages" in msg
    assert "kv.dtype=fp8 but the format is bf16" in msg
    host.close()


def test_agreement_skips_a_backend_another_rank_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    host = PluginHost()
    host.register(_Picky(), "picky")
    group = CPGroup.single()
    # another rank reports torch unavailable: every rank must skip it alike
    monkeypatch.setattr(group, "agree_all", lambda local: {k: v and k != "torch"
                                                           for k, v in local.items()})
    settings = load_settings(backend={"preference": ["torch", "picky"]})
    with recording() as rec, pytest.raises(LookupError, match="torch: unavailable on another rank"):
        resolve_ops(settings, group, host)  # picky has rerange but no page_gather
    assert rec.events == []  # nothing half-selected is reported
    host.close()
