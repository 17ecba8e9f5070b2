"""``cpkv bench host`` at a tiny size on the CPU: the rows, the round trip's exactness check, and
the CLI's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cpkv.bench import host as bench_host
from cpkv.cli.bench import command
from cpkv.kv.host import HostPages


def test_host_bench_rows_and_bit_exactness() -> None:
    rows, detail = bench_host.run(torch.device("cpu"), pages=16, layers=2)
    by_name = {r.name: r for r in rows}
    assert set(by_name) == {"host_reload", "host_save"}
    assert by_name["host_reload"].baseline_name == "pinned_h2d_copy"
    assert by_name["host_save"].baseline_name == "pinned_d2h_copy"
    for r in rows:
        assert r.unit == "GB/s" and r.value > 0 and r.baseline_value > 0
        assert r.ratio == pytest.approx(r.value / r.baseline_value)
    assert detail["bit_exact"] is True
    assert detail["bytes_per_token"] == 788  # 512 fp8 + 4 fp32 scales + 64 bf16 rope + 128 + 4
    assert detail["bytes"] == 16 * 788 * 64 * 2


def test_a_broken_reload_is_not_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostPages, "load", lambda *a, **k: None)
    with pytest.raises(bench_host.RoundTripError):
        bench_host.run(torch.device("cpu"), pages=8, layers=1)


def test_host_bench_cli_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    res = CliRunner().invoke(command, ["host", "--pages", "16", "--layers", "2", "--device", "cpu",
                                       "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == ["host_reload", "host_save"]
    assert report["detail"]["bit_exact"] is True and report["detail"]["pages"] == 16
