"""``cpkv bench transfer`` on the CPU (Gloo, no --gpus): the rows per plugin and protocol, and
its options (``--tokens`` lists, ``--mooncake-protocol`` lists incl. ``nvlink_intra``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cpkv.bench.transfer import run_label
from cpkv.cli import main


def test_run_labels_name_mooncake_protocols() -> None:
    assert run_label("nccl") == "nccl"
    assert run_label("mooncake", "nvlink_intra") == "mooncake_nvlink_intra"


def test_an_unknown_mooncake_protocol_is_rejected_before_any_run() -> None:
    res = CliRunner().invoke(main, ["bench", "transfer", "--mooncake-protocol", "tcp,nvlink-intra"])
    assert res.exit_code != 0 and "nvlink_intra" in res.output


@pytest.mark.multiprocess
@pytest.mark.slow  # 4-5 CPU seconds
def test_cpu_transfer_bench_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    res = CliRunner().invoke(main, ["bench", "transfer", "--plugins", "nccl", "--cp", "1",
                                    "--layers", "2", "--tokens", "128,256", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    names = {r["name"] for r in data["results"]}
    for k in ("128", "256"):
        assert {f"transfer_nccl_{k}_ready_layer_vs_request",
                f"transfer_nccl_{k}_ready_layer_vs_prefill",
                f"transfer_nccl_{k}_exposed_layer_vs_request",
                f"transfer_nccl_{k}_prefill_while_sending"} <= names
    assert not any(n.endswith("_gbps") for n in names)  # no raw GPU copy on the CPU
    slow = {r["name"]: r for r in data["results"]}["transfer_nccl_256_prefill_while_sending"]
    med = data["detail"]["nccl"]["median_256"]["prefill"]
    assert (slow["value"], slow["baseline_value"]) == (med["layer"], med["alone"]) and med["alone"] > 0
