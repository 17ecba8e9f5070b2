"""Entry-point discovery and the typed facade over pluggy.

The rest of cpkv talks to :class:`PluginHost`, never to ``pm.hook``. Each entry point is loaded in
its own try/except: a broken plugin is logged (``cpkv.plugin.load_failed``), listed as unavailable
with its error, and never stops discovery.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

import pluggy

from cpkv import fallback
from cpkv.contracts import Availability, FallbackEvent, FallbackReason, PluginInfo, PluginKind
from cpkv.logs import get_logger

from . import spec
from .registry import (
    BackendRegistrar,
    BackendRegistry,
    BackendSpec,
    TransferRegistrar,
    TransferRegistry,
    TransferSpec,
    _Registrar,
)

__all__ = ["GROUPS", "Discovered", "PluginHost"]

log = get_logger(__name__)

_SpecT = TypeVar("_SpecT", BackendSpec, TransferSpec)

GROUPS: dict[PluginKind, str] = {
    PluginKind.BACKEND: "cpkv.backends",
    PluginKind.TRANSFER: "cpkv.transfers",
}


@dataclass(frozen=True)
class Discovered:
    """One entry point and what became of it."""

    name: str
    kind: PluginKind
    entry_point: str
    distribution: str
    version: str
    error: str | None = None  # load failure, or why it was skipped
    reason: FallbackReason | None = None


def _dist(ep: EntryPoint) -> tuple[str, str]:
    d = getattr(ep, "dist", None)
    if d is None:
        return "?", "?"
    return d.metadata["Name"] or d.name, d.version


class PluginHost:
    """Owns the pluggy manager and the discovered plugins of one process.

    Args:
        disable: entry-point names never loaded (reported as disabled).
        allow: when given, only these names are loaded; the others are reported as disabled.
        load_entry_points: discover the ``cpkv.*`` entry-point groups now (tests may pass False
            and :meth:`register` plugins by hand).
    """

    def __init__(
        self,
        disable: Iterable[str] = (),
        allow: Iterable[str] | None = None,
        load_entry_points: bool = True,
    ) -> None:
        self.pm = pluggy.PluginManager(spec.PROJECT)
        self.pm.add_hookspecs(spec)
        self.disable = set(disable)
        self.allow = None if allow is None else set(allow)
        self.discovered: list[Discovered] = []
        self._kind_of: dict[str, PluginKind] = {}
        self._remove_listener = fallback.add_listener(self._on_fallback)
        if load_entry_points:
            for kind in GROUPS:
                self._load_group(kind)
        self.pm.check_pending()

    def close(self) -> None:
        """Stop forwarding fallbacks to this host's plugins."""
        self._remove_listener()

    # ---- discovery -----------------------------------------------------------------------
    def _load_group(self, kind: PluginKind) -> None:
        for ep in sorted(entry_points(group=GROUPS[kind]), key=lambda e: e.name):
            dist, version = _dist(ep)
            if ep.name in self.disable or (self.allow is not None and ep.name not in self.allow):
                self.discovered.append(Discovered(ep.name, kind, ep.value, dist, version,
                                                  "disabled by settings (plugins.disable/allow)",
                                                  FallbackReason.PLUGIN_DISABLED))
                continue
            try:
                module = ep.load()
                self.register(module, ep.name, kind, ep.value, dist, version)
            except Exception as exc:  # incl. pluggy's PluginValidationError (bad hookimpl)
                log.warning("cpkv.plugin.load_failed", group=GROUPS[kind], name=ep.name,
                            entry_point=ep.value, error=repr(exc))
                self.discovered.append(Discovered(ep.name, kind, ep.value, dist, version,
                                                  f"failed to load: {exc!r}",
                                                  FallbackReason.PLUGIN_LOAD_FAILED))

    def register(
        self,
        plugin: object,
        name: str,
        kind: PluginKind = PluginKind.BACKEND,
        entry_point: str = "",
        distribution: str = "?",
        version: str = "?",
    ) -> None:
        """Register a plugin module or object (what discovery does for each entry point)."""
        if self.pm.get_plugin(name) is not None:
            raise ValueError(f"a plugin named {name!r} is already registered")
        self.pm.register(plugin, name=name)
        try:
            # per plugin, so that one plugin with an unknown hook (a typo) is rejected alone
            # instead of making the final check_pending() fail the whole host
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            self.pm.unregister(name=name)
            raise
        self._kind_of[name] = kind
        self.discovered.append(Discovered(name, kind, entry_point or repr(plugin),
                                          distribution, version))

    # ---- typed hook facade -----------------------------------------------------------------
    def _collect(
        self, kind: PluginKind, hook_name: str, registrar_cls: type[_Registrar[_SpecT]]
    ) -> tuple[list[tuple[str, _SpecT]], dict[str, tuple[FallbackReason, str]]]:
        """(plugin name, spec) of every spec the ``hook_name`` impls registered, and the plugins
        that cannot be used (their hook raised, or discovery failed / disabled them)."""
        specs: list[tuple[str, _SpecT]] = []
        unusable: dict[str, tuple[FallbackReason, str]] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            registrar = registrar_cls(plugin=impl.plugin_name)
            # an impl may take fewer arguments than its spec: pass only those it names
            kwargs = {"registrar": registrar} if "registrar" in impl.argnames else {}
            try:
                impl.function(**kwargs)
            except Exception as exc:
                log.warning("cpkv.plugin.register_failed", plugin=impl.plugin_name,
                            hook=hook_name, error=repr(exc))
                unusable[impl.plugin_name] = (FallbackReason.PLUGIN_LOAD_FAILED,
                                              f"{hook_name} raised {exc!r}")
                continue
            specs.extend((impl.plugin_name, s) for s in registrar.specs)
        for d in self.discovered:
            if d.kind is kind and d.reason is not None:
                unusable[d.name] = (d.reason, d.error or "")
        return specs, unusable

    def backends(self) -> BackendRegistry:
        """Registry of every discovered compute backend."""
        specs, unusable = self._collect(PluginKind.BACKEND, "cpkv_register_backends",
                                        BackendRegistrar)
        reg = BackendRegistry(PluginKind.BACKEND, [s for _, s in specs], unusable)
        _set_origins(reg.origin, specs)
        return reg

    def transfers(self) -> TransferRegistry:
        """Registry of every discovered transfer plugin (loading an ``object``: the disagg layer
        checks it against its ``Transport`` Protocol)."""
        specs, unusable = self._collect(PluginKind.TRANSFER, "cpkv_register_transfers",
                                        TransferRegistrar)
        reg = TransferRegistry(PluginKind.TRANSFER, [s for _, s in specs], unusable)
        _set_origins(reg.origin, specs)
        return reg

    def _on_fallback(self, event: FallbackEvent) -> None:
        self.pm.hook.cpkv_on_fallback(event=event)

    # ---- listing -----------------------------------------------------------------------------
    def infos(self) -> list[PluginInfo]:
        """Every discovered plugin with its distribution, version and availability."""
        regs: dict[PluginKind, BackendRegistry | TransferRegistry] = {
            PluginKind.BACKEND: self.backends(), PluginKind.TRANSFER: self.transfers()}
        out: list[PluginInfo] = []
        for d in self.discovered:
            reg = regs[d.kind]
            specs: list[BackendSpec | TransferSpec] = [
                s for s in reg.specs.values() if reg.origin.get(s.name) == d.name]
            if d.reason is not None or not specs:
                why = d.error or (reg.unusable.get(d.name, (None, "registered nothing"))[1])
                out.append(PluginInfo(name=d.name, kind=d.kind, distribution=d.distribution,
                                      version=d.version, entry_point=d.entry_point,
                                      availability=Availability.no(why)))
                continue
            for s in specs:
                ops = tuple(sorted(o.value for o in s.ops)) if isinstance(s, BackendSpec) else ()
                out.append(PluginInfo(name=s.name, kind=d.kind, distribution=d.distribution,
                                      version=d.version, entry_point=d.entry_point, ops=ops,
                                      availability=reg.availability(s.name),
                                      description=s.description))
        return out


def _set_origins(origin: dict[str, str],
                 specs: Iterable[tuple[str, BackendSpec | TransferSpec]]) -> None:
    """Record which plugin registered each spec; the first registration wins, as in
    :class:`Registry` (duplicates)."""
    for plugin, s in specs:
        origin.setdefault(s.name, plugin)
