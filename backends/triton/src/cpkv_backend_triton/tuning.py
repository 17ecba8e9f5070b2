"""The Triton kernels' launch constants: one table, a row per (launch, device) naming the
measurement behind its values, and a default row per launch; :func:`tuned` takes the most
specific matching row, ``TRITON_CPKV_TUNING="LAUNCH.FIELD=VALUE[,...]"`` overrides fields.
Design: docs/triton.md, "Tuning tables".
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Generic, TypeVar

import torch

__all__ = ["TABLE", "TUNING_ENV", "DeviceKey", "DeviceTuned", "IndexerParams",
           "IndexerTopkParams", "Launch", "MLAParams", "Row", "TopkLongParams", "TopkParams",
           "cache_clear", "device_of", "overrides", "row", "tuned"]


#: the environment variable of :func:`overrides` (not ``CPKV_*``: the settings refuse a
#: ``CPKV_*`` variable that names no settings key)
TUNING_ENV = "TRITON_CPKV_TUNING"


class Launch(StrEnum):
    """The tuned launches (not cpkv's ops: one op may take several, one launch serve two ops)."""

    #: ``indexer_logits`` (row tiles and the few-rows kernel) and ``indexer_logits_paged``
    INDEXER = "indexer"
    #: ``sparse_mla`` on fp32 inputs or with ``mla_precision="exact"``
    SPARSE_MLA = "sparse_mla"
    #: ``sparse_mla`` on 16-bit inputs with ``mla_precision="bf16"`` (the default)
    SPARSE_MLA_LOWP = "sparse_mla_lowp"
    #: ``topk``'s two-read path (rows shorter than ``TopkLongParams.MIN_T``)
    TOPK = "topk"
    #: ``topk``'s one-read path for long rows
    TOPK_LONG = "topk_long"
    #: ``indexer_topk``'s fused path (the indexer's epilogue filters: the logits never stored)
    INDEXER_TOPK = "indexer_topk"


@dataclass(frozen=True)
class DeviceKey:
    """Which devices a row is for: ``name`` a substring of the device's name ("" any),
    ``capability`` its compute capability (None any). ``DeviceKey()`` is the default row."""

    name: str = ""
    capability: tuple[int, int] | None = None

    def rank(self, name: str, capability: tuple[int, int] | None) -> int | None:
        """How specifically this key matches a device (higher: more), None: it does not."""
        if self.name and self.name not in name:
            return None
        if self.capability is not None and self.capability != capability:
            return None
        return 2 * bool(self.name) + bool(self.capability is not None)


class _Params:
    def as_dict(self) -> dict[str, int]:
        """The values by field name, as the kernels' launches read them."""
        return asdict(self)  # type: ignore[call-overload, no-any-return]


@dataclass(frozen=True)
class IndexerParams(_Params):
    """``indexer_logits``: BLOCK_M rows x BLOCK_N keys a program; at most FEW_ROWS rows take
    the few-rows kernel (FEW_BLOCK_N keys, few_warps). ``indexer_logits_paged``: PAGED_KERNEL
    0 the key-tile kernel (PAGED_BLOCK_N keys x PAGED_ROWS rows a program), 1 the page-tile
    kernel (PAGED_PAGES pages a program, the page loop PAGED_STAGES deep, PAGED_KEYS_M 1:
    keys @ q^T); PAGED_MAJOR_* replace PAGED_PAGES / PAGED_STAGES on page-major index-K."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    FEW_ROWS: int
    FEW_BLOCK_N: int
    few_warps: int
    PAGED_BLOCK_N: int
    PAGED_ROWS: int
    paged_warps: int
    PAGED_KERNEL: int
    PAGED_PAGES: int
    PAGED_STAGES: int
    PAGED_KEYS_M: int
    PAGED_MAJOR_PAGES: int
    PAGED_MAJOR_STAGES: int


@dataclass(frozen=True)
class MLAParams(_Params):
    """``sparse_mla``: BLOCK_H heads x BLOCK_K gathered keys a step; the probabilities as
    P_SPLIT pieces (P_FP16: fp16 pieces, P_CAT: one concatenated dot)."""

    BLOCK_H: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    P_SPLIT: int
    P_FP16: int
    P_CAT: int


@dataclass(frozen=True)
class TopkParams(_Params):
    """``topk``'s two-read path: BLOCK columns a step, CHUNK columns a program, num_warps of the
    streaming kernels, final_warps of the final kernel, BINS of the value histogram."""

    BLOCK: int
    CHUNK: int
    num_warps: int
    final_warps: int
    BINS: int


@dataclass(frozen=True)
class TopkLongParams(_Params):
    """``topk``'s one-read path, rows of at least MIN_T columns: SAMPLE columns place the
    floor (FLOOR_ROUNDS radix rounds); at most CAP candidates a split of at least SPLIT_MIN
    columns, PROGRAMS (row, split) programs wanted, the scratch within an eighth of the logits
    or SCRATCH_MB; BLOCK columns a filter step (GLUON 1: the Gluon filter); REFINE candidates a
    select step (COMPACT 1: the last two rounds over the k-th key's 16-bit bin). At most
    FEW_ROWS rows: the few_* values (0: the many-row value)."""

    MIN_T: int
    SAMPLE: int
    CAP: int
    BLOCK: int
    PROGRAMS: int
    SPLIT_MIN: int
    SCRATCH_MB: int
    REFINE: int
    GLUON: int
    num_warps: int
    select_warps: int
    FEW_ROWS: int
    few_floor_warps: int
    few_select_warps: int
    few_BLOCK: int
    FLOOR_ROUNDS: int
    COMPACT: int


@dataclass(frozen=True)
class IndexerTopkParams(_Params):
    """``indexer_topk``'s fused path, views of at least MIN_T keys: SAMPLE columns place the
    floor (floor_warps, FLOOR_ROUNDS); a row's CAP SAFETY x the floor's average candidates, a
    power of two in [CAP_MIN, CAP_MAX]; the filter's tiles (the plain indexer's) bounded to
    MAXNREG registers; the select's SELECT_BLOCK and select_warps (COMPACT as the long top-k's);
    the exact pass's EXACT_BLOCK_N and exact_warps."""

    MIN_T: int
    SAMPLE: int
    SAFETY: int
    CAP_MIN: int
    CAP_MAX: int
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    MAXNREG: int
    SELECT_BLOCK: int
    select_warps: int
    EXACT_BLOCK_N: int
    exact_warps: int
    floor_warps: int
    FLOOR_ROUNDS: int
    COMPACT: int


P = TypeVar("P", IndexerParams, MLAParams, TopkParams, TopkLongParams, IndexerTopkParams)


@dataclass(frozen=True)
class Row(Generic[P]):
    """One launch's constants on the devices ``device`` names, and what measured them."""

    op: Launch
    device: DeviceKey
    params: P
    #: the measurement behind the values (a docs/ section)
    source: str


#: measured on sm90 GPUs only: every launch has just its default row
_INDEXER = IndexerParams(
    BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, FEW_ROWS=8, FEW_BLOCK_N=128, few_warps=4,
    PAGED_BLOCK_N=128, PAGED_ROWS=1, paged_warps=4, PAGED_KERNEL=1, PAGED_PAGES=8, PAGED_STAGES=1,
    PAGED_KEYS_M=1, PAGED_MAJOR_PAGES=16, PAGED_MAJOR_STAGES=3)
_MLA = MLAParams(BLOCK_H=64, BLOCK_K=32, num_warps=8, num_stages=2, P_SPLIT=2, P_FP16=1, P_CAT=1)
_MLA_LOWP = MLAParams(BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2, P_SPLIT=1, P_FP16=0,
                      P_CAT=0)
_TOPK = TopkParams(BLOCK=512, CHUNK=8192, num_warps=4, final_warps=4, BINS=64)
_TOPK_LONG = TopkLongParams(MIN_T=196608, SAMPLE=4096, CAP=16384, BLOCK=1024, PROGRAMS=8192,
                            SPLIT_MIN=32768, SCRATCH_MB=64, REFINE=1024, GLUON=1, num_warps=4,
                            select_warps=4, FEW_ROWS=128, few_floor_warps=8, few_select_warps=8,
                            few_BLOCK=2048, COMPACT=1, FLOOR_ROUNDS=3)
_INDEXER_TOPK = IndexerTopkParams(
    MIN_T=196608, SAMPLE=4096, SAFETY=2, CAP_MIN=1024, CAP_MAX=16384, BLOCK_M=64, BLOCK_N=128,
    num_warps=4, num_stages=3, MAXNREG=168, SELECT_BLOCK=1024, select_warps=8,
    EXACT_BLOCK_N=128, exact_warps=4, floor_warps=4, FLOOR_ROUNDS=3, COMPACT=1)


#: a row of any launch
AnyRow = (Row[IndexerParams] | Row[MLAParams] | Row[TopkParams] | Row[TopkLongParams]
          | Row[IndexerTopkParams])
#: every row; each launch has exactly one default row (``DeviceKey()``)
TABLE: tuple[AnyRow, ...] = (
    Row(Launch.INDEXER, DeviceKey(), _INDEXER, "docs/triton.md: indexer"),
    Row(Launch.SPARSE_MLA, DeviceKey(), _MLA, "docs/triton.md: sparse MLA"),
    Row(Launch.SPARSE_MLA_LOWP, DeviceKey(), _MLA_LOWP, "docs/triton.md: sparse MLA"),
    Row(Launch.TOPK, DeviceKey(), _TOPK, "docs/triton.md: top-k, shorter rows"),
    Row(Launch.TOPK_LONG, DeviceKey(), _TOPK_LONG, "docs/triton.md: top-k, long rows"),
    Row(Launch.INDEXER_TOPK, DeviceKey(), _INDEXER_TOPK, "docs/triton.md: the fused indexer top-k"))


def device_of(device: torch.device | None = None) -> tuple[str, tuple[int, int] | None]:
    """The (name, capability) a lookup matches: of ``device`` when it is a CUDA device, else of
    this process's current CUDA device; ``("", None)`` without one (the CPU interpreter)."""
    if device is not None and device.type != "cuda":
        return "", None
    if not torch.cuda.is_available():
        return "", None
    idx = device.index if device is not None and device.index is not None else (
        torch.cuda.current_device())
    return _cuda_device(idx)


@functools.cache
def _cuda_device(idx: int) -> tuple[str, tuple[int, int] | None]:
    major, minor = torch.cuda.get_device_capability(idx)
    return torch.cuda.get_device_name(idx), (major, minor)


def row(op: Launch, name: str = "", capability: tuple[int, int] | None = None) -> AnyRow:
    """The most specific row of ``op`` for a device of ``name`` and ``capability``."""
    best = None
    for r in TABLE:
        if r.op is op and (k := r.device.rank(name, capability)) is not None and (
                best is None or k > best[0]):
            best = (k, r)
    assert best is not None, f"no default row for {op}"  # tests/test_triton_tuning.py
    return best[1]


def tuned(op: Launch, device: torch.device | None = None) -> Mapping[str, int]:
    """The launch constants of ``op`` on ``device`` (None: the current CUDA device, if any), read
    only (copy it to change values: ``{**tuned(op), "BLOCK": 64}``)."""
    return _tuned(op, *device_of(device))


@functools.cache
def _tuned(op: Launch, name: str, capability: tuple[int, int] | None) -> Mapping[str, int]:
    values = row(op, name, capability).params.as_dict()
    values.update(_env_overrides().get(op, {}))
    return MappingProxyType(values)


def overrides(spec: str) -> dict[Launch, dict[str, int]]:
    """``LAUNCH.FIELD=VALUE,...`` (LAUNCH a :class:`Launch` member's name, FIELD one of its
    params' fields, VALUE an integer) as values by launch.

    Raises:
        ValueError: an item is not ``LAUNCH.FIELD=VALUE``, or names no launch or field.
    """
    out: dict[Launch, dict[str, int]] = {}
    for item in filter(None, (i.strip() for i in spec.split(","))):
        key, eq, value = item.partition("=")
        op_name, dot, field = key.strip().partition(".")
        if not (eq and dot):
            raise ValueError(f"{TUNING_ENV}: {item!r} is not LAUNCH.FIELD=VALUE")
        if op_name not in Launch.__members__:
            raise ValueError(f"{TUNING_ENV}: no launch {op_name!r} (one of {', '.join(Launch.__members__)})")
        op = Launch[op_name]
        fields = row(op).params.as_dict()
        if field not in fields:
            raise ValueError(f"{TUNING_ENV}: {op_name} has no field {field!r} (one of "
                             f"{', '.join(fields)})")
        try:
            out.setdefault(op, {})[field] = int(value)
        except ValueError:
            raise ValueError(f"{TUNING_ENV}: {item!r}: the value is not an integer") from None
    return out


@functools.cache
def _env_overrides() -> dict[Launch, dict[str, int]]:
    spec = os.environ.get(TUNING_ENV, "")
    values = overrides(spec)
    if values:  # values in force: said once a process, never silent
        logging.getLogger("cpkv.tuning").warning("cpkv.tuning.overridden %s=%s", TUNING_ENV, spec)
    return values


def cache_clear() -> None:
    """Forget the cached lookups and the environment's overrides (after :data:`TABLE` or
    :data:`TUNING_ENV` changed)."""
    _tuned.cache_clear()
    _env_overrides.cache_clear()


class DeviceTuned(Mapping[str, int]):
    """The constants of ``op`` on this process's current device, looked up at each read (the
    name a module keeps for them, e.g. ``topk.TOPK_CONFIG``: reading it first at a launch, not
    at import, keeps the import from initializing CUDA)."""

    def __init__(self, op: Launch) -> None:
        self.op = op

    def _now(self) -> Mapping[str, int]:
        return tuned(self.op)

    def __getitem__(self, key: str) -> int:
        return self._now()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())

    def __repr__(self) -> str:
        return f"DeviceTuned({self.op.value}: {self._now()})"
