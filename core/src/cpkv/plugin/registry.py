"""Backend and transfer specs, the registrars hooks fill, and selection with preference order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeAlias, TypeVar, cast

from cpkv.contracts import Availability, FallbackReason, KVOps, Op, PluginKind
from cpkv.fallback import report_fallback
from cpkv.logs import get_logger

__all__ = [
    "AgreeFn",
    "BackendRegistrar",
    "BackendRegistry",
    "BackendSpec",
    "Registry",
    "Selection",
    "TransferRegistrar",
    "TransferRegistry",
    "TransferSpec",
]

log = get_logger(__name__)

#: combines this rank's availability with every other rank's (all ranks must get the same answer)
AgreeFn = Callable[[dict[str, bool]], dict[str, bool]]


@dataclass(frozen=True)
class BackendSpec:
    """A compute backend. ``probe`` decides availability without importing kernels; ``load``
    returns the backend object, a :class:`~cpkv.contracts.KVOps`: it has one callable attribute
    per op in ``ops``, and only those are ever called (a backend of a few ops returns its object
    as ``typing.cast(KVOps, obj)`` to satisfy a type checker)."""

    name: str
    ops: frozenset[Op]
    probe: Callable[[], Availability]
    load: Callable[[], KVOps]
    description: str = ""
    #: page sizes its kernels support; None = any
    page_sizes: frozenset[int] | None = None
    #: the device types (``torch.device.type``) its kernels run on, asked at selection time;
    #: None = any. A run whose tensors live elsewhere does not select it
    device_types: Callable[[], frozenset[str]] | None = None


@dataclass(frozen=True)
class TransferSpec:
    """A KV transfer plugin (prefill ranks -> decode). ``load`` returns its transport factory.

    Typed ``object`` here: its Protocol (``cpkv.disagg.transport.Transport``) belongs to a layer
    above this one, which checks what ``load`` returned (``isinstance``) before using it.
    """

    name: str
    probe: Callable[[], Availability]
    load: Callable[[], object]
    description: str = ""


#: the spec type of a registry (a registrar, a selection); the registrars admit exactly these two
SpecT = TypeVar("SpecT", BackendSpec, TransferSpec)
#: what a spec's ``load`` returns: ``KVOps`` for backends, ``object`` for transfers
ImplT = TypeVar("ImplT")


@dataclass
class _Registrar(Generic[SpecT]):
    plugin: str
    specs: list[SpecT] = field(default_factory=list)

    def add(self, spec: SpecT) -> None:
        self.specs.append(spec)


class BackendRegistrar(_Registrar[BackendSpec]):
    """Handed to ``cpkv_register_backends``; collects :class:`BackendSpec`."""

    def add(self, spec: BackendSpec) -> None:
        if not isinstance(spec, BackendSpec):
            raise TypeError(f"plugin {self.plugin!r} registered {spec!r}, expected a BackendSpec")
        super().add(spec)


class TransferRegistrar(_Registrar[TransferSpec]):
    """Handed to ``cpkv_register_transfers``; collects :class:`TransferSpec`."""

    def add(self, spec: TransferSpec) -> None:
        if not isinstance(spec, TransferSpec):
            raise TypeError(f"plugin {self.plugin!r} registered {spec!r}, expected a TransferSpec")
        super().add(spec)


@dataclass(frozen=True)
class Selection(Generic[ImplT]):
    """What the registry chose for one op: the spec's name and the loaded plugin object."""

    op: str
    name: str
    impl: ImplT
    #: the usable plugins after it in the preference that provide the op too, in order: where
    #: a call goes when ``impl`` declines it (:class:`~cpkv.contracts.OpDeclined`)
    then: tuple[tuple[str, ImplT], ...] = ()
    #: why each plugin before it in the preference was passed over (its reason text)
    skipped: tuple[str, ...] = ()


class Registry(Generic[SpecT, ImplT]):
    """Specs of one kind, with cached probes and loads: :data:`BackendRegistry` (specs
    :class:`BackendSpec`, loading :class:`~cpkv.contracts.KVOps`) or :data:`TransferRegistry`
    (specs :class:`TransferSpec`, loading ``object``): construct through those aliases.

    ``unusable`` maps names that were discovered but cannot be used (load failed, disabled) to
    (reason, detail); they are never probed.
    """

    def __init__(
        self,
        kind: PluginKind,
        specs: Iterable[SpecT],
        unusable: Mapping[str, tuple[FallbackReason, str]] | None = None,
    ) -> None:
        self.kind = kind
        self.specs: dict[str, SpecT] = {}
        for s in specs:
            if s.name in self.specs:
                log.warning("cpkv.plugin.duplicate", kind=kind.value, name=s.name)
                continue
            self.specs[s.name] = s
        self.unusable = dict(unusable or {})
        #: spec name -> name of the plugin (entry point) that registered it
        self.origin: dict[str, str] = {}
        self._avail: dict[str, Availability] = {}
        self._loaded: dict[str, ImplT] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self.specs)

    def availability(self, name: str) -> Availability:
        """Probe ``name`` once per registry; a probe that raises counts as unavailable."""
        if name in self.unusable:
            reason, detail = self.unusable[name]
            return Availability.no(f"{reason.value}: {detail}")
        if name not in self.specs:
            return Availability.no(f"no {self.kind.value} plugin named {name!r} was discovered")
        with self._lock:
            if name not in self._avail:
                try:
                    self._avail[name] = self.specs[name].probe()
                except Exception as exc:
                    self._avail[name] = Availability.no(f"probe raised {exc!r}")
            return self._avail[name]

    def load(self, name: str) -> ImplT:
        """Load (once) and return the plugin object of an available plugin."""
        with self._lock:
            if name not in self._loaded:
                # the aliases pair each spec type with what its load returns
                self._loaded[name] = cast(ImplT, self.specs[name].load())
            return self._loaded[name]

    def _why_not(self, name: str, op: str | None,
                 device_type: str | None = None) -> tuple[FallbackReason, str] | None:
        if name in self.unusable:
            reason, detail = self.unusable[name]
            return reason, f"{name}: {detail}"  # name it, like the other reasons
        if name not in self.specs:
            return FallbackReason.PLUGIN_NOT_FOUND, f"{name}: not discovered"
        av = self.availability(name)
        if not av.available:
            return FallbackReason.PLUGIN_UNAVAILABLE, f"{name}: {av.reason}"
        if op is not None and op not in _ops_of(self.specs[name]):
            return FallbackReason.OP_NOT_PROVIDED, f"{name}: does not provide {op}"
        spec = self.specs[name]
        if device_type is not None and isinstance(spec, BackendSpec) and spec.device_types:
            types = spec.device_types()
            if device_type not in types:
                return FallbackReason.PLUGIN_UNAVAILABLE, (
                    f"{name}: runs on {', '.join(sorted(types))}, this run's tensors are on "
                    f"{device_type}")
        return None

    def select(
        self,
        preference: Sequence[str],
        ops: Sequence[str] | None = None,
        agree: AgreeFn | None = None,
        device_type: str | None = None,
        quiet: bool = False,
    ) -> dict[str, Selection[ImplT]]:
        """Choose one plugin per op (or one plugin overall when ``ops`` is None).

        Walks ``preference`` in order; every step away from its first entry is reported through
        the fallback choke point, one event per (selected plugin, reason) with the ops listed.
        ``agree`` combines availability across ranks so that all ranks choose alike.
        ``device_type`` (the run's tensors' ``torch.device.type``) skips backends whose kernels
        run elsewhere (a GPU backend for a CPU run on a GPU machine). ``quiet`` (the preference
        is the default order, ``backend.name = "auto"``): a plugin that cannot run on this machine
        or does not provide an op is passed over at info level (``cpkv.backend.skipped``, and in
        ``Selection.skipped``), not as a fallback; one unavailable on another rank still is.

        Raises:
            LookupError: no plugin in ``preference`` can serve an op.
        """
        if not preference:
            raise ValueError(f"empty {self.kind.value} preference list")
        local = {n: self._why_not(n, None, device_type) is None for n in preference}
        usable = agree(dict(local)) if agree else local
        wanted: list[str | None] = list(ops) if ops is not None else [None]
        chosen: dict[str, Selection[ImplT]] = {}
        steps: dict[tuple[str, FallbackReason], list[str]] = {}
        details: dict[tuple[str, FallbackReason], list[str]] = {}
        for op in wanted:
            skipped: list[tuple[FallbackReason, str]] = []
            for name in preference:
                why = self._why_not(name, op, device_type)
                if why is None and not usable.get(name, False):
                    why = (FallbackReason.PLUGIN_UNAVAILABLE, f"{name}: unavailable on another rank")
                if why is None:
                    key = op or self.kind.value
                    rest = preference[preference.index(name) + 1:]
                    then = tuple((n, self.load(n)) for n in rest if op is not None
                                 and self._why_not(n, op, device_type) is None
                                 and usable.get(n, False))
                    chosen[key] = Selection(op=key, name=name, impl=self.load(name), then=then,
                                            skipped=tuple(d for _, d in skipped))
                    if quiet:
                        skipped = [w for w in skipped if w[1].endswith("unavailable on another rank")]
                    if skipped:
                        k = (name, skipped[0][0])
                        steps.setdefault(k, []).append(key)
                        for _, d in skipped:
                            if d not in details.setdefault(k, []):
                                details[k].append(d)
                    break
                skipped.append(why)
            else:
                raise LookupError(
                    f"no {self.kind.value} can run {op or 'at all'}: "
                    + "; ".join(d for _, d in skipped)
                )
        for (name, reason), keys in steps.items():
            report_fallback(
                op=f"{self.kind.value}_select",
                requested=preference[0],
                selected=name,
                reason=reason,
                detail=f"for {', '.join(keys)}; " + "; ".join(details[(name, reason)]),
            )
        for sel in chosen.values():
            log.debug("cpkv.backend.selected", kind=self.kind.value, op=sel.op, name=sel.name)
        if quiet:
            passed = sorted({d for sel in chosen.values() for d in sel.skipped})
            if passed:
                log.info("cpkv.backend.skipped", kind=self.kind.value, reasons=passed)
        return chosen


def _ops_of(spec: BackendSpec | TransferSpec) -> frozenset[Op]:
    """The ops a spec provides (a transfer provides none)."""
    return spec.ops if isinstance(spec, BackendSpec) else frozenset()


#: the registry of compute backends (:meth:`cpkv.plugin.PluginHost.backends`)
BackendRegistry: TypeAlias = Registry[BackendSpec, KVOps]
#: the registry of transfer plugins (:meth:`cpkv.plugin.PluginHost.transfers`); the disagg layer
#: checks the loaded object against its ``Transport`` Protocol
TransferRegistry: TypeAlias = Registry[TransferSpec, object]
