"""The plugin system: entry-point discovery of the five built-ins, broken plugins, selection with
preference and fallbacks, disable/allow, the ``cpkv_on_fallback`` hook and ``cpkv plugins``."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner

from cpkv import fallback
from cpkv.cli.plugins import command as plugins_command
from cpkv.contracts import Availability, FallbackReason, Op, PluginInfo, PluginKind
from cpkv.ops import ALL_OPS
from cpkv.plugin import BackendRegistry, BackendSpec, PluginHost, TransferSpec, hookimpl, spec

REPO = Path(__file__).resolve().parents[1]

BUILTINS = {
    # entry-point name: (kind, distribution)
    "torch": (PluginKind.BACKEND, "cpkv-backend-torch"),
    "triton": (PluginKind.BACKEND, "cpkv-backend-triton"),
    "cuda": (PluginKind.BACKEND, "cpkv-backend-cuda"),
    "nccl": (PluginKind.TRANSFER, "cpkv-transfer-nccl"),
    "mooncake": (PluginKind.TRANSFER, "cpkv-transfer-mooncake"),
}


# ---- helpers ---------------------------------------------------------------------------------
@pytest.fixture
def host() -> Iterator[PluginHost]:
    h = PluginHost()
    yield h
    h.close()


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a fake distribution into ``tmp_path`` (a ``*.dist-info`` folder with METADATA and
    entry_points.txt, plus top-level modules) and put it on ``sys.path``."""
    created: list[str] = []

    def make(name: str, entry_points: str, modules: dict[str, str]) -> None:
        info = tmp_path / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
        for mod, src in modules.items():
            (tmp_path / f"{mod}.py").write_text(textwrap.dedent(src))
            created.append(mod)
        monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates importlib's caches
        importlib.invalidate_caches()

    yield make
    for mod in created:
        sys.modules.pop(mod, None)
    importlib.invalidate_caches()


def _plugin(name: str, *specs: BackendSpec | TransferSpec) -> types.SimpleNamespace:
    """A plugin object registering ``specs`` (backends and transfers alike)."""
    ns = types.SimpleNamespace()
    backends = [s for s in specs if isinstance(s, BackendSpec)]
    transfers = [s for s in specs if isinstance(s, TransferSpec)]

    @hookimpl
    def cpkv_register_backends(registrar):
        for s in backends:
            registrar.add(s)

    @hookimpl
    def cpkv_register_transfers(registrar):
        for s in transfers:
            registrar.add(s)

    ns.cpkv_register_backends = cpkv_register_backends
    ns.cpkv_register_transfers = cpkv_register_transfers
    return ns


def _backend(name: str, ops: set[Op], available: bool = True) -> BackendSpec:
    def probe() -> Availability:
        return Availability.yes() if available else Availability.no(f"{name} probe says no")

    return BackendSpec(name=name, ops=frozenset(ops), probe=probe,
                       load=lambda: f"{name}-impl", description=f"test backend {name}")


def _hand_host(*plugins: tuple[str, types.SimpleNamespace]) -> PluginHost:
    h = PluginHost(load_entry_points=False)
    for name, p in plugins:
        h.register(p, name)
    return h


def _by_name(infos: list[PluginInfo]) -> dict[str, PluginInfo]:
    return {i.name: i for i in infos}


# ---- discovery of the built-ins --------------------------------------------------------------
def test_discovers_exactly_the_five_builtins(host: PluginHost) -> None:
    infos = host.infos()
    assert sorted(i.name for i in infos) == sorted(BUILTINS)
    for info in infos:
        kind, dist = BUILTINS[info.name]
        assert (info.kind, info.distribution, info.version) == (kind, dist, "0.1.0"), info
        assert info.entry_point.endswith(".plugin")
        assert info.description


def test_builtin_availability_on_this_cpu_machine(host: PluginHost) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the no-device reasons do not apply")
    infos = _by_name(host.infos())
    assert infos["torch"].availability.available
    av = infos["cuda"].availability
    assert not av.available
    assert av.reason == "no CUDA device (torch.cuda.is_available() is False)"
    av = infos["triton"].availability  # kernels exist; the interpreter would make it available
    assert not av.available
    assert "no CUDA device" in av.reason and "TRITON_INTERPRET=1 is not set" in av.reason
    assert "triton is not installed" in infos["triton"].availability.reason or (
        importlib.util.find_spec("triton") is not None)
    assert infos["nccl"].availability.available  # torch.distributed (Gloo here)
    moon = infos["mooncake"].availability
    if importlib.util.find_spec("mooncake") is None:
        assert not moon.available and "mooncake-transfer-engine not installed" in moon.reason
    else:  # the wheel is there: available, or the missing system library is named
        assert moon.available or "libibverbs" in moon.reason or "libcuda" in moon.reason


def test_builtin_loads() -> None:
    from cpkv_backend_torch.ops import TorchOps
    from cpkv_backend_triton import plugin as triton_plugin

    h = PluginHost()
    try:
        reg = h.backends()
        assert isinstance(reg.load("torch"), TorchOps)
        assert reg.specs["torch"].ops == frozenset(ALL_OPS)
        if triton_plugin.probe().available:  # a CUDA device, or TRITON_INTERPRET=1
            assert callable(triton_plugin.load().page_gather)
        else:
            with pytest.raises(RuntimeError, match=r"triton backend cannot be loaded: .*(no CUDA "
                                                   r"device|triton is not installed)"):
                triton_plugin.load()
        from cpkv_transfer_mooncake import plugin as mooncake_plugin

        if mooncake_plugin.probe().available:
            assert h.transfers().specs["mooncake"].load().name == "mooncake"
        else:
            with pytest.raises(RuntimeError, match="mooncake transfer cannot be loaded"):
                h.transfers().specs["mooncake"].load()
    finally:
        h.close()


@pytest.mark.multiprocess
def test_plugin_modules_are_light() -> None:
    """Discovery and probing of the entry points import neither triton nor mooncake, and
    importing the plugin modules does not import torch."""
    code = textwrap.dedent("""
        import sys
        import cpkv_backend_torch.plugin, cpkv_backend_triton.plugin, cpkv_backend_cuda.plugin
        import cpkv_transfer_nccl.plugin, cpkv_transfer_mooncake.plugin
        assert "torch" not in sys.modules, "a plugin module imported torch"
        from cpkv.plugin import PluginHost
        PluginHost().infos()
        heavy = [m for m in ("triton", "mooncake", "flash_mla", "cpkv_backend_torch.ops")
                 if m in sys.modules]
        assert not heavy, heavy
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         timeout=120)
    assert res.returncode == 0, res.stderr


# ---- broken plugins never stop discovery -----------------------------------------------------
GOOD_MODULE = """
    from cpkv.contracts import Availability, Op
    from cpkv.plugin import BackendSpec, hookimpl

    class GoodOps:
        def rerange(self, x):
            return x

    @hookimpl
    def cpkv_register_backends(registrar):
        registrar.add(BackendSpec(name="good", ops=frozenset({Op.RERANGE}),
                                  probe=Availability.yes, load=GoodOps))
"""


def test_broken_entry_point_is_listed_and_others_load(fake_dist) -> None:
    fake_dist("fakeplug", """
        [cpkv.backends]
        broken = fakeplug_missing_module
        good = fakeplug_good
    """, {"fakeplug_good": GOOD_MODULE})
    with structlog.testing.capture_logs() as logs:
        h = PluginHost()
    try:
        failed = [e for e in logs if e["event"] == "cpkv.plugin.load_failed"]
        assert [e["name"] for e in failed] == ["broken"]
        assert "fakeplug_missing_module" in failed[0]["error"]
        infos = _by_name(h.infos())
        assert set(BUILTINS) | {"good", "broken"} == set(infos)
        good, broken = infos["good"], infos["broken"]
        assert (good.distribution, good.version, good.ops) == ("fakeplug", "0.1", ("rerange",))
        assert good.availability.available
        assert not broken.availability.available
        assert "failed to load" in broken.availability.reason
        assert "fakeplug_missing_module" in broken.availability.reason
        sel = h.backends().select(["broken", "good"], ops=[Op.RERANGE])
        assert sel["rerange"].name == "good"
        assert sel["rerange"].impl.rerange(3) == 3
    finally:
        h.close()


def test_register_hook_that_raises_is_isolated(fake_dist) -> None:
    fake_dist("fakeraise", """
        [cpkv.backends]
        raiser = fakeplug_raiser
        good = fakeplug_good
    """, {"fakeplug_good": GOOD_MODULE, "fakeplug_raiser": """
        from cpkv.plugin import hookimpl

        @hookimpl
        def cpkv_register_backends(registrar):
            raise RuntimeError("boom in register")
    """})
    h = PluginHost()
    try:
        with structlog.testing.capture_logs() as logs:
            reg = h.backends()
        failed = [e for e in logs if e["event"] == "cpkv.plugin.register_failed"]
        assert [(e["plugin"], e["hook"]) for e in failed] == [("raiser", "cpkv_register_backends")]
        assert "boom in register" in failed[0]["error"]
        assert {"torch", "triton", "cuda", "good"} <= set(reg.names())
        infos = _by_name(h.infos())
        assert not infos["raiser"].availability.available
        assert "boom in register" in infos["raiser"].availability.reason
        assert infos["good"].availability.available and infos["torch"].availability.available
    finally:
        h.close()


def test_plugin_with_unknown_hook_is_rejected_alone(fake_dist) -> None:
    """A typo in a hook name fails that plugin's load, not the whole host (check_pending)."""
    fake_dist("faketypo", """
        [cpkv.backends]
        typo = fakeplug_typo
        good = fakeplug_good
    """, {"fakeplug_good": GOOD_MODULE, "fakeplug_typo": """
        from cpkv.plugin import hookimpl

        @hookimpl
        def cpkv_register_backend(registrar):  # missing "s"
            pass
    """})
    with structlog.testing.capture_logs() as logs:
        h = PluginHost()
    try:
        failed = [e for e in logs if e["event"] == "cpkv.plugin.load_failed"]
        assert [e["name"] for e in failed] == ["typo"]
        assert "cpkv_register_backend" in failed[0]["error"]
        infos = _by_name(h.infos())
        assert infos["good"].availability.available
        assert "failed to load" in infos["typo"].availability.reason
        assert h.pm.get_plugin("typo") is None
    finally:
        h.close()


def test_register_impl_may_take_fewer_arguments_than_its_spec() -> None:
    ns = types.SimpleNamespace()

    @hookimpl
    def cpkv_register_backends():
        pass

    ns.cpkv_register_backends = cpkv_register_backends
    h = _hand_host(("noargs", ns), ("p", _plugin("p", _backend("ref", {Op.RERANGE}))))
    try:
        with structlog.testing.capture_logs() as logs:
            reg = h.backends()
        assert not [e for e in logs if e["event"] == "cpkv.plugin.register_failed"]
        assert reg.names() == ["ref"]
    finally:
        h.close()


def test_duplicate_backend_name_first_registration_wins() -> None:
    first = BackendSpec(name="dup", ops=frozenset(), probe=Availability.yes, load=object,
                        description="first")
    second = BackendSpec(name="dup", ops=frozenset(), probe=Availability.yes, load=object,
                         description="second")
    h = _hand_host(("p1", _plugin("p1", first)), ("p2", _plugin("p2", second)))
    try:
        with structlog.testing.capture_logs() as logs:
            reg = h.backends()
            infos = h.infos()
        assert any(e["event"] == "cpkv.plugin.duplicate" for e in logs)
        assert reg.specs["dup"].description == "first"
        assert reg.origin["dup"] == "p1"
        dup = [i for i in infos if i.name == "dup"]
        assert len(dup) == 1 and dup[0].description == "first"
        # p2's registration lost: p2 is listed as providing nothing usable
        p2 = [i for i in infos if i.name == "p2"]
        assert len(p2) == 1 and not p2[0].availability.available
    finally:
        h.close()


# ---- selection -------------------------------------------------------------------------------
def test_preference_falls_back_from_triton_to_torch_on_cpu(host: PluginHost) -> None:
    reg = host.backends()
    if reg.availability("triton").available:
        pytest.skip("triton is available here")
    with fallback.recording() as rec:
        sel = reg.select(["triton", "torch"])
    assert list(sel) == ["backend"] and sel["backend"].name == "torch"
    from cpkv_backend_torch.ops import TorchOps

    assert isinstance(sel["backend"].impl, TorchOps)
    assert len(rec.events) == 1
    ev = rec.events[0]
    assert (ev.requested, ev.selected, ev.reason) == (
        "triton", "torch", FallbackReason.PLUGIN_UNAVAILABLE)
    assert ev.op == "backend_select" and "triton" in ev.detail


def test_no_fallback_event_when_first_preference_serves(host: PluginHost) -> None:
    with fallback.recording() as rec:
        sel = host.backends().select(["torch", "triton"])
    assert sel["backend"].name == "torch"
    assert rec.events == []


def test_a_preferred_backend_nobody_registered_is_plugin_not_found(host: PluginHost) -> None:
    """A preference naming a backend that no installed plugin registers (a typo, a distribution
    not installed): selection steps past it with one ``plugin_not_found`` event and its warning,
    on the way through the op table too; with policy ``error`` the step is refused."""
    from cpkv.ops import OpTable

    with fallback.recording() as rec, structlog.testing.capture_logs() as logs:
        table = OpTable.resolve(host.backends(), ["no-such-backend", "torch"], [Op.RERANGE])
    assert table.chosen == {"rerange": "torch"}
    assert [(e.op, e.requested, e.selected, e.reason) for e in rec.events] == [
        ("backend_select", "no-such-backend", "torch", FallbackReason.PLUGIN_NOT_FOUND)]
    assert "no-such-backend: not discovered" in rec.events[0].detail
    warned = [e for e in logs if e["event"] == "cpkv.fallback"]
    assert [(e["log_level"], e["reason"], e["requested"]) for e in warned] == [
        ("warning", "plugin_not_found", "no-such-backend")]
    with fallback.recording("error"), pytest.raises(fallback.FallbackError,
                                                    match="plugin_not_found"):
        host.backends().select(["no-such-backend", "torch"])


def test_select_per_op_reports_op_not_provided() -> None:
    h = _hand_host(("p", _plugin("p", _backend("fast", {Op.TOPK}),
                                  _backend("ref", {Op.TOPK, Op.RERANGE}))))
    try:
        with fallback.recording() as rec, structlog.testing.capture_logs() as logs:
            sel = h.backends().select(["fast", "ref"], ops=[Op.TOPK, Op.RERANGE])
        assert {op: s.name for op, s in sel.items()} == {"topk": "fast", "rerange": "ref"}
        assert sel["rerange"].impl == "ref-impl"
        assert [(e.requested, e.selected, e.reason) for e in rec.events] == [
            ("fast", "ref", FallbackReason.OP_NOT_PROVIDED)]
        assert "rerange" in rec.events[0].detail
        assert [e["reason"] for e in logs if e["event"] == "cpkv.fallback"] == ["op_not_provided"]
    finally:
        h.close()


def test_a_declined_call_runs_on_the_next_backend_once_reported_per_reason() -> None:
    """A backend whose op raises OpDeclined for some calls (a shape its kernel does not take):
    those calls run on the next backend of the preference that provides the op; each (backend,
    reason) is one ``op_declined`` event; accepted calls stay on the first backend."""
    from cpkv.contracts import OpDeclined
    from cpkv.ops import OpTable

    class Fast:
        def topk(self, n: int) -> str:
            if n % 64:
                raise OpDeclined(f"k={n} is not a multiple of 64")
            return "fast"

    class Ref:
        def topk(self, n: int) -> str:
            return "ref"

    def spec(name: str, impl: type) -> BackendSpec:
        return BackendSpec(name=name, ops=frozenset({Op.TOPK}), probe=Availability.yes,
                           load=impl, description=name)

    h = _hand_host(("p", _plugin("p", spec("fast", Fast), spec("ref", Ref))))
    try:
        with fallback.recording() as rec:
            table = OpTable.resolve(h.backends(), ["fast", "ref"], [Op.TOPK])
            got = [table.topk(n) for n in (128, 16, 16, 8, 64)]
        assert got == ["fast", "ref", "ref", "ref", "fast"]
        assert [(e.op, e.requested, e.selected, e.reason) for e in rec.events] == [
            ("topk", "fast", "ref", FallbackReason.OP_DECLINED)] * 2
        assert [e.detail for e in rec.events] == ["fast: k=16 is not a multiple of 64",
                                                  "fast: k=8 is not a multiple of 64"]
        with fallback.recording("error"), pytest.raises(fallback.FallbackError):
            OpTable.resolve(h.backends(), ["fast", "ref"], [Op.TOPK]).topk(1)
        only = OpTable.resolve(h.backends(), ["fast"], [Op.TOPK])
        with pytest.raises(RuntimeError, match="every backend declined"):
            only.topk(1)
    finally:
        h.close()


def test_a_backend_for_other_devices_is_skipped_for_this_run() -> None:
    """A GPU-only backend on a machine with a GPU, for a run whose tensors are on the CPU (Gloo
    ranks): not selected, with the reason; for a CUDA run it is."""
    gpu = BackendSpec(name="gpu", ops=frozenset({Op.TOPK}), probe=Availability.yes,
                      load=lambda: "gpu-impl", device_types=lambda: frozenset({"cuda"}))
    h = _hand_host(("p", _plugin("p", gpu, _backend("ref", {Op.TOPK}))))
    try:
        with fallback.recording() as rec:
            cpu = h.backends().select(["gpu", "ref"], ops=[Op.TOPK], device_type="cpu")
        assert cpu["topk"].name == "ref"
        assert [(e.requested, e.selected, e.reason) for e in rec.events] == [
            ("gpu", "ref", FallbackReason.PLUGIN_UNAVAILABLE)]
        assert "gpu: runs on cuda, this run's tensors are on cpu" in rec.events[0].detail
        with fallback.recording() as rec:
            cuda = h.backends().select(["gpu", "ref"], ops=[Op.TOPK], device_type="cuda")
        assert cuda["topk"].name == "gpu" and rec.events == []
        assert [n for n, _ in cuda["topk"].then] == ["ref"]
    finally:
        h.close()


def test_select_raises_when_nothing_can_serve() -> None:
    h = _hand_host(("p", _plugin("p", _backend("fast", {Op.TOPK}),
                                  _backend("off", {Op.RERANGE}, available=False))))
    try:
        reg = h.backends()
        with fallback.recording() as rec, pytest.raises(LookupError, match="rerange") as err:
            reg.select(["fast", "off", "ghost"], ops=[Op.RERANGE])
        assert "does not provide rerange" in str(err.value)
        assert "off probe says no" in str(err.value)
        assert "ghost: not discovered" in str(err.value)
        assert rec.events == []
        with pytest.raises(ValueError, match="empty"):
            reg.select([])
    finally:
        h.close()


def test_agree_marks_a_backend_unavailable_on_another_rank() -> None:
    h = _hand_host(("p", _plugin("p", _backend("fast", {Op.RERANGE}),
                                  _backend("ref", {Op.RERANGE}))))
    seen: list[dict[str, bool]] = []

    def agree(local: dict[str, bool]) -> dict[str, bool]:
        seen.append(dict(local))
        return {**local, "fast": False}  # another rank cannot run "fast"

    try:
        with fallback.recording() as rec:
            sel = h.backends().select(["fast", "ref"], ops=[Op.RERANGE], agree=agree)
        assert seen == [{"fast": True, "ref": True}]
        assert sel["rerange"].name == "ref"
        assert len(rec.events) == 1
        assert rec.events[0].reason is FallbackReason.PLUGIN_UNAVAILABLE
        assert "unavailable on another rank" in rec.events[0].detail
    finally:
        h.close()


def test_fallback_policy_error_refuses_the_step(host: PluginHost) -> None:
    if host.backends().availability("triton").available:
        pytest.skip("triton is available here: selecting it is no fallback step")
    with fallback.recording("error"), pytest.raises(fallback.FallbackError, match="triton"):
        host.backends().select(["triton", "torch"])


def test_disable_lists_torch_as_disabled_and_never_selects_it() -> None:
    h = PluginHost(disable=["torch"])
    try:
        h.register(_plugin("alt", _backend("alt", {Op.RERANGE})), "alt")
        infos = _by_name(h.infos())
        assert set(infos) == set(BUILTINS) | {"alt"}
        torch_info = infos["torch"]
        assert torch_info.distribution == "cpkv-backend-torch"
        assert not torch_info.availability.available
        assert "disabled" in torch_info.availability.reason
        assert h.pm.get_plugin("torch") is None  # never loaded
        reg = h.backends()
        assert "torch" not in reg.names()
        with pytest.raises(LookupError, match=r"torch: disabled by settings"):
            reg.select(["torch"])
        with fallback.recording() as rec:
            sel = reg.select(["torch", "alt"])
        assert sel["backend"].name == "alt"
        assert [e.reason for e in rec.events] == [FallbackReason.PLUGIN_DISABLED]
        assert "torch: disabled" in rec.events[0].detail
    finally:
        h.close()


def test_allow_loads_only_the_named_plugins() -> None:
    h = PluginHost(allow=["torch", "nccl"])
    try:
        infos = _by_name(h.infos())
        assert set(infos) == set(BUILTINS)  # still listed, so users see what they switched off
        assert infos["torch"].availability.available
        for name in ("triton", "cuda", "mooncake"):
            assert "disabled" in infos[name].availability.reason
            assert h.pm.get_plugin(name) is None
        assert infos["nccl"].availability.available
        assert h.backends().names() == ["torch"]
        assert h.transfers().names() == ["nccl"]
    finally:
        h.close()


def test_transfer_plugins_register_and_select() -> None:
    """``cpkv_register_transfers`` fills the transfer registry, apart from the backends."""
    loop = TransferSpec(name="loopback", probe=Availability.yes, load=lambda: "loop-impl",
                        description="in-process")
    h = PluginHost(load_entry_points=False)
    h.register(_plugin("t", loop), "t", kind=PluginKind.TRANSFER)
    try:
        assert h.backends().names() == []
        reg = h.transfers()
        assert reg.names() == ["loopback"] and reg.origin == {"loopback": "t"}
        sel = reg.select(["loopback"])
        assert (sel["transfer"].name, sel["transfer"].impl) == ("loopback", "loop-impl")
        info = _by_name(h.infos())["loopback"]
        assert info.kind is PluginKind.TRANSFER and info.ops == ()
    finally:
        h.close()


def test_registry_probe_that_raises_counts_as_unavailable() -> None:
    def probe() -> Availability:
        raise OSError("driver exploded")

    reg = BackendRegistry(PluginKind.BACKEND,
                   [BackendSpec(name="x", ops=frozenset(), probe=probe, load=object)])
    av = reg.availability("x")
    assert not av.available and "driver exploded" in av.reason


# ---- the cpkv_on_fallback hook -----------------------------------------------------------------
def test_on_fallback_hook_receives_events_until_close() -> None:
    received = []

    class Observer:
        @hookimpl
        def cpkv_on_fallback(self, event):
            received.append(event)

    h = PluginHost(load_entry_points=False)
    h.register(Observer(), "observer")
    with fallback.recording() as rec:
        ev = fallback.report_fallback(op="rerange", requested="cuda", selected="torch",
                                      reason=FallbackReason.OP_NOT_PROVIDED, detail="test")
        assert received == [ev] and rec.events == [ev]
        h.close()
        fallback.report_fallback(op="rerange", requested="cuda", selected="torch",
                                 reason="op_not_provided")
    assert received == [ev]
    assert len(rec.events) == 2  # still counted, just no longer forwarded


# ---- the cpkv plugins command ----------------------------------------------------------------
def test_cli_table_lists_all_five() -> None:
    res = CliRunner().invoke(plugins_command, [], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output  # unavailable plugins are information, not failure
    for name, (_kind, dist) in BUILTINS.items():
        assert name in res.output
        assert dist in res.output
    assert "no CUDA device (torch.cuda.is_available() is False)" in res.output
    assert "yes" in res.output and "no" in res.output


def test_cli_json() -> None:
    res = CliRunner().invoke(plugins_command, ["--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert sorted(d["name"] for d in data) == sorted(BUILTINS)
    for d in data:
        assert {"name", "kind", "distribution", "version", "availability"} <= set(d)
        assert d["kind"] == BUILTINS[d["name"]][0].value
        assert d["distribution"] == BUILTINS[d["name"]][1]
        assert d["version"] == "0.1.0"
        assert set(d["availability"]) == {"available", "reason"}
        PluginInfo.model_validate(d)  # round-trips into the contract model
    assert {d["name"]: d["availability"]["available"] for d in data}["torch"] is True


def test_cli_config_disables_plugins(tmp_path: Path) -> None:
    cfg = tmp_path / "cpkv.toml"
    cfg.write_text('[plugins]\ndisable = ["cuda", "mooncake"]\n')
    res = CliRunner().invoke(plugins_command, ["--json", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    avail = {d["name"]: d["availability"] for d in json.loads(res.output)}
    assert "disabled" in avail["cuda"]["reason"] and "disabled" in avail["mooncake"]["reason"]
    assert avail["torch"]["available"]
    cfg.write_text('[plugins]\nallow = ["torch"]\n')
    res = CliRunner().invoke(plugins_command, ["--json", "--config", str(cfg)])
    avail = {d["name"]: d["availability"] for d in json.loads(res.output)}
    assert [n for n, a in avail.items() if "disabled" not in a["reason"]] == ["torch"]


def test_cli_bad_config_is_a_usage_error(tmp_path: Path) -> None:
    cfg = tmp_path / "cpkv.toml"
    cfg.write_text('[plugins]\ndisabel = ["cuda"]\n')
    res = CliRunner().invoke(plugins_command, ["--config", str(cfg)])
    assert res.exit_code == 1
    assert "disabel" in res.output


# ---- meta-test (datasette style) ---------------------------------------------------------------
def test_every_hookspec_is_documented_and_tested() -> None:
    hooks = [n for n, f in inspect.getmembers(spec, inspect.isfunction) if n.startswith("cpkv_")]
    assert sorted(hooks) == sorted(
        ["cpkv_register_backends", "cpkv_register_transfers", "cpkv_on_fallback"]
    ), "a hook was added or removed: document it in docs/plugins.md and test it here"
    docs = (REPO / "docs" / "plugins.md").read_text()
    tests = Path(__file__).read_text()
    for name in hooks:
        assert f"`{name}" in docs, f"{name} is not documented in docs/plugins.md"
        # the test file must use the hook, not only name it in this meta-test's list
        assert tests.count(name) >= 2, f"{name} has no test in tests/test_plugins.py"
