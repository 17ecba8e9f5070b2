"""cpkv.fallback: the one choke point of contract rule 30 (log, count, notify, or raise)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from structlog.testing import capture_logs

from cpkv.contracts import FallbackEvent, FallbackPolicy, FallbackReason
from cpkv.fallback import (
    FallbackError,
    FallbackRecorder,
    add_listener,
    recorder,
    recording,
    report_fallback,
)

FIELDS = ("op", "requested", "selected", "reason", "detail")


Listener = Callable[[FallbackEvent], None]


@pytest.fixture
def listen() -> Iterator[Callable[[Listener], None]]:
    """Register listeners through ``listen(fn)``; every one is removed again after the test."""
    removers: list[Callable[[], None]] = []
    yield lambda fn: removers.append(add_listener(fn))
    for remove in removers:
        remove()


def _fallback_entries(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"].startswith("cpkv.fallback")]


def test_one_warning_event_with_all_fields() -> None:
    with recording(), capture_logs() as logs:
        event = report_fallback(
            "split_plan", "zigzag", "token_balanced", FallbackReason.SHORT_EXTEND, "3 pages < 2C"
        )
    entries = _fallback_entries(logs)
    assert len(entries) == 1
    entry = entries[0]
    assert entry["event"] == "cpkv.fallback"
    assert entry["log_level"] == "warning"
    assert {k: entry[k] for k in FIELDS} == {
        "op": "split_plan",
        "requested": "zigzag",
        "selected": "token_balanced",
        "reason": "short_extend",
        "detail": "3 pages < 2C",
    }
    assert event == FallbackEvent(
        op="split_plan",
        requested="zigzag",
        selected="token_balanced",
        reason=FallbackReason.SHORT_EXTEND,
        detail="3 pages < 2C",
    )


def test_reason_given_as_string_is_the_enum() -> None:
    with recording() as rec, capture_logs():
        event = report_fallback("backend", "cuda", "torch", "op_not_provided")
    assert event.reason is FallbackReason.OP_NOT_PROVIDED
    assert rec.counts == {FallbackReason.OP_NOT_PROVIDED: 1}


def test_unknown_reason_is_rejected_before_anything_happens(
    listen: Callable[[Listener], None],
) -> None:
    calls: list[FallbackEvent] = []
    listen(calls.append)
    with recording() as rec, capture_logs() as logs, pytest.raises(ValueError):
        report_fallback("backend", "cuda", "torch", "because")
    assert rec.events == [] and not rec.counts
    assert _fallback_entries(logs) == []
    assert calls == []


def test_recording_counts_per_reason_in_order() -> None:
    with recording() as rec, capture_logs():
        report_fallback("a", "x", "y", FallbackReason.SHORT_EXTEND)
        report_fallback("b", "x", "y", FallbackReason.OWNER_WRITE)
        report_fallback("c", "x", "y", FallbackReason.SHORT_EXTEND)
    assert rec.counts[FallbackReason.SHORT_EXTEND] == 2
    assert rec.counts[FallbackReason.OWNER_WRITE] == 1
    assert rec.counts[FallbackReason.PLUGIN_DISABLED] == 0
    assert [e.op for e in rec.events] == ["a", "b", "c"]


def test_recording_isolates_from_the_default_recorder() -> None:
    default = recorder()
    before_events, before_counts = list(default.events), dict(default.counts)
    with recording() as rec, capture_logs():
        assert recorder() is rec and rec is not default
        report_fallback("a", "x", "y", FallbackReason.OWNER_WRITE)
    assert recorder() is default
    assert default.events == before_events
    assert dict(default.counts) == before_counts
    assert rec.counts == {FallbackReason.OWNER_WRITE: 1}


def test_nested_recording_restores_the_outer_recorder() -> None:
    with recording() as outer, capture_logs():
        with recording() as inner:
            report_fallback("in", "x", "y", FallbackReason.OWNER_WRITE)
        assert recorder() is outer
        report_fallback("out", "x", "y", FallbackReason.SHORT_EXTEND)
    assert [e.op for e in inner.events] == ["in"]
    assert [e.op for e in outer.events] == ["out"]


def test_recorder_policy_accepts_strings_and_rejects_unknown() -> None:
    assert FallbackRecorder("error").policy is FallbackPolicy.ERROR
    with pytest.raises(ValueError):
        FallbackRecorder("ignore")


def test_policy_error_raises_and_does_not_count() -> None:
    with recording("error") as rec, capture_logs() as logs, pytest.raises(FallbackError) as info:
        report_fallback("split_plan", "zigzag", "token_balanced", "short_extend", "tiny")
    msg = str(info.value)
    assert "split_plan" in msg
    assert "short_extend" in msg
    assert info.value.event.reason is FallbackReason.SHORT_EXTEND
    assert rec.events == [] and not rec.counts
    entries = _fallback_entries(logs)
    assert len(entries) == 1
    assert entries[0]["log_level"] == "error"
    assert entries[0]["policy"] == "error"
    assert entries[0]["reason"] == "short_extend"


def test_fallback_error_is_a_runtime_error() -> None:
    assert issubclass(FallbackError, RuntimeError)


def test_listener_is_called_and_can_be_removed() -> None:
    calls: list[FallbackEvent] = []
    remove = add_listener(calls.append)
    try:
        with recording(), capture_logs():
            event = report_fallback("a", "x", "y", FallbackReason.PLUGIN_UNAVAILABLE)
            assert calls == [event]
            remove()
            report_fallback("b", "x", "y", FallbackReason.PLUGIN_UNAVAILABLE)
        assert calls == [event]
    finally:
        remove()  # removing twice is harmless


def test_raising_listener_does_not_break_report(listen: Callable[[Listener], None]) -> None:
    calls: list[FallbackEvent] = []

    def broken(event: FallbackEvent) -> None:
        raise RuntimeError("listener boom")

    listen(broken)
    listen(calls.append)
    with recording() as rec, capture_logs() as logs:
        event = report_fallback("a", "x", "y", FallbackReason.PLUGIN_LOAD_FAILED)
    assert calls == [event], "a later listener still runs"
    assert rec.counts == {FallbackReason.PLUGIN_LOAD_FAILED: 1}
    failed = [e for e in logs if e["event"] == "cpkv.fallback.listener_failed"]
    assert len(failed) == 1
    assert failed[0]["log_level"] == "error"
    assert "listener boom" in failed[0]["error"]
    assert "broken" in failed[0]["listener"]
    assert [e["event"] for e in logs].count("cpkv.fallback") == 1


def test_reason_values_are_unique_snake_case() -> None:
    values = [r.value for r in FallbackReason]
    assert len(values) == len(set(values))
    assert len(values) >= 1
    for r in FallbackReason:
        assert isinstance(r.value, str)
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", r.value), r.value
        assert r.value == r.name.lower()
