"""The per-run table that binds each op to a backend (the core's side of the ops).

Backends implement any subset of :class:`~cpkv.contracts.KVOps` (one attribute per
:class:`~cpkv.contracts.Op`); the registry picks, per op, the first backend in the preference
order that provides it and is available on every rank; a call that backend declines
(:class:`~cpkv.contracts.OpDeclined`: a shape its kernel does not take) runs on the next one.
The core calls ops only through an :class:`OpTable`, never by importing a backend.
Ops never sync the host and never allocate per-call host tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cpkv.contracts import FallbackReason, KVOps, Op, OpDeclined
from cpkv.fallback import report_fallback
from cpkv.plugin import AgreeFn, BackendRegistry

if TYPE_CHECKING:
    # for type checkers the table IS a KVOps (each op typed as the Protocol says, and an op the
    # Protocol does not declare is an error: __getattr__ below exists at runtime only); at
    # runtime it is a plain object whose __getattr__ hands out the bound callable chosen per op
    _OpsBase = KVOps
else:
    _OpsBase = object

__all__ = ["ALL_OPS", "ATTN_OPS", "DSA_OPS", "KV_OPS", "V4_OPS", "OpTable"]

#: the ops the sharded pool and the CP runtime need
KV_OPS: tuple[Op, ...] = (Op.PAGE_GATHER, Op.PAGE_SCATTER, Op.PAGE_COPY, Op.RERANGE, Op.FP8_PACK,
                          Op.FP8_UNPACK, Op.PEER_GATHER, Op.PAGE_ROWS, Op.FP8_STORE)
#: the sparse-attention ops of one layer
ATTN_OPS: tuple[Op, ...] = (Op.INDEXER_LOGITS, Op.INDEXER_LOGITS_PAGED,
                            Op.INDEXER_LOGITS_INDEX_PAGES, Op.TOPK, Op.INDEXER_TOPK,
                            Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED, Op.ROPE,
                            Op.INDEX_Q_FP8, Op.RMS_NORM)
#: the ops of a DeepSeek-V3.2 / GLM-5 run (sparse MLA over the sharded page pool)
DSA_OPS: tuple[Op, ...] = KV_OPS + ATTN_OPS
#: DeepSeek-V4's compressed-attention ops (its CP prefill resolves these alone)
V4_OPS: tuple[Op, ...] = (Op.V4_COMPRESS, Op.V4_INDEX_SCORES, Op.V4_TOPK, Op.V4_INDEX_TOPK,
                          Op.V4_ATTENTION)
#: every op
ALL_OPS: tuple[Op, ...] = DSA_OPS + V4_OPS


class _Declinable:
    """One op's backends in preference order: the first that does not raise
    :class:`~cpkv.contracts.OpDeclined` runs the call. Each (backend, reason) is reported once,
    as fallback ``op_declined``."""

    def __init__(self, op: str, impls: list[tuple[str, Callable[..., Any]]]) -> None:
        self.op, self.impls = op, impls
        self._seen: set[tuple[str, str]] = set()

    @property
    def __self__(self) -> object:
        """Like a bound method's: the chosen backend's object (reports and tests look at it)."""
        return getattr(self.impls[0][1], "__self__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        last = len(self.impls) - 1
        for i, (name, fn) in enumerate(self.impls):
            try:
                return fn(*args, **kwargs)
            except OpDeclined as exc:
                if i == last:
                    raise RuntimeError(f"{self.op}: every backend declined the call; {name}: "
                                       f"{exc}") from exc
                if (name, str(exc)) not in self._seen:
                    self._seen.add((name, str(exc)))
                    report_fallback(op=self.op, requested=name, selected=self.impls[i + 1][0],
                                    reason=FallbackReason.OP_DECLINED, detail=f"{name}: {exc}")
        raise AssertionError("unreachable")


class OpTable(_OpsBase):
    """Op -> bound callable of the backend chosen for it. Resolved once per run (at plan time).

    Attribute access (``table.rerange(...)``) calls the chosen backend; ``table.chosen`` maps each
    op name to the backend name, for reports. Type checkers see a :class:`KVOps`: a call of an op
    the Protocol does not declare is a type error. At runtime only the ops it was resolved for are
    there (another raises AttributeError naming the resolved ones): code that can run without an
    op asks :meth:`has` first (``ops.rope if ops.has(Op.ROPE) else None``).
    """

    def __init__(self, impls: dict[str, Callable[..., Any]], chosen: dict[str, str]) -> None:
        self._impls = impls
        self.chosen = dict(chosen)
        #: why backends of the preference were passed over (for reports)
        self.skipped: list[str] = []

    @classmethod
    def resolve(cls, registry: BackendRegistry, preference: Sequence[str],
                ops: Sequence[Op] = KV_OPS, agree: AgreeFn | None = None,
                device_type: str | None = None, quiet: bool = False) -> OpTable:
        """Pick a backend per op (fallbacks reported by the registry), bind the callables.

        Raises:
            LookupError: no backend in ``preference`` provides an op.
        """
        sel = registry.select(preference, [o.value for o in ops], agree=agree,
                              device_type=device_type, quiet=quiet)
        # a call the chosen backend declines goes down the preference
        impls: dict[str, Callable[..., Any]] = {
            k: _Declinable(k, [(s.name, getattr(s.impl, k)),
                               *((n, getattr(i, k)) for n, i in s.then)])
            for k, s in sel.items()}
        table = cls(impls, {k: s.name for k, s in sel.items()})
        table.skipped = sorted({d for s in sel.values() for d in s.skipped})
        return table

    def has(self, op: Op) -> bool:
        """Whether the table was resolved for ``op`` (an optional op: its attribute exists)."""
        return op.value in self._impls

    if not TYPE_CHECKING:  # type checkers see KVOps' methods only, so a missing op is an error

        def __getattr__(self, name: str) -> Callable[..., Any]:
            impls: dict[str, Callable[..., Any]] = self.__dict__.get("_impls", {})
            try:
                return impls[name]
            except KeyError:
                raise AttributeError(f"no backend was selected for op {name!r}; resolved ops: "
                                     f"{sorted(impls)}") from None
