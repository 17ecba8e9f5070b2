"""The Triton backend's tuning table (cpkv_backend_triton.tuning): one default row per launch,
every row naming a measurement that exists in the repository, the most specific row chosen for
a device, and the kernels' names (``attention.INDEXER_DEFAULT``, ``topk.TOPK_CONFIG`` /
``TOPK_LONG``) reading the table."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from triton_interp import import_kernels

pytest.importorskip("triton", reason="triton is not installed")
import cpkv_backend_triton.tuning as tuning

topk_mod = import_kernels("cpkv_backend_triton.topk", "_topk_filter_kernel")
attention = import_kernels("cpkv_backend_triton.attention", "_indexer_kernel")
Launch, DeviceKey, Row = tuning.Launch, tuning.DeviceKey, tuning.Row
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lets a test replace ``tuning.TABLE`` (the lookups' cache cleared before and after)."""
    tuning.cache_clear()
    yield
    monkeypatch.undo()
    tuning.cache_clear()


def test_each_op_has_one_default_row_and_no_device_twice() -> None:
    keys = [(r.op, r.device) for r in tuning.TABLE]
    assert len(keys) == len(set(keys))
    for op in Launch:
        assert [r for r in tuning.TABLE if r.op is op and r.device == DeviceKey()], op


def test_every_row_names_a_measurement_in_the_repository() -> None:
    for r in tuning.TABLE:
        files = re.findall(r"(?:docs|benchmarks)/[\w./-]+\.(?:md|jsonl|json|py)", r.source)
        assert files, r
        for f in files:
            assert (ROOT / f).is_file(), (r.op, f)


def test_the_most_specific_matching_row_wins(monkeypatch: pytest.MonkeyPatch, table: None) -> None:
    for name, cap in (("NVIDIA H100 80GB HBM3", (9, 0)), ("", None), ("NVIDIA H200", (10, 0))):
        assert tuning.row(Launch.TOPK, name, cap).device == DeviceKey()
    base = tuning.row(Launch.TOPK).params
    rows = (Row(Launch.TOPK, DeviceKey(), base, "default"),
            Row(Launch.TOPK, DeviceKey(capability=(9, 0)), replace(base, BLOCK=1), "cap"),
            Row(Launch.TOPK, DeviceKey("H100"), replace(base, BLOCK=2), "name"),
            Row(Launch.TOPK, DeviceKey("H100", (9, 0)), replace(base, BLOCK=3), "both"))
    monkeypatch.setattr(tuning, "TABLE", rows)
    assert tuning.row(Launch.TOPK, "NVIDIA H100", (9, 0)).source == "both"
    assert tuning.row(Launch.TOPK, "NVIDIA H100", (8, 0)).source == "name"
    assert tuning.row(Launch.TOPK, "NVIDIA H800", (9, 0)).source == "cap"
    assert tuning.row(Launch.TOPK, "NVIDIA A100", (8, 0)).source == "default"
    assert tuning.tuned(Launch.TOPK, torch.device("cpu"))["BLOCK"] == base.BLOCK


def test_the_kernels_read_the_table(monkeypatch: pytest.MonkeyPatch, table: None) -> None:
    assert tuning.device_of(torch.device("cpu")) == ("", None)
    rows = []
    for r in tuning.TABLE:
        p = r.params
        if r.op is Launch.INDEXER:
            p = replace(p, PAGED_BLOCK_N=16, FEW_ROWS=2)
        elif r.op is Launch.TOPK:
            p = replace(p, BLOCK=32)
        elif r.op is Launch.TOPK_LONG:
            p = replace(p, MIN_T=100)
        rows.append(replace(r, params=p))
    monkeypatch.setattr(tuning, "TABLE", tuple(rows))
    if not torch.cuda.is_available():  # a CUDA run reads its device's row: the H200 one may win
        cfg = attention.AttentionKernels(indexer_config={"FEW_ROWS": 4}).indexer_config
        assert (cfg["PAGED_BLOCK_N"], cfg["FEW_ROWS"]) == (16, 4)  # the row, then the overrides
        assert topk_mod.TOPK_CONFIG["BLOCK"] == 32 and topk_mod.TOPK_LONG["MIN_T"] == 100
        assert dict(topk_mod.TOPK_LONG) == tuning.row(Launch.TOPK_LONG).params.as_dict()


def test_the_tables_values_are_what_the_kernels_had() -> None:
    """The rows hold the measured values (docs/triton.md names each measurement)."""
    h200 = {op: tuning.row(op, "NVIDIA H200", (9, 0)).params.as_dict() for op in Launch}
    assert h200[Launch.INDEXER] == {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3,
                                "FEW_ROWS": 8, "FEW_BLOCK_N": 128, "few_warps": 4,
                                "PAGED_BLOCK_N": 128, "PAGED_ROWS": 1, "paged_warps": 4,
                                "PAGED_KERNEL": 1, "PAGED_PAGES": 8, "PAGED_STAGES": 1,
                                "PAGED_KEYS_M": 1, "PAGED_MAJOR_PAGES": 16,
                                "PAGED_MAJOR_STAGES": 3}
    assert h200[Launch.TOPK] == {"BLOCK": 512, "CHUNK": 8192, "num_warps": 4, "final_warps": 4,
                             "BINS": 64}
    assert h200[Launch.TOPK_LONG]["MIN_T"] == 196608 and h200[Launch.TOPK_LONG]["SCRATCH_MB"] == 64
    # a decode step's rows (fewer programs than SMs): 8 warps for the floor and the select
    assert h200[Launch.TOPK_LONG]["FEW_ROWS"] == 128
    assert h200[Launch.TOPK_LONG]["few_floor_warps"] == h200[Launch.TOPK_LONG]["few_select_warps"] == 8
    assert h200[Launch.TOPK_LONG]["GLUON"] == 1  # the Gluon filter
    assert h200[Launch.SPARSE_MLA]["P_SPLIT"] == 2 and h200[Launch.SPARSE_MLA_LOWP]["P_SPLIT"] == 1
    # the fused indexer top-k: from the long-row top-k's length; the plain indexer's tiles
    fused = h200[Launch.INDEXER_TOPK]
    assert fused["MIN_T"] == h200[Launch.TOPK_LONG]["MIN_T"] and fused["MAXNREG"] == 168
    assert {f: fused[f] for f in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")} == {
        f: h200[Launch.INDEXER][f] for f in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    for op in Launch:
        assert tuning.row(op).params.as_dict() == h200[op]


def test_the_environment_overrides_a_field_of_every_row(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """``TRITON_CPKV_TUNING`` (values to try, inherited by the processes a run starts)
    changes the named fields of every device's row and nothing else, said once in a
    warning; unset, the table's values again."""
    spec = "TOPK_LONG.GLUON=1, INDEXER.FEW_ROWS=1,TOPK_LONG.BLOCK=512"
    monkeypatch.setenv(tuning.TUNING_ENV, spec)
    tuning.cache_clear()
    try:
        for name, cap in (("", None), ("NVIDIA H200", (9, 0)), ("NVIDIA H100 80GB HBM3", (9, 0))):
            long_row = tuning._tuned(Launch.TOPK_LONG, name, cap)
            table = tuning.row(Launch.TOPK_LONG, name, cap).params.as_dict()
            assert dict(long_row) == {**table, "GLUON": 1, "BLOCK": 512}
            assert tuning._tuned(Launch.INDEXER, name, cap)["FEW_ROWS"] == 1
            assert dict(tuning._tuned(Launch.TOPK, name, cap)) == tuning.row(Launch.TOPK).params.as_dict()
        said = [r for r in caplog.records if r.name == "cpkv.tuning"]
        assert len(said) == 1 and spec in said[0].getMessage(), said
        monkeypatch.delenv(tuning.TUNING_ENV)
        tuning.cache_clear()
        assert tuning.tuned(Launch.TOPK_LONG)["GLUON"] == tuning.row(Launch.TOPK_LONG).params.GLUON
    finally:
        tuning.cache_clear()


@pytest.mark.parametrize(("spec", "says"), [("TOPK_LONG.GLUON", "LAUNCH.FIELD=VALUE"),
                                             ("GLUON=1", "LAUNCH.FIELD=VALUE"),
                                             ("TOPKLONG.GLUON=1", "no launch 'TOPKLONG'"),
                                             ("TOPK.GLUON=1", "TOPK has no field 'GLUON'"),
                                             ("TOPK.BLOCK=big", "not an integer")])
def test_a_bad_override_is_an_error_that_names_it(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        tuning.overrides(spec)


def test_the_override_variable_is_not_a_settings_variable() -> None:
    """The settings refuse every ``CPKV_*`` variable that names no settings key (a run with
    such a variable stops at startup), so the tuning override lives outside that prefix; a
    run's settings load with it set."""
    from cpkv.settings import ENV_PREFIX, Settings, unknown_env_vars

    assert not tuning.TUNING_ENV.upper().startswith(ENV_PREFIX)
    assert unknown_env_vars(Settings, {tuning.TUNING_ENV: "TOPK_LONG.GLUON=1"}) == []
    assert unknown_env_vars(Settings, {"CPKV_TRITON_TUNING": "TOPK_LONG.GLUON=1"}) != []
