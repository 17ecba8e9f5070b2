"""The Triton kernels' launch constants, one table for every op: a row per (op, device) with the
measurement its values come from, and a default row per op for devices no row names.

A row's device is a substring of the CUDA device's name (``"H200"`` in ``"NVIDIA H200"``)
and/or its compute capability; a lookup takes the most specific row that matches (name and
capability, then name, then capability, then the default). The values are typed per op
(:class:`IndexerParams`, ...: the kernels' constexpr and launch names as fields);
``as_dict()`` is what a launch reads. Rows are looked up on the device a launch runs on
(:func:`tuned`: once per device, cached): the CPU interpreter and a device that no row names take
the default row.

To tune a new device: run the op's sweep (``benchmarks/indexer_paged_sweep_gpu.py``,
``benchmarks/topk_long_gpu.py``, ``cpkv bench gpu``) there, add a row with its values and the
result it came from, and keep the default row conservative (today it repeats the H200's: no
other device was measured). To try values before they are a row, set
``TRITON_CPKV_TUNING="OP.FIELD=VALUE[,OP.FIELD=VALUE...]"`` (e.g. ``TOPK_LONG.GLUON=1``): every
device's lookup of OP takes them, in this process and the processes it starts (a whole
``cpkv bench long`` run); a name that is not an op or field is an error.
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
           "IndexerTopkParams", "MLAParams", "Op",
           "Row", "TopkLongParams", "TopkParams", "cache_clear", "device_of", "overrides", "row",
           "tuned"]

#: the environment variable of :func:`overrides` (not ``CPKV_*``: the settings refuse a
#: ``CPKV_*`` variable that names no settings key)
TUNING_ENV = "TRITON_CPKV_TUNING"


class Op(StrEnum):
    """The tuned launches."""

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
    """``indexer_logits``: BLOCK_M query rows x BLOCK_N keys a program, num_warps,
    num_stages; at most FEW_ROWS rows take the few-rows kernel (FEW_BLOCK_N keys a program,
    few_warps). ``indexer_logits_paged``: PAGED_KERNEL 0, the key-tile kernel: PAGED_BLOCK_N keys
    a program (each key's page looked up in the block table), PAGED_ROWS query rows a program;
    PAGED_KERNEL 1, the page-tile kernel (also ``indexer_logits_index_pages``, which always
    takes it): PAGED_PAGES whole pages a program, one query row, the page loop PAGED_STAGES
    deep, PAGED_KEYS_M 1: keys @ q^T (0: q @ keys^T), PAGED_PRECISE k > 0: fp8 dots' partial
    sums promoted into fp32 every k of the reduction (0: Triton's default); PAGED_MAJOR_PAGES
    and PAGED_MAJOR_STAGES replace PAGED_PAGES and PAGED_STAGES on DeepGEMM's page-major index-K
    (``indexer_logits_index_pages``); paged_warps warps either way. ASYNC 1: fp8 x fp8 prefill
    calls take the Gluon kernel that overlaps each head's wgmma with the previous head's sum
    (:mod:`cpkv_backend_triton.indexer_async`: ASYNC_BLOCK_M rows (64 a warpgroup) x
    ASYNC_BLOCK_N keys a program, ASYNC_STAGES query tiles in flight, ASYNC_GROUP heads a
    pipelined group); 0: the Triton kernel. ABS_PARTS k > 0: fp8 x fp8 row tiles (the plain
    kernel and the fused indexer + top-k filter) sum ``relu`` as ``(s + |s|) / 2``, the signed
    half k fp8 dots of the rows' weighted query sum (:mod:`.indexer_tile`); 0: ``w * relu(s)``."""

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
    """``sparse_mla``: BLOCK_H heads x BLOCK_K gathered keys a step, num_warps, num_stages;
    the probabilities as P_SPLIT pieces (P_FP16: fp16 pieces, P_CAT: one concatenated dot;
    docs/triton.md)."""

    BLOCK_H: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    P_SPLIT: int
    P_FP16: int
    P_CAT: int


@dataclass(frozen=True)
class TopkParams(_Params):
    """``topk``'s two-read path: BLOCK columns a step, CHUNK columns of a row a program (the
    histogram and compaction kernels), num_warps of the streaming kernels, final_warps of the
    final kernel, BINS of the value histogram (a power of two)."""

    BLOCK: int
    CHUNK: int
    num_warps: int
    final_warps: int
    BINS: int


@dataclass(frozen=True)
class TopkLongParams(_Params):
    """``topk``'s one-read path: rows of at least MIN_T columns; SAMPLE columns place the
    floor; at most CAP candidates a split (more: the exact kernel); BLOCK columns a step of the
    filter; PROGRAMS: a call of few rows splits them into enough (row, split) programs to fill
    the GPU (splits of at least SPLIT_MIN columns; their candidates' scratch within an eighth of
    the logits' bytes or SCRATCH_MB); REFINE candidates a refinement step; HELD: a row whose
    splits each hold at most HELD / splits candidates is refined from registers, all loaded
    once (0: always the loop over memory); GLUON 1: the filter of
    :mod:`.topk_filter_gluon` (fp32 logits of column stride 1 on a GPU; the Triton filter
    otherwise, reported); num_warps of the floor and the filter, select_warps of the select
    kernel. A call of at most FEW_ROWS rows (a decode step's: fewer programs a kernel than SMs,
    each one's latency is the kernel's) launches the floor with few_floor_warps and the select
    with few_select_warps, splits rows into splits of at least few_SPLIT_MIN columns holding
    at most few_CAP candidates each and filters them few_BLOCK columns a step (0: the many-row
    value). FLOOR_ROUNDS: the floor's radix rounds (4: the sample key at the floor's place;
    fewer: that key with its low bits cleared, a floor up to 2^(9 - 8 ROUNDS) relatively lower,
    the same result). COMPACT 1: the select's last two radix rounds over only the keys
    matching the first two rounds' 16 bits, copied into the row's output slots first (0: all
    four rounds over every candidate). PREFETCH 1: the Gluon filter issues each block's load
    before the previous block's scan (two blocks a program in flight; the Triton filter has no
    such variant)."""

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
    FEW_ROWS: int = 0
    few_floor_warps: int = 0
    few_select_warps: int = 0
    few_SPLIT_MIN: int = 0
    few_CAP: int = 0
    few_BLOCK: int = 0
    FLOOR_ROUNDS: int = 4
    COMPACT: int = 0


@dataclass(frozen=True)
class IndexerTopkParams(_Params):
    """``indexer_topk``'s fused path (:mod:`.indexer_topk`): views of at least MIN_T keys take
    it; SAMPLE columns place the floor; a row's CAP the power of two at least SAFETY x the
    candidates the floor keeps on average, within [CAP_MIN, CAP_MAX]; the filter's BLOCK_M x
    BLOCK_N tiles, num_warps, num_stages (the plain indexer's) and register bound MAXNREG; the
    select's SELECT_BLOCK candidates a step and select_warps; the exact pass's EXACT_BLOCK_N
    keys a step and exact_warps; floor_warps of the sample's floor, FLOOR_ROUNDS its radix
    rounds (4: the sample key at the floor's place; fewer: that key with its low bits cleared,
    a floor up to 2^(9 - 8 ROUNDS) relatively lower, the same result); COMPACT 1: the
    select's last two radix rounds over the keys of the K-th key's 16-bit bin only (copied into
    the row's output first; 0: four rounds over every candidate)."""

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
    COMPACT: int = 0


P = TypeVar("P", IndexerParams, MLAParams, TopkParams, TopkLongParams, IndexerTopkParams)


@dataclass(frozen=True)
class Row(Generic[P]):
    """One op's launch constants on the devices ``device`` names, and what measured them."""

    op: Op
    device: DeviceKey
    params: P
    #: the measurement behind the values: a docs/perf.md or docs/triton.md row, a results file
    source: str


_H200 = DeviceKey("H200", (9, 0))
_NONE_ELSE = "no other device measured: the H200's values ({})"

_INDEXER_H200 = IndexerParams(
    BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, FEW_ROWS=8, FEW_BLOCK_N=128, few_warps=4,
    PAGED_BLOCK_N=128, PAGED_ROWS=1, paged_warps=4, PAGED_KERNEL=1, PAGED_PAGES=8, PAGED_STAGES=1,
    PAGED_KEYS_M=1, PAGED_MAJOR_PAGES=16, PAGED_MAJOR_STAGES=3)
_INDEXER_SRC = (
    "docs/perf.md Kernels, indexer_logits_32k_speedup: num_warps 4 598 vs 497 TFLOP/s at 1024 x "
    "32K x 64 x 128; the few-rows kernel at 64K fp8 keys x 64 heads: 1-4 rows ~2x the row-tile "
    "kernel, 8 rows 1.28x, 16 rows 0.72x (docs/triton.md); the paged launch the best of BLOCK_N "
    "64-512, 4/8 warps, 1/2 rows at 64 x 128K fp8 keys (1.02 ms a layer: "
    "benchmarks/results/indexer_paged_sweep_h200.json, docs/perf.md Decode steps); the page-tile "
    "kernel (PAGED_KERNEL 1) swept at 64 x 128K fp8 keys on the pool's part-major pages "
    "(benchmarks/results/indexer_paged_pages_sweep_64x128k_h200.json): PAGED_PAGES 8, "
    "PAGED_STAGES 1, PAGED_KEYS_M 1 0.351 ms (3111 GB/s; key-tile kernel 0.638, DeepGEMM 0.333 on "
    "page-major pages; the page-major order PAGED_PAGES 16, PAGED_STAGES 3 0.286 ms = 1.15x "
    "DeepGEMM), benchmarks/results/session13/paged_sweep_64x128k_h200.json: PAGED_PRECISE 32 "
    "(fp8 partial sums promoted every wgmma) 0.454 ms, 4.5e-5 of the largest logit from the fp32 "
    "reference against 2.0e-4 without (DeepGEMM's and the key-tile kernel's 2.0e-4 too): off, "
    "the field's numerics at its speed (docs/perf.md Decode steps)")
_MLA_H200 = MLAParams(BLOCK_H=64, BLOCK_K=32, num_warps=8, num_stages=2, P_SPLIT=2, P_FP16=1,
                      P_CAT=1)
_MLA_SRC = ("docs/triton.md sparse_mla: P_SPLIT 2 in fp16, one concatenated dot (conformant; "
            "two chained dots spill in Triton 3.9's sm_90 code)")
_MLA_LOWP_H200 = MLAParams(BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2, P_SPLIT=1,
                           P_FP16=0, P_CAT=0)
_MLA_LOWP_SRC = ("docs/triton.md sparse_mla: one bf16 P (FlashMLA's precision) 229 vs 42 "
                 "TFLOP/s on the H200; docs/perf.md Kernels")
_TOPK_H200 = TopkParams(BLOCK=512, CHUNK=8192, num_warps=4, final_warps=4, BINS=64)
_TOPK_SRC = ("docs/perf.md Long prompts / docs/triton.md topk, 1024 x 64K on the H200: 64 bins "
             "as fast as 32 and 12 % faster than 128; 512-column blocks, 8K-column chunks and 4 "
             "warps the best of a sweep")
_TOPK_LONG_H200 = TopkLongParams(MIN_T=196608, SAMPLE=4096, CAP=16384, BLOCK=1024, PROGRAMS=8192,
                                 SPLIT_MIN=32768, SCRATCH_MB=64, REFINE=1024,
                                 GLUON=1, num_warps=4, select_warps=4,
                                 FEW_ROWS=128, few_floor_warps=8, few_select_warps=8,
                                 few_BLOCK=2048, COMPACT=1, FLOOR_ROUNDS=3)
_TOPK_LONG_SRC = (
    "benchmarks/results/topk_long_h200.jsonl (docs/triton.md topk): MIN_T at 1024 rows one read "
    "0.84 ms at 64K columns (two reads 0.49), 1.07 at 128K (0.92), 2.16 at 512K (11.75); "
    "SCRATCH_MB: 8 splits of a decode step's one 256K row (docs/perf.md Decode steps, 32 splits "
    "moved the cost into the select kernel); PROGRAMS 8192: two splits a row at 4096 rows x 480K "
    "(one split: 1.94 waves of programs), the filter 4.50 vs 4.71 ms on an H100, level at 1024 "
    "rows and a decode step (benchmarks/results/session15/topk_sweep_h100.json); GLUON 1: the "
    "Gluon filter bit-equal to the Triton one and 1.56x faster at 4096 x 480K (2.85 vs 4.43 ms), "
    "1.47x at 1024 x 480K, 1.42x a decode step's (benchmarks/results/session16/"
    "topk_sweep_h100.json, session16_gpu.sh); FEW_ROWS 128 (fewer programs than SMs): at 64 rows "
    "x 128K an H100's floor 24 -> 14 us at 8 warps (15 at 16, 19 at 32), the select 42 -> 35 at "
    "8 (40 at 16), the op 0.105 ms; more splits (few_SPLIT_MIN 8K / 4K, few_CAP 2K) and HELD "
    "4K / 8K made the select 1.1-5x slower: 0 (benchmarks/results/session18/"
    "topk_decode_sweep_h100.json, topk_decode_sweep_gpu.py); at 64 rows x 128K on an H100 "
    "(benchmarks/results/session21/call1/h100/topk_decode_flat.json, topk_decode_select_gpu.py): "
    "few_BLOCK 2048 the filter 32.3 -> 24.3 us (4096: 25.2), COMPACT 1 the select 62.4 -> 52.7 "
    "(measured on the flat select, since reverted), FLOOR_ROUNDS 2 the floor 14.9 -> 9.8 but "
    "the select +12 (more candidates); on the per-split select (session21/call2/"
    "topk_decode_select.json): the op 0.088 ms with session 20's launches, 0.075 with the "
    "table, 0.073 with FLOOR_ROUNDS 3 (the floor 15 -> 12 us, the select level): 3")

_INDEXER_TOPK_H200 = IndexerTopkParams(
    MIN_T=196608, SAMPLE=4096, SAFETY=2, CAP_MIN=1024, CAP_MAX=16384, BLOCK_M=64, BLOCK_N=128,
    num_warps=4, num_stages=3, MAXNREG=168, SELECT_BLOCK=1024, select_warps=8,
    EXACT_BLOCK_N=128, exact_warps=4, floor_warps=4, FLOOR_ROUNDS=3, COMPACT=1)
_INDEXER_TOPK_SRC = (
    "the filter's tiles, warps and stages the plain indexer's (Op.INDEXER); MAXNREG 168: 3 CTAs "
    "of 128 threads an SM as the plain kernel (Triton 3.9 gives the filter 176 registers "
    "unbounded: tests/test_triton_indexer_topk_codegen.py); SAMPLE the long-row top-k's; MIN_T "
    "196608 (the long-row top-k's): on an H100 the fused path 1.07-1.08x the plain path (Triton "
    "indexer + Gluon-filter top-k) at 1024 x 512K, 4096 x 256K, 8192 x 512K with the same "
    "output, its filter 0.95-1.07x the plain indexer kernel; cpkv bench long at 512K: "
    "long_512k_topk_share 0.132 -> 0.056, long_512k_fp8_mfu 0.488 -> 0.510 "
    "(benchmarks/results/session17/indexer_topk_h100.json, long_512k_fused_h100.json, "
    "benchmarks/session17_fused_gpu.sh); select_warps 8: the select 1.92 ms against 2.38 at 4 "
    "warps at 8192 x 512K, the best of 2/4/8 warps x 512/1024/2048 candidates a step "
    "(benchmarks/results/session17/select_sweep_h100.json), long_512k_topk_share 0.0564 -> "
    "0.0504 (benchmarks/results/session17/long_select8_h100.json); floor_warps 4: the floor "
    "11.5 ms a 512K prompt on the H200 against 14.1 at 8 warps and 13.9 at 16 "
    "(benchmarks/results/session17/long_floor8_h200.json, rows_long_h200.json); FLOOR_ROUNDS 3: "
    "the floor kernel 0.526 ms against 0.657 at 4 rounds at 8192 x 512K on an H100, the output "
    "equal (benchmarks/results/session18/fused_select_sweep_h100.json); COMPACT 1: the select "
    "1.78 ms against 1.91-1.95 at 8192 x 512K and 0.73 against 0.75-0.77 at 4096 x 256K on an "
    "H100, the op level within its noise, outputs equal (benchmarks/results/session21/call2/"
    "fused_compact_ab.json)")

#: every row; each op has exactly one default row (``DeviceKey()``)
TABLE: tuple[Row[IndexerParams] | Row[MLAParams] | Row[TopkParams] | Row[TopkLongParams]
             | Row[IndexerTopkParams], ...] = (
    Row(Op.INDEXER, _H200, _INDEXER_H200, _INDEXER_SRC),
    Row(Op.INDEXER, DeviceKey(), _INDEXER_H200, _NONE_ELSE.format(_INDEXER_SRC)),
    Row(Op.SPARSE_MLA, _H200, _MLA_H200, _MLA_SRC),
    Row(Op.SPARSE_MLA, DeviceKey(), _MLA_H200, _NONE_ELSE.format(_MLA_SRC)),
    Row(Op.SPARSE_MLA_LOWP, _H200, _MLA_LOWP_H200, _MLA_LOWP_SRC),
    Row(Op.SPARSE_MLA_LOWP, DeviceKey(), _MLA_LOWP_H200, _NONE_ELSE.format(_MLA_LOWP_SRC)),
    Row(Op.TOPK, _H200, _TOPK_H200, _TOPK_SRC),
    Row(Op.TOPK, DeviceKey(), _TOPK_H200, _NONE_ELSE.format(_TOPK_SRC)),
    Row(Op.TOPK_LONG, _H200, _TOPK_LONG_H200, _TOPK_LONG_SRC),
    Row(Op.TOPK_LONG, DeviceKey(), _TOPK_LONG_H200, _NONE_ELSE.format(_TOPK_LONG_SRC)),
    Row(Op.INDEXER_TOPK, _H200, _INDEXER_TOPK_H200, _INDEXER_TOPK_SRC),
    Row(Op.INDEXER_TOPK, DeviceKey(), _INDEXER_TOPK_H200,
        _NONE_ELSE.format(_INDEXER_TOPK_SRC)),
)


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


def row(op: Op, name: str = "", capability: tuple[int, int] | None = None
        ) -> (Row[IndexerParams] | Row[MLAParams] | Row[TopkParams] | Row[TopkLongParams]
              | Row[IndexerTopkParams]):
    """The most specific row of ``op`` for a device of ``name`` and ``capability``."""
    best = None
    for r in TABLE:
        if r.op is op and (k := r.device.rank(name, capability)) is not None and (
                best is None or k > best[0]):
            best = (k, r)
    assert best is not None, f"no default row for {op}"  # tests/test_triton_tuning.py
    return best[1]


def tuned(op: Op, device: torch.device | None = None) -> Mapping[str, int]:
    """The launch constants of ``op`` on ``device`` (None: the current CUDA device, if any), read
    only (copy it to change values: ``{**tuned(op), "BLOCK": 64}``)."""
    return _tuned(op, *device_of(device))


@functools.cache
def _tuned(op: Op, name: str, capability: tuple[int, int] | None) -> Mapping[str, int]:
    values = row(op, name, capability).params.as_dict()
    values.update(_env_overrides().get(op, {}))
    return MappingProxyType(values)


def overrides(spec: str) -> dict[Op, dict[str, int]]:
    """``OP.FIELD=VALUE,...`` (OP an :class:`Op` member's name, FIELD one of its params' fields,
    VALUE an integer) as values by op.

    Raises:
        ValueError: an item is not ``OP.FIELD=VALUE``, or names no op or field.
    """
    out: dict[Op, dict[str, int]] = {}
    for item in filter(None, (i.strip() for i in spec.split(","))):
        key, eq, value = item.partition("=")
        op_name, dot, field = key.strip().partition(".")
        if not (eq and dot):
            raise ValueError(f"{TUNING_ENV}: {item!r} is not OP.FIELD=VALUE")
        if op_name not in Op.__members__:
            raise ValueError(f"{TUNING_ENV}: no op {op_name!r} (one of {', '.join(Op.__members__)})")
        op = Op[op_name]
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
def _env_overrides() -> dict[Op, dict[str, int]]:
    spec = os.environ.get(TUNING_ENV, "")
    values = overrides(spec)
    if values:  # a tuning session's values in force: said once a process, never silent
        logging.getLogger("cpkv.tuning").warning("cpkv.tuning.overridden %s=%s", TUNING_ENV, spec)
    return values


def cache_clear() -> None:
    """Forget the cached lookups and the environment's overrides (after :data:`TABLE` or
    :data:`TUNING_ENV` changed: tests, a tuning session)."""
    _tuned.cache_clear()
    _env_overrides.cache_clear()


class DeviceTuned(Mapping[str, int]):
    """The constants of ``op`` on this process's current device, looked up at each read (the
    name a module keeps for them, e.g. ``topk.TOPK_CONFIG``: reading it first at a launch, not
    at import, keeps the import from initializing CUDA)."""

    def __init__(self, op: Op) -> None:
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
