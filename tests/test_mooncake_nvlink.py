"""``transfer.mooncake.protocol = "nvlink_intra"`` (GPUs of one host) without a GPU: the
settings, the refusals at connect (wheel, device, memory, import order) with their exact reasons,
``MC_INTRANODE_NVLINK`` set before the engine is imported, ``MC_FORCE_TCP``'s override. No
engine is needed: the checks run before it is imported."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.disagg import LinkSpec, registered_buffers
from cpkv.fallback import recording
from cpkv.settings import SettingsError, load_settings
from cpkv_transfer_mooncake import nvlink
from cpkv_transfer_mooncake.nvlink import (
    CUDA_WHEELS,
    ENV_FORCE_TCP,
    ENV_INTRANODE,
    NVLINK_INTRA,
    ProtocolRefused,
    plan_protocol,
)
from cpkv_transfer_mooncake.settings import MooncakeSettings
from helpers import torch_pool

CUDA_WHEEL = [CUDA_WHEELS[1]]
NON_CUDA = ["mooncake-transfer-engine-non-cuda"]


def _settings(**keys: Any) -> MooncakeSettings:
    s = load_settings(transfer={"name": "mooncake", "mooncake": keys})
    return s.transfer_table().parse(MooncakeSettings)


def _spec(device: str = "cpu", **keys: Any) -> LinkSpec:
    """A prefill endpoint's spec whose buffers claim ``device`` (the checks read only that)."""
    bufs = replace(registered_buffers(torch_pool(CPGroup.single(), capacity=4).store),
                   device=torch.device(device))
    table = load_settings(transfer={"mooncake": {"protocol": NVLINK_INTRA, **keys}}
                          ).transfer.table("mooncake")
    return LinkSpec(endpoint=0, cp_size=1, buffers=bufs, options=table)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No Mooncake or allocator variables, and the engine not imported in this process."""
    for var in (ENV_INTRANODE, ENV_FORCE_TCP, "MC_FORCE_MNNVL", *nvlink.ALLOC_CONF_VARS):
        monkeypatch.setenv(var, "x")  # (restored to absent afterwards)
        monkeypatch.delenv(var)
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    return monkeypatch


def test_the_protocol_setting_takes_nvlink_intra_and_rejects_unknown_values() -> None:
    assert _settings(protocol="nvlink_intra").protocol == "nvlink_intra"
    assert _settings().protocol == "tcp"
    with pytest.raises(SettingsError, match=r"transfer\.mooncake\.protocol: .*'nvlink-intra'"):
        _settings(protocol="nvlink-intra")


def test_nvlink_intra_initializes_the_engine_over_tcp_and_stages_nothing(
        clean_env: pytest.MonkeyPatch) -> None:
    from cpkv_transfer_mooncake.transport import stage_reason

    got = plan_protocol(NVLINK_INTRA, "cuda", wheels=CUDA_WHEEL)
    assert (got.engine, got.effective, got.forced_tcp) == ("tcp", NVLINK_INTRA, False)
    assert stage_reason("auto", "cuda", got.effective) is None  # the engine maps the pool
    other = plan_protocol("rdma", "cpu", wheels=NON_CUDA)  # other protocols: unchanged
    assert (other.engine, other.effective) == ("rdma", "rdma")


@pytest.mark.parametrize(("device", "wheels", "alloc_conf", "imported", "reasons"), [
    ("cuda", NON_CUDA, "", False, ["no intra-node NVLink transport"]),
    ("cpu", CUDA_WHEEL, "", False, ["buffers are on cpu, not a CUDA device"]),
    ("cuda", CUDA_WHEEL, "max_split_size_mb:128,expandable_segments:True", False,
     ["enables expandable_segments"]),
    ("cuda", CUDA_WHEEL, "backend:cudaMallocAsync", False, ["cudaMallocAsync"]),
    ("cuda", CUDA_WHEEL, "", True, ["imported in this process before MC_INTRANODE_NVLINK"]),
    ("cpu", NON_CUDA, "expandable_segments:True", False,
     ["no intra-node NVLink transport", "buffers are on cpu", "expandable_segments"]),
])
def test_nvlink_intra_refusals_name_each_reason(clean_env: pytest.MonkeyPatch, device: str,
                                                wheels: list[str], alloc_conf: str,
                                                imported: bool, reasons: list[str]) -> None:
    if alloc_conf:
        clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)
    with pytest.raises(ProtocolRefused) as info:
        plan_protocol(NVLINK_INTRA, device, wheels=wheels, engine_imported=imported)
    msg = str(info.value)
    assert msg.startswith("transfer.mooncake.protocol = 'nvlink_intra' refused: ")
    assert all(r in msg for r in reasons), msg
    assert msg.count("; ") == len(reasons) - 1  # exactly these reasons, none other
    assert "no silent TCP" in msg


def test_expandable_segments_off_is_plain_cuda_malloc() -> None:
    assert nvlink.allocator_problem({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None
    assert nvlink.allocator_problem({}) is None
    assert "PYTORCH_ALLOC_CONF" in (nvlink.allocator_problem(
        {"PYTORCH_ALLOC_CONF": "expandable_segments:true"}) or "")


def test_connect_refuses_before_importing_the_engine_or_any_collective(
        clean_env: pytest.MonkeyPatch) -> None:
    """On this CPU machine (CPU buffers, and a non-CUDA wheel unless a CUDA one is installed):
    the refusal comes from connect, the engine is never imported, no collective is entered (no
    torch.distributed world exists here: a collective would fail otherwise)."""
    from cpkv_transfer_mooncake.transport import MooncakeTransport

    loaded: list[bool] = []
    t = MooncakeTransport(lambda: loaded.append(True))
    with pytest.raises(ProtocolRefused, match=r"buffers are on cpu, not a CUDA device"):
        t.connect(_spec("cpu"))
    assert not loaded and ENV_INTRANODE not in os.environ


def test_the_environment_is_set_before_the_engine_is_imported(
        clean_env: pytest.MonkeyPatch) -> None:
    from cpkv_transfer_mooncake.transport import MooncakeTransport

    clean_env.setattr(nvlink, "installed_wheels", lambda: list(CUDA_WHEEL))
    seen: list[str | None] = []

    class Imported(Exception):
        pass

    def load_engine() -> Any:  # what the engine would see at its import
        seen.append(os.environ.get(ENV_INTRANODE))
        raise Imported

    with pytest.raises(Imported):
        MooncakeTransport(load_engine).connect(_spec("cuda"))
    assert seen == ["1"]
    # tcp leaves the environment alone
    clean_env.delenv(ENV_INTRANODE)
    with pytest.raises(Imported):
        MooncakeTransport(load_engine).connect(replace(_spec("cuda"), options=load_settings(
            transfer={"mooncake": {"protocol": "tcp"}}).transfer.table("mooncake")))
    assert seen == ["1", None]


def test_force_tcp_overrides_nvlink_intra_with_a_reported_fallback_and_host_staging(
        clean_env: pytest.MonkeyPatch) -> None:
    from cpkv_transfer_mooncake.transport import link_protocol, stage_reason

    clean_env.setenv(ENV_FORCE_TCP, "1")
    # no refusal even where nvlink_intra could not run: the override is plain TCP
    with recording() as rec:
        got = link_protocol(_settings(protocol=NVLINK_INTRA), "cpu")
    assert (got.engine, got.effective, got.forced_tcp) == ("tcp", "tcp", True)
    assert [e.reason.value for e in rec.events] == ["transfer_forced_tcp"]
    assert "cudaMemcpy" in (stage_reason("auto", "cuda", got.effective) or "")


def test_nvlink_intra_refuses_host_staging(clean_env: pytest.MonkeyPatch) -> None:
    from cpkv_transfer_mooncake.transport import link_protocol

    clean_env.setattr(nvlink, "installed_wheels", lambda: list(CUDA_WHEEL))
    with pytest.raises(ProtocolRefused, match=r"stage = 'host' stages in host memory"):
        link_protocol(_settings(protocol=NVLINK_INTRA, stage="host"), "cuda")
    assert link_protocol(_settings(protocol=NVLINK_INTRA), "cuda").intra_nvlink
