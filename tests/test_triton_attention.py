"""The Triton sparse-attention kernels (cpkv_backend_triton.attention) against the torch reference
through the conformance suite.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here before
triton is imported), at the suite's small sizes only (the interpreter is slow). The interpreter
computes every ``tl.dot`` on fp32 operands (its 16-bit dot is wrong in Triton 3.x; exact for
bf16/e4m3 inputs), so the 16-bit tensor-core path, fp8 keys through the real conversion, the
out-of-resource fallback and realistic sizes are covered only by the ``gpu`` tests. With CUDA
present the kernels are compiled for the GPU and the interpreter tests skip.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpkv.testing.conformance as conf
from cpkv.contracts import KVDtype, KVFormat, Op, OpDeclined
from cpkv.ops.api import quantize_fp8
from triton_interp import bin_values, import_kernels, interp

topk_mod = import_kernels("cpkv_backend_triton.topk", "_topk_filter_kernel")
attention = import_kernels("cpkv_backend_triton.attention", "_indexer_kernel")
AttentionKernels = attention.AttentionKernels


pytestmark = pytest.mark.usefixtures("triton_interpreter")


#: a subset of the suite's sizes that the interpreter runs in seconds (0 rows, empty view, tiny,
#: short ranges, k = 2048 with every row shorter than k)
SMALL_SIZES = ((0, 0, 8), (0, 50, 8), (1, 1, 8), (3, 5, 8), (17, 40, 64), (5, 700, 2048))
#: the fp8 indexer's end-to-end top-k cases at interpreter sizes (row ranges longer than k)
SMALL_FP8_TOPK_SIZES = ((17, 40, 8), (24, 200, 16), (5, 300, 64))
NEG_INF = float("-inf")


@pytest.fixture
def small_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conf, "ATTN_SIZES", SMALL_SIZES)
    monkeypatch.setattr(conf, "FP8_TOPK_SIZES", SMALL_FP8_TOPK_SIZES)


def test_ops_declared() -> None:
    from cpkv_backend_triton.plugin import OPS

    attn = frozenset({Op.INDEXER_LOGITS, Op.INDEXER_LOGITS_PAGED, Op.TOPK, Op.INDEXER_TOPK,
                      Op.SPARSE_MLA})
    assert attn <= OPS
    for op in attn:
        assert callable(getattr(AttentionKernels(), op.value))


# ---- interpreter (CPU) ------------------------------------------------------------------------
@interp
@pytest.mark.usefixtures("small_sizes")
@pytest.mark.parametrize("op", ["indexer_logits", "indexer_logits_paged",
                                "indexer_logits_index_pages",
                                pytest.param("topk", marks=pytest.mark.slow),
                                pytest.param("indexer_topk", marks=pytest.mark.slow),
                                pytest.param("sparse_mla", marks=pytest.mark.slow),
                                pytest.param("v4_index_topk", marks=pytest.mark.slow)])
def test_conformance_interpreter(ref: Any, op: str) -> None:
    conf.check_op(AttentionKernels(), ref, op, device="cpu")


@pytest.mark.slow  # 4 s in the interpreter
@interp
def test_indexer_paged_small_tiles_and_row_groups(ref: Any) -> None:
    """Keys tiles smaller than a page and groups of 3 rows per program (a group's rows of
    different requests, the last group partly past N)."""
    impl = AttentionKernels(indexer_config={"PAGED_BLOCK_N": 16, "PAGED_ROWS": 3})
    conf.check_op(impl, ref, "indexer_logits_paged", device="cpu")


def _paged_inputs(fmt: KVFormat, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q = torch.randn(2, 4, fmt.index_head_dim, dtype=torch.bfloat16)
    return (q, torch.ones(2, 4), pool, fmt, torch.zeros(1, 2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32), torch.full((2,), 3, dtype=torch.int64))


@interp
def test_indexer_paged_declines_offsets_its_views_cannot_address() -> None:
    """fp8 scales are read through a float32 view of the pool: an index_head_dim that leaves
    them off 4-byte boundaries, or a pool view at an odd byte offset, is declined (the torch op
    then runs), before any output is allocated."""
    odd = KVFormat(dtype=KVDtype.FP8, kv_lora_rank=64, rope_dim=16, index_head_dim=30,
                        quant_block=32, page_size=16)
    pool = torch.zeros(2, odd.page_size, odd.bytes_per_token, dtype=torch.uint8)
    with pytest.raises(OpDeclined, match="multiples of 4"):
        AttentionKernels().indexer_logits_paged(*_paged_inputs(odd, pool))
    fmt = conf.FORMATS["small"]
    flat = torch.zeros(2 * fmt.page_bytes + 1, dtype=torch.uint8)
    shifted = flat[1:].view(2, fmt.page_size, fmt.bytes_per_token)
    with pytest.raises(OpDeclined, match="storage offset 1"):
        AttentionKernels().indexer_logits_paged(*_paged_inputs(fmt, shifted))


def _same_choice(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor,
                 key_start: torch.Tensor, key_end: torch.Tensor, k: int) -> bool:
    """The reference's exact set in every row (ties by column, as the reference breaks them),
    and rows holding at most k keys exactly as the reference lists them (ascending)."""
    t = logits.shape[1]
    short = ((key_end.clamp(0, t) - key_start.clamp(0, t)) <= k).to(got.device)
    return bool(torch.equal(got.sort(1).values, want.sort(1).values)
                and torch.equal(got[short], want[short]))


class _ExactTopk:
    """The kernels with a topk that must choose the reference's set exactly (the conformance
    suite's own comparison accepts any tie order; the radix kernel breaks ties as the
    reference). The suite itself checks short rows' order."""

    def __init__(self, impl: Any, ref: Any) -> None:
        self.impl, self.ref = impl, ref

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        got = self.impl.topk(logits, k, key_start, key_end)
        want = self.ref.topk(logits, k, key_start, key_end)
        assert _same_choice(got, want, logits, key_start, key_end, k), \
            f"topk differs from the reference: k={k}, {logits.shape}"
        return got


def _small_topk_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many chunks per row and few candidates: every kernel path at interpreter sizes."""
    monkeypatch.setattr(topk_mod, "TOPK_CONFIG", {**topk_mod.TOPK_CONFIG, "BLOCK": 16,
                                                  "CHUNK": 48, "BINS": 8})
    monkeypatch.setattr(topk_mod, "TOPK_SAMPLE", 16)
    monkeypatch.setattr(topk_mod, "TOPK_MIN_CAP", 16)


def _long_topk_config(monkeypatch: pytest.MonkeyPatch, sample: int = 16, cap: int = 32,
                      programs: int = 64, block: int = 16) -> None:
    """The long-row path (floor, filter, select) for every row length, several splits a row,
    few candidates: its flagged rows (a split over CAP, fewer than k candidates) reach the exact
    kernel at interpreter sizes."""
    monkeypatch.setattr(topk_mod, "TOPK_LONG", {**topk_mod.TOPK_LONG, "MIN_T": 1,
                                                "SAMPLE": sample, "CAP": cap, "BLOCK": block,
                                                "PROGRAMS": programs, "SPLIT_MIN": 32,
                                                "REFINE": 16})


def _topk_config(monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    if config == "small":
        _small_topk_config(monkeypatch)
    elif config == "long":
        _long_topk_config(monkeypatch)
    elif config == "long_few":  # every call a decode step's: the few-row splits and caps
        _long_topk_config(monkeypatch)
        monkeypatch.setattr(topk_mod, "TOPK_LONG", {
            **topk_mod.TOPK_LONG, "FEW_ROWS": 1 << 20, "few_floor_warps": 2,
            "few_select_warps": 2, "few_BLOCK": 32,
            "FLOOR_ROUNDS": 2, "COMPACT": 1})


@interp
@pytest.mark.usefixtures("small_sizes")
@pytest.mark.parametrize("config", [pytest.param("default", marks=pytest.mark.slow),
                                    pytest.param("small", marks=pytest.mark.slow),  # 8 CPU s
                                    "long", "long_few"])
def test_topk_conformance_exact(ref: Any, monkeypatch: pytest.MonkeyPatch,
                                config: str) -> None:
    """The suite's top-k inputs (indexer logits with relu ties, coarse-grid ties, finite logits
    outside the ranges), compared for exact equality."""
    _topk_config(monkeypatch, config)
    conf.check_op(_ExactTopk(AttentionKernels(), ref), ref, "topk", device="cpu")


def _topk_case(g: torch.Generator, n: int, t: int, kind: str) -> torch.Tensor:
    x = torch.randn(n, t, generator=g) * 3
    if kind == "ties":
        x = x.round()  # a few values: ties at the k-th place
    elif kind == "neg_inf":
        x = torch.where(torch.rand(n, t, generator=g) < 0.4, NEG_INF, x.round())
    elif kind == "equal":
        x = torch.full((n, t), 0.5)
    elif kind == "zeros":  # -0.0 and 0.0 are equal logits
        x = torch.where(torch.rand(n, t, generator=g) < 0.5, -0.0, 0.0)
        x[:, ::7] = 1.0
    return x


def _edge_cases() -> list[Any]:
    """(kind, config) of :func:`test_topk_exact_edge_cases`: randn, ties and -inf on the small-tile
    exact kernel; on the long-row path the two that stress its floor and filter (ties at the k-th
    place, -inf inside ranges); the rest slow (5-6 CPU seconds each; CI runs them)."""
    fast = {("small", k) for k in ("randn", "ties", "neg_inf")}
    fast |= {("long", "ties"), ("long", "neg_inf")}
    return [pytest.param(kind, config, marks=() if (config, kind) in fast else pytest.mark.slow,
                         id=f"{config}-{kind}")
            for config in ("default", "small", "long")
            for kind in ("randn", "ties", "neg_inf", "equal", "zeros")]


@interp
@pytest.mark.parametrize(("kind", "config"), _edge_cases())
def test_topk_exact_edge_cases(ref: Any, monkeypatch: pytest.MonkeyPatch, kind: str,
                               config: str) -> None:
    """Exact equality with the reference: ranges empty, shorter / longer than k, clipped, not
    starting at 0 (-inf inside a range ranks before the masked columns), k not a power of two,
    k of 1, T < k, N = 0, bf16 logits, a strided view."""
    _topk_config(monkeypatch, config)
    impl = AttentionKernels()
    g = torch.Generator().manual_seed(7)
    n, t = 9, 150
    x = _topk_case(g, n, t, kind)
    ks = torch.tensor([0, 0, 5, 30, -3, 100, 0, 149, 10])
    ke = torch.tensor([150, 80, 5, 140, 200, 90, 3, 150, 137])
    cases = [(x, k) for k in (1, 24, 150, 200)] + [(x.bfloat16(), 17), (x.t().contiguous().t(), 64)]
    for logits, k in cases:
        got = impl.topk(logits, k, ks, ke)
        assert _same_choice(got, ref.topk(logits, k, ks, ke), logits, ks, ke, k), (k, logits.dtype)
    r = torch.zeros(0, dtype=torch.int64)
    assert impl.topk(torch.zeros(0, t), 5, r, r).shape == (0, 5)


@interp
@pytest.mark.parametrize("compact", [0, 1])
@pytest.mark.parametrize("kind", ["ties", "neg_inf", "randn"])
def test_topk_select_with_or_without_compaction(ref: Any, monkeypatch: pytest.MonkeyPatch,
                                                compact: int, kind: str) -> None:
    """The long path's select with its last two rounds over every candidate or
    (``COMPACT``) over the keys copied out after two rounds: the reference's sets, ties by
    ascending column, flagged rows still exact."""
    _long_topk_config(monkeypatch)
    monkeypatch.setattr(topk_mod, "TOPK_LONG", {**topk_mod.TOPK_LONG, "COMPACT": compact})
    g = torch.Generator().manual_seed(5)
    n, t = 9, 150
    x = _topk_case(g, n, t, kind)
    ks = torch.tensor([0, 0, 5, 30, -3, 100, 0, 149, 10])
    ke = torch.tensor([150, 80, 5, 140, 200, 90, 3, 150, 137])
    for k in (1, 24, 64):
        got = AttentionKernels().topk(x, k, ks, ke)
        assert _same_choice(got, ref.topk(x, k, ks, ke), x, ks, ke, k), (compact, kind, k)


def _split_candidates(g: torch.Generator, n: int, ns: int, cap: int, kind: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates as the filter leaves them: per (row, split) up to ``cap`` int64
    ``key << 32 | (2^31 - 1 - column)`` in column order (splits of 100 columns), some splits
    empty; ``kind`` one of :func:`triton_interp.bin_values`' (the k-th key's bin copied when
    "spread" or "mixed", more keys than the slots when "clustered")."""
    cand = torch.zeros(n * ns * cap, dtype=torch.int64)
    count = torch.zeros(n, ns, dtype=torch.int32)
    for r in range(n):
        for j in range(ns):
            c = 0 if (r + j) % 4 == 3 else int(torch.randint(1, cap + 1, (1,), generator=g))
            cols = (j * 100 + torch.randperm(100, generator=g)[:c].sort().values).to(torch.int64)
            key = _ord_keys(bin_values(kind, c, g)).to(torch.int64)
            cand[(r * ns + j) * cap:(r * ns + j) * cap + c] = (key << 32) | (2147483647 - cols)
            count[r, j] = c
    return cand, count


@interp
@pytest.mark.parametrize("compact", [0, 1])
@pytest.mark.parametrize("kind", ["spread", "mixed", "clustered"])
def test_topk_select_over_split_candidates(monkeypatch: pytest.MonkeyPatch, compact: int,
                                           kind: str) -> None:
    """The long path's select (``select_candidates``) over candidates in splits, some empty:
    each row's k largest keys, ties by ascending column, with its last two radix rounds over
    every candidate or (``COMPACT``) over the keys copied out after two: the 16-bit bin of the
    k-th key small ("spread", "mixed": copied) or larger than the row's slots ("clustered":
    the rounds over every candidate)."""
    monkeypatch.setattr(topk_mod, "TOPK_LONG", {**topk_mod.TOPK_LONG, "COMPACT": compact,
                                                "REFINE": 16})
    g = torch.Generator().manual_seed(17)
    n, ns, cap, t = 5, 6, 24, 600
    cand, count = _split_candidates(g, n, ns, cap, kind)
    for k in (8, 40):
        ks, ke = torch.zeros(n, dtype=torch.int64), torch.full((n,), t, dtype=torch.int64)
        out = torch.full((n, k), -2, dtype=torch.int32)
        meta = torch.zeros(n, 2, dtype=torch.int32)
        topk_mod.select_candidates(cand, count, ks, ke, out, meta, t, k, cap, 2)
        for r in range(n):
            rows = [cand[(r * ns + j) * cap:(r * ns + j) * cap + int(count[r, j])]
                    for j in range(ns)]
            c = torch.cat(rows)
            if c.numel() < k:
                assert int(meta[r, 0]) == -1
                continue
            want = sorted(c.tolist(), reverse=True)[:k]  # key desc, then column asc
            assert int(meta[r, 0]) == k
            assert sorted(out[r].tolist()) == sorted(2147483647 - (w & 0xFFFFFFFF)
                                                     for w in want), (kind, compact, k, r)


def _ord_keys(v: torch.Tensor) -> torch.Tensor:
    b = v.view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@interp
@pytest.mark.parametrize("rounds", [4, 3, 2])
def test_topk_floor_is_the_sample_key_at_its_place(rounds: int) -> None:
    """The long path's floor (a radix select over the sample's keys) is the key a descending
    sort of the sample has at ``est + margin`` (-inf when the sample has no such place), with
    ties, -0.0 and -inf in the rows; with fewer radix rounds that key with its low
    ``32 - 8 rounds`` order bits cleared (never above it): the floor only changes how many
    candidates a row has, so no equality test of the top-k would see it go wrong."""
    sample, k, t = 64, 40, 900
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, t, generator=g)
    x[1] = x[1].round()  # ties
    x[2, ::3] = float("-inf")
    x[3] = torch.where(x[3] > 0, -0.0, x[3])
    ks = torch.tensor([0, 0, 100, 0, 5, 0])
    ke = torch.tensor([t, 850, t, 700, 5 + 3 * k, t // 2])  # row 4: est + margin past the sample
    floor = torch.empty(6)
    topk_mod._topk_floor_kernel[(6,)](x, ks, ke, floor, t, k, x.stride(0), x.stride(1),
                                      SAMPLE=sample, ROUNDS=rounds)
    for r in range(6):
        cnt = int(ke[r] - ks[r])
        cols = int(ks[r]) + (torch.arange(sample) * cnt) // sample
        keys = torch.where(x[r, cols] == 0, 0.0, x[r, cols]).sort(descending=True).values
        est = k * sample // cnt
        place = est + int(4.0 * float(torch.tensor(est + 1.0).sqrt())) + 8
        want = float(keys[place]) if place < sample else float("-inf")
        if place < sample and rounds < 4:  # the key's low order bits cleared
            s = _ord_keys(keys[place].reshape(1)) & -(1 << (32 - 8 * rounds))
            want = float((s ^ ((s >> 31) & 0x7FFFFFFF)).view(torch.float32))
            assert want <= float(keys[place])
        assert float(floor[r]) == want, (r, float(floor[r]), want)
        assert not (floor[r] == 0 and torch.signbit(floor[r]))  # -0.0 folded into 0.0


@interp
def test_topk_long_rows_flagged_to_the_exact_kernel(ref: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Long-row path, rows whose sample misleads the floor: row 0's sampled columns hold its
    largest keys (the floor lands above its k-th key: fewer than k candidates), row 1 is one
    value (every key a candidate, one split: over CAP), row 2 ordinary (its ~400 candidates
    over this CAP too). All equal the reference (without the exact kernel none would)."""
    sample, n, t, k = 64, 3, 1000, 100
    _long_topk_config(monkeypatch, sample=sample, cap=128, programs=1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, t, generator=g)
    x[0, (torch.arange(sample) * t) // sample] = 10.0
    x[1] = 0.25
    ks, ke = torch.zeros(n, dtype=torch.int64), torch.full((n,), t)
    got = AttentionKernels().topk(x, k, ks, ke)
    assert _same_choice(got, ref.topk(x, k, ks, ke), x, ks, ke, k)


@interp
@pytest.mark.parametrize("kind", ["ties", "randn"])
def test_topk_filter_splits_off_block_boundaries(ref: Any, monkeypatch: pytest.MonkeyPatch,
                                                 kind: str) -> None:
    """The filter's blocks of 64 columns over splits of 64: rows starting and ending off the
    blocks' boundaries (the first and last blocks masked), a strided view: the reference's
    sets."""
    _long_topk_config(monkeypatch, cap=64, block=64)
    g = torch.Generator().manual_seed(11)
    n, t = 6, 333
    x = _topk_case(g, n, t, kind)
    ks = torch.tensor([0, 3, 17, 40, 70, 129])
    ke = torch.tensor([333, 300, 250, 333, 201, 330])
    for logits in (x, x.t().contiguous().t()):
        for k in (5, 24, 64):
            got = AttentionKernels().topk(logits, k, ks, ke)
            assert _same_choice(got, ref.topk(logits, k, ks, ke), logits, ks, ke, k), (kind, k)


@interp
@settings(deadline=None, max_examples=25)
@given(st.data(), st.sampled_from(["default", "long"]))
def test_topk_exact_property(ref: Any, data: st.DataObject, config: str) -> None:
    """Random small shapes and ranges, logits from a few values (-inf, -0.0, 0.0 among them) or
    continuous: the kernel equals the reference."""
    n, t, k = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 70)), data.draw(
        st.integers(0, 40))
    ks = torch.tensor([data.draw(st.integers(-3, t + 2)) for _ in range(n)], dtype=torch.int64)
    ke = torch.tensor([data.draw(st.integers(-3, t + 3)) for _ in range(n)], dtype=torch.int64)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    if data.draw(st.booleans()):
        vals = torch.tensor([NEG_INF, -1.5, -0.0, 0.0, 0.5, 2.0])
        x = vals[torch.randint(0, 6, (n, t), generator=g)]
    else:
        x = torch.randn(n, t, generator=g)
    with pytest.MonkeyPatch.context() as mp:
        _topk_config(mp, config)
        got = AttentionKernels().topk(x, k, ks, ke)
    assert _same_choice(got, ref.topk(x, k, ks, ke), x, ks, ke, k)


@interp
def test_topk_gluon_filter_declines_visibly_on_the_interpreter(ref: Any,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """``GLUON = 1`` where the Gluon filter cannot run (the interpreter's CPU tensors): the
    Triton filter gives the reference's sets and the decline is reported once, with its reason,
    however many calls."""
    from cpkv.contracts import FallbackReason
    from cpkv.fallback import recording

    _long_topk_config(monkeypatch)
    monkeypatch.setattr(topk_mod, "TOPK_LONG", {**topk_mod.TOPK_LONG, "GLUON": 1})
    monkeypatch.setattr(topk_mod, "_GLUON_DECLINED", set())
    g = torch.Generator().manual_seed(13)
    x = _topk_case(g, 5, 150, "ties")
    ks = torch.tensor([0, 3, 17, 40, 0])
    ke = torch.tensor([150, 120, 150, 141, 90])
    with recording() as rec:
        for _ in range(2):
            got = AttentionKernels().topk(x, 24, ks, ke)
            assert _same_choice(got, ref.topk(x, 24, ks, ke), x, ks, ke, 24)
    events = [e for e in rec.events if e.op == "triton:topk"]
    assert len(events) == 1, events
    assert events[0].reason is FallbackReason.KERNEL_VARIANT
    assert "CUDA" in events[0].detail and events[0].selected == "the Triton filter"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["randn", "ties"])
def test_topk_gluon_filter_equals_the_triton_filter_gpu(monkeypatch: pytest.MonkeyPatch,
                                                        kind: str) -> None:
    """``GLUON = 1`` on a GPU: the same output as the Triton filter, bit
    for bit (the same candidates in the same column order), over long rows starting off the
    16-column boundaries, ending inside a block, several splits a row; nothing reported."""
    from cpkv.fallback import recording

    g = torch.Generator(device="cuda").manual_seed(3)
    n, t = 96, 300_000
    x = torch.randn(n, t, device="cuda", generator=g)
    if kind == "ties":
        x = (x * 4).round()  # few values: ties at the k-th place, flagged rows
    ks = torch.randint(0, 5000, (n,), device="cuda", generator=g)
    ke = torch.randint(t - 20000, t + 1, (n,), device="cuda", generator=g)
    assert t >= topk_mod.TOPK_LONG["MIN_T"]
    table = dict(topk_mod.TOPK_LONG)
    monkeypatch.setattr(topk_mod, "TOPK_LONG", {**table, "GLUON": 0})  # the table's is 1
    want = AttentionKernels().topk(x, 2048, ks, ke)
    monkeypatch.setattr(topk_mod, "TOPK_LONG", {**table, "GLUON": 1})
    with recording() as rec:
        got = AttentionKernels().topk(x, 2048, ks, ke)
    assert not [e for e in rec.events if e.op == "triton:topk"], rec.events
    assert torch.equal(got, want)


def test_topk_method_is_checked() -> None:
    with pytest.raises(ValueError, match="topk_method"):
        AttentionKernels(topk_method="bitonic")
    assert AttentionKernels().topk_method == "radix"


def test_mla_precision_is_explicit() -> None:
    """The default is FlashMLA's precision on 16-bit inputs; "exact" is asked for by name (a
    launch override alone no longer changes the precision); anything else is an error."""
    with pytest.raises(ValueError, match="mla_precision"):
        AttentionKernels(mla_precision="fp8")  # type: ignore[arg-type]
    assert AttentionKernels().mla_config["P_SPLIT"] == 1
    assert AttentionKernels(mla_config={"BLOCK_K": 16}).mla_config["P_SPLIT"] == 1
    exact = AttentionKernels(mla_precision="exact", mla_config={"BLOCK_K": 16})
    assert (exact.mla_config["P_SPLIT"], exact.mla_config["BLOCK_K"]) == (2, 16)


@interp
@pytest.mark.slow
@pytest.mark.parametrize("few_rows", [0, 10**9])
def test_indexer_either_kernel_at_any_row_count(ref: Any, monkeypatch: pytest.MonkeyPatch,
                                                few_rows: int) -> None:
    """The few-rows kernel (heads stacked into one dot) at every size, up to 131 rows and 4 or
    64 heads, and the row-tile kernel at a decode step's 1-7 rows."""
    monkeypatch.setattr(conf, "ATTN_SIZES", ((1, 1, 8), (3, 5, 8), (17, 40, 64), (64, 200, 16),
                                             (131, 300, 64), (7, 2600, 2048)))
    impl = AttentionKernels(indexer_config={"FEW_ROWS": few_rows, "FEW_BLOCK_N": 64})
    conf.check_op(impl, ref, "indexer_logits", device="cpu")


@interp
@pytest.mark.slow  # 8 CPU seconds
def test_conformance_interpreter_small_tiles(ref: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many row / key / head / index tiles per call, and the bf16 x 3 chained probability
    split."""
    monkeypatch.setattr(conf, "ATTN_SIZES", ((17, 40, 64), (5, 700, 2048)))
    impl = AttentionKernels(indexer_config={"BLOCK_M": 16, "BLOCK_N": 32},
                            mla_config={"BLOCK_H": 16, "BLOCK_K": 16, "P_SPLIT": 3, "P_FP16": 0,
                                        "P_CAT": 0},
                            mla_precision="exact")
    monkeypatch.setattr(conf, "FORMATS", {"small": conf.FORMATS["small"]})
    monkeypatch.setattr(conf, "FP8_TOPK_SIZES", ((17, 40, 8),))  # the fp8 choice, tiled small
    conf.check_op(impl, ref, "indexer_logits", device="cpu")
    monkeypatch.setattr(conf, "ATTN_SIZES", ((17, 40, 64),))
    conf.check_op(impl, ref, "sparse_mla", device="cpu")


@interp
def test_indexer_causal_rows_skip_tiles(ref: Any) -> None:
    """Rows of a CP rank at the end of a prompt plus rows of a second request and empty rows:
    skipped tiles still write -inf, computed ones match the reference."""
    g = torch.Generator().manual_seed(3)
    n, t, heads, d = 40, 300, 4, 16
    q = torch.randn(n, heads, d, generator=g).to(torch.bfloat16)
    w = torch.randn(n, heads, generator=g) * 0.1
    k = torch.randn(t, d, generator=g)
    pos = torch.arange(n, dtype=torch.int64)
    ks = torch.where(pos < 20, 0, 200)
    ke = torch.where(pos < 20, 150 + pos + 1, 280 + pos - 20)
    ke[5] = ks[5]  # an empty row
    impl = AttentionKernels(indexer_config={"BLOCK_M": 16, "BLOCK_N": 32})
    k8, sc = quantize_fp8(k)
    for keys, scale in ((k.to(torch.bfloat16), None), (k8, sc)):
        got = impl.indexer_logits(q, w, keys, scale, ks, ke)
        want = ref.indexer_logits(q, w, keys, scale, ks, ke)
        assert torch.equal(got.isneginf(), want.isneginf())
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert bool(got[:20, 171:].isneginf().all()) and bool(got[5].isneginf().all())


@interp
def test_sparse_mla_partial_head_blocks(ref: Any) -> None:
    """40 heads in blocks of 16 (the last one partial), some indices -1: the reference's."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(5, 40, 48, generator=g).to(torch.bfloat16)
    kv = torch.randn(90, 48, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 90, (5, 33), generator=g, dtype=torch.int32)
    idx[1, 20:] = -1
    want = ref.sparse_mla(q.float(), kv.float(), idx, 0.2, 32)
    impl = AttentionKernels(mla_config={"BLOCK_H": 16, "BLOCK_K": 16}, mla_precision="exact")
    assert torch.allclose(impl.sparse_mla(q, kv, idx, 0.2, 32), want, rtol=1e-5, atol=1e-5)


@interp
def test_sparse_mla_odd_dims_and_rows(ref: Any) -> None:
    """Heads not a power of two, dv = Dk (no rope tail), non-contiguous q, all -1 rows."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 24, 3, generator=g).transpose(1, 2)  # [6, 3, 24], strided
    kv = torch.randn(50, 24, generator=g)
    idx = torch.randint(0, 50, (6, 20), generator=g, dtype=torch.int32)
    idx[2] = -1
    idx[4, 7:] = -1
    impl = AttentionKernels()
    for dv in (24, 10):
        got = impl.sparse_mla(q, kv, idx, 0.3, dv)
        want = ref.sparse_mla(q, kv, idx, 0.3, dv)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert bool((got[2] == 0).all())


# ---- shape checks and empty calls (no kernel launch) --------------------------------------------
def test_bad_inputs_raise_value_error() -> None:
    impl = AttentionKernels()
    r = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="k_scale"):
        impl.indexer_logits(torch.zeros(2, 4, 16), torch.zeros(2, 4),
                            torch.zeros(5, 16).to(torch.float8_e4m3fn), None, r, r)
    with pytest.raises(ValueError, match="w float32"):
        impl.indexer_logits(torch.zeros(2, 4, 16), torch.zeros(2, 3), torch.zeros(5, 16), None, r, r)
    with pytest.raises(ValueError, match="key_end"):
        impl.topk(torch.zeros(2, 5), 3, r, r.int())
    with pytest.raises(ValueError, match="k must be"):
        impl.topk(torch.zeros(2, 5), -1, r, r)
    with pytest.raises(ValueError, match="indices int32"):
        impl.sparse_mla(torch.zeros(2, 4, 16), torch.zeros(5, 16), torch.zeros(2, 3,
                        dtype=torch.int64), 1.0, 8)
    with pytest.raises(ValueError, match="dv"):
        impl.sparse_mla(torch.zeros(2, 4, 16), torch.zeros(5, 16), torch.zeros(2, 3,
                        dtype=torch.int32), 1.0, 17)


def test_empty_calls_need_no_kernel() -> None:
    impl = AttentionKernels()
    r = torch.zeros(0, dtype=torch.int64)
    assert impl.indexer_logits(torch.zeros(0, 4, 16), torch.zeros(0, 4), torch.zeros(9, 16), None,
                               r, r).shape == (0, 9)
    assert impl.topk(torch.zeros(0, 9), 4, r, r).shape == (0, 4)
    r2 = torch.zeros(2, dtype=torch.int64)
    assert impl.topk(torch.zeros(2, 9), 0, r2, r2).shape == (2, 0)
    out = impl.sparse_mla(torch.ones(2, 4, 16), torch.zeros(0, 16),
                          torch.full((2, 3), -1, dtype=torch.int32), 1.0, 8)
    assert out.shape == (2, 4, 8) and bool((out == 0).all())


#: page-tile launches: either dot orientation, pipelined or not (page-major pages: the
#: PAGED_MAJOR_* values)
def _first_fast(cfgs: list[Any]) -> list[Any]:
    """The first config in the fast subset, the rest ``slow`` (CI runs them)."""
    return [pytest.param(c, id=f"cfg{i}", marks=() if i == 0 else pytest.mark.slow)
            for i, c in enumerate(cfgs)]


PAGE_TILES = [{"PAGED_KERNEL": 1, "PAGED_PAGES": 1, "PAGED_STAGES": 1, "PAGED_KEYS_M": 0,
               "PAGED_MAJOR_PAGES": 2, "PAGED_MAJOR_STAGES": 3},
              {"PAGED_KERNEL": 1, "PAGED_PAGES": 3, "PAGED_STAGES": 2, "PAGED_KEYS_M": 1},
              {"PAGED_KERNEL": 1, "PAGED_PAGES": 8, "PAGED_STAGES": 1, "PAGED_KEYS_M": 1},
              {"PAGED_KERNEL": 1, "PAGED_PAGES": 3, "PAGED_STAGES": 2, "PAGED_KEYS_M": 0}]


@interp
@pytest.mark.parametrize("cfg", _first_fast(PAGE_TILES))  # 5-6 CPU seconds each
def test_indexer_paged_page_tiles(ref: Any, cfg: dict[str, int]) -> None:
    """The page-tile kernel (whole pages a step, runs of pages a program, the page loop
    pipelined or not, either dot orientation) over the suite's part-major pools."""
    conf.check_op(AttentionKernels(indexer_config=cfg), ref, "indexer_logits_paged", device="cpu")


def check_index_pages(impl: Any, ref: Any, device: str) -> None:
    """``indexer_logits_index_pages`` over page-major copies of the conformance suite's pools
    equals the reference's ``indexer_logits_paged`` on the part-major pools (the suite's
    tolerances, -inf exactly past key_end), and bit for bit the page-tile kernel on the
    part-major pool: the same keys, the other page order."""
    fmts = [("deepseek_v32 fp8", conf.FORMATS["deepseek_v32"], 8), ("small fp8", conf.FORMATS["small"], 4),
            ("small bf16", KVFormat(dtype=KVDtype.BF16, kv_lora_rank=64, rope_dim=16,
                                    index_head_dim=32, page_size=16), 4)]
    part = AttentionKernels(indexer_config={**impl.indexer_config, "PAGED_KERNEL": 1})
    for j, (label, fmt, heads) in enumerate(fmts):
        for (requests, m, per), kind in itertools.product(conf.PAGED_INDEXER_SIZES,
                                                          ("bf16", "fp8")):
            if kind == "fp8" and fmt.dtype is not KVDtype.FP8:
                continue
            g = torch.Generator().manual_seed(j * 100 + requests * 10 + m)
            case = f"{label}, {kind} q, {requests} x {m} pages x {per}"
            table, row_request, key_end, pool = conf._paged_rows(fmt, requests, m, per, g)
            pages = conf._paged_pool(fmt, pool, ref, g)
            n, d = row_request.shape[0], fmt.index_head_dim
            q = torch.randn(n, heads, d, generator=g).to(torch.bfloat16)
            w = torch.randn(n, heads, generator=g) * (heads ** -0.5 * d ** -0.5)
            if kind == "fp8":
                q, w = conf.quantize_index_q(q, w)
            want = ref.indexer_logits_paged(q, w, pages, fmt, table, row_request, key_end)
            mag = ref.indexer_logits_paged(conf.abs_fp8(q), w.abs(), conf.abs_index_pages(
                pages, fmt), fmt, table, row_request, key_end) if kind == "fp8" else None
            q, w, pages, table, row_request, key_end = conf._to(device, q, w, pages, table,
                                                                row_request, key_end)
            for pad in (0, 16):
                got = impl.indexer_logits_index_pages(q, w, conf.index_pages_of(pages, fmt, pad), fmt,
                                                      table, row_request, key_end)
                conf._assert_logits("indexer_logits_index_pages", f"{case}, pad {pad}",
                                    got.cpu(), want, mag)
                col = torch.arange(m * fmt.page_size)
                assert torch.equal(got.cpu().isneginf(), col >= key_end.cpu()[:, None]), case
                same = part.indexer_logits_paged(q, w, pages, fmt, table, row_request, key_end)
                assert torch.equal(got, same), case


@interp
@pytest.mark.parametrize("cfg", _first_fast(PAGE_TILES))  # 7 CPU seconds each
def test_indexer_index_pages_in_deepgemms_page_order(ref: Any, cfg: dict[str, int]) -> None:
    check_index_pages(AttentionKernels(indexer_config=cfg), ref, "cpu")


def test_index_pages_decline_a_page_size_they_cannot_tile() -> None:
    fmt = KVFormat(dtype=KVDtype.FP8, kv_lora_rank=64, rope_dim=16, index_head_dim=32,
                   quant_block=64, page_size=8)
    q = torch.zeros(1, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(OpDeclined, match="power of two >= 16"):
        AttentionKernels().indexer_logits_index_pages(
            q, torch.zeros(1, 4), torch.zeros(2, 8 * 36, dtype=torch.uint8), fmt,
            torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int64))


# ---- GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("op", "mla_config"), [
    ("indexer_logits", {}), ("indexer_logits_paged", {}), ("indexer_logits_index_pages", {}),
    ("topk", {}), ("v4_index_topk", {}), ("sparse_mla", {}),
    ("sparse_mla", {"P_SPLIT": 3, "P_FP16": 0, "P_CAT": 0, "BLOCK_K": 64}),
    ("sparse_mla", {"BLOCK_H": 32, "BLOCK_K": 32, "num_warps": 4}),
    ("sparse_mla", {"BLOCK_H": 32})])
def test_conformance_gpu(ref: Any, op: str, mla_config: dict[str, int]) -> None:
    conf.check_op(AttentionKernels(mla_config=mla_config, mla_precision="exact"), ref, op,
                  device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", PAGE_TILES)
def test_indexer_page_tiles_gpu(ref: Any, cfg: dict[str, int]) -> None:
    conf.check_op(AttentionKernels(indexer_config=cfg), ref, "indexer_logits_paged",
                  device="cuda")
    check_index_pages(AttentionKernels(indexer_config=cfg), ref, "cuda")


@pytest.mark.gpu
def test_fused_indexer_topk_forced_small_gpu(ref: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused indexer top-k compiled (its inline-PTX append: the interpreter runs the Triton
    ops instead) at small sizes with the path forced on every view: the conformance suite's
    ``indexer_topk`` (the reference's set, ties by the lower column), and every long row
    overflowing a 16-slot CAP taken exactly by the flagged-row pass."""
    fused = import_kernels("cpkv_backend_triton.indexer_topk", "_fused_filter_kernel")
    cfg = {**fused.INDEXER_TOPK, "MIN_T": 1, "SAMPLE": 64, "CAP_MIN": 16, "BLOCK_M": 16,
           "BLOCK_N": 32, "SELECT_BLOCK": 32, "EXACT_BLOCK_N": 32}
    monkeypatch.setattr(fused, "INDEXER_TOPK", cfg)
    monkeypatch.setattr(attention, "INDEXER_TOPK", cfg)
    impl = AttentionKernels(indexer_config={"FEW_ROWS": 0})
    conf.check_op(impl, ref, "indexer_topk", device="cuda")
    monkeypatch.setitem(cfg, "CAP_MAX", 16)
    g = torch.Generator().manual_seed(7)
    n, t, k = 12, 1024, 16
    q = torch.randn(n, 4, 32, generator=g).round().cuda()
    w = torch.full((n, 4), 2.0 ** -6, device="cuda")
    keys = torch.randn(t, 32, generator=g).round().cuda()
    ks = torch.zeros(n, dtype=torch.int64, device="cuda")
    ke = torch.arange(t - n + 1, t + 1, device="cuda")
    got = impl.indexer_topk(q, w, keys, None, ks, ke, k)
    want = ref.topk(ref.indexer_logits(q, w, keys, None, ks, ke), k, ks, ke)
    assert torch.equal(got.sort(1).values, want.sort(1).values)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "t"), [(300, 200001), (64, 262144)])
def test_fused_indexer_topk_equals_the_plain_path_gpu(n: int, t: int) -> None:
    """DeepSeek's fp8 indexer at the fused path's default lengths (at least 192K keys), causal
    tails: the fused op's output equals the plain path's (the Triton indexer, then the Triton
    top-k) column for column: the same logits, the same set, ascending."""
    assert t >= attention.INDEXER_TOPK["MIN_T"]
    g = torch.Generator().manual_seed(n)
    q8 = torch.randn(n, 64, 128, generator=g).to("cuda", torch.float8_e4m3fn)
    w = (torch.randn(n, 64, generator=g) * (64 * 128) ** -0.5).cuda()
    k8, scale = quantize_fp8(torch.randn(t, 128, generator=g).cuda(), None, "ue8m0")
    ks = torch.zeros(n, dtype=torch.int64, device="cuda")
    ke = torch.arange(t - n + 1, t + 1, device="cuda")
    impl = AttentionKernels()
    got = impl.indexer_topk(q8, w, k8, scale, ks, ke, 2048)
    want = impl.topk(impl.indexer_logits(q8, w, k8, scale, ks, ke), 2048, ks, ke)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "t", "kind"), [(256, 8192, "bf16"), (256, 8192, "fp8"),
                                             (1000, 4099, "fp8"), (77, 20000, "bf16"),
                                             (1, 65536, "fp8"), (2, 65536, "bf16"),
                                             (8, 30001, "fp8")])  # the few-rows kernel
def test_indexer_realistic_gpu(ref: Any, n: int, t: int, kind: str) -> None:
    g = torch.Generator().manual_seed(n + t)
    q = torch.randn(n, 64, 128, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(n, 64, generator=g) * (64 * 128) ** -0.5).cuda()
    k = torch.randn(t, 128, generator=g).cuda()
    scale = None
    if kind == "fp8":
        k, scale = quantize_fp8(k)
    else:
        k = k.to(torch.bfloat16)
    pos = torch.arange(t - n, t, dtype=torch.int64, device="cuda")
    ks = torch.where(pos % 3 == 0, pos // 2, 0)
    ke = pos + 1
    got = AttentionKernels().indexer_logits(q, w, k, scale, ks, ke)
    want = ref.indexer_logits(q, w, k, scale, ks, ke)
    assert torch.equal(got.isneginf(), want.isneginf())
    fin = want.isfinite()
    assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "heads", "t", "k"), [(64, 128, 16384, 2048), (33, 16, 5000, 2048),
                                                    (200, 128, 3000, 512)])
def test_sparse_mla_and_topk_realistic_gpu(ref: Any, n: int, heads: int, t: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, heads, 576, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(t, 576, generator=g).to("cuda", torch.bfloat16)
    logits = torch.randn(n, t, generator=g).cuda()
    pos = torch.arange(t - n, t, dtype=torch.int64, device="cuda")
    ks, ke = torch.zeros_like(pos), pos + 1
    impl = AttentionKernels()
    idx = impl.topk(logits, k, ks, ke)
    want_idx = ref.topk(logits, k, ks, ke)
    assert _same_choice(idx, want_idx, logits, ks, ke, k)  # ties broken as the reference does
    idx[::3, k // 2:] = -1
    got = impl.sparse_mla(q, kv, idx, 576 ** -0.5, 512)
    want = ref.sparse_mla(q, kv, idx, 576 ** -0.5, 512)
    # bf16 q/kv take the FlashMLA-precision path (one bf16 P): bf16 tolerance of the fp32 reference
    tol = conf.LOWP_MLA_REL
    assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    exact = AttentionKernels(mla_precision="exact").sparse_mla(q, kv, idx, 576 ** -0.5, 512)
    assert torch.allclose(exact, want, rtol=1e-5, atol=1e-5)  # the exact mode on request


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_attention_kernels_do_not_sync_on_cuda() -> None:
    dev = "cuda"
    impl = AttentionKernels()
    x = conf.sync_check_inputs(dev)
    q, w, k, scale, k8, ks, ke, kv, qm = (x[n] for n in ("q", "w", "k", "scale", "k8", "ks",
                                                         "ke", "kv", "qm"))
    for kk, sc in ((k.bfloat16(), None), (k8, scale)):  # compile outside the sync check
        impl.topk(impl.indexer_logits(q, w, kk, sc, ks, ke), 64, ks, ke)
    impl.sparse_mla(qm, kv, torch.zeros(64, 64, dtype=torch.int32, device=dev), 0.1, 512)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kk, sc in ((k.bfloat16(), None), (k8, scale)):
            logits = impl.indexer_logits(q, w, kk, sc, ks, ke)
            idx = impl.topk(logits, 64, ks, ke)
            impl.sparse_mla(qm, kv, idx, 0.1, 512)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_long_topk_splits_few_rows() -> None:
    """The one-read path spreads a decode step's few long rows over programs (a row of 256K
    logits alone once took one program: the scratch bound by the logits' bytes allowed one
    split); many rows keep the scratch within an eighth of the logits' bytes."""
    from cpkv_backend_triton.topk import TOPK_LONG, _splits

    cap = TOPK_LONG["CAP"]
    assert _splits(1, 262144, cap) == 262144 // TOPK_LONG["SPLIT_MIN"]
    assert _splits(8, 262144, cap) == 262144 // TOPK_LONG["SPLIT_MIN"]
    n, t = 1024, 1 << 19  # a long prompt's chunk: 1024 rows x 512K keys
    ns = _splits(n, t, cap)
    assert ns >= 1 and n * ns * cap * 8 <= max(n * t * 4 // 8, TOPK_LONG["SCRATCH_MB"] << 20)


def test_fp8_logits_tolerance_is_relative_to_the_terms_magnitude() -> None:
    """The fp8-query check bounds each logit's error by its terms' absolute sum: a logit whose
    heads cancel (magnitude 1, value 1e-3) may be off by 1e-3 of the magnitude, not of the
    value; an error of 1 % of the magnitude (a wrong scale, a dropped head) fails."""
    want = torch.tensor([[1e-3, 0.5, float("-inf")]])
    mag = torch.tensor([[1.0, 0.5, float("-inf")]])
    ok = want + torch.tensor([[1e-3, -5e-4, 0.0]])
    conf._assert_logits("op", "case", ok, want, mag)
    with pytest.raises(AssertionError, match="magnitude"):
        conf._assert_logits("op", "case", want + torch.tensor([[1e-2, 0.0, 0.0]]), want, mag)
    with pytest.raises(AssertionError, match="magnitude"):  # the old check would accept it
        conf._assert_logits("op", "case", want * torch.tensor([[1.0, 1.01, 1.0]]), want, mag)
