"""The fused indexer top-k (cpkv_backend_triton.indexer_topk) on Triton's CPU interpreter: the
reference's set (conformance suite, ties by the lower column), the plain path's set (the Triton
indexer then the Triton top-k), ascending, and the rows
the select flags (a floor above the k-th key, a row over CAP) recomputed exactly. Small shapes:
the fused path's thresholds lowered."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpkv.testing.conformance as conf
from triton_interp import CUDA, bin_values, import_kernels, interpreter_env

fused = import_kernels("cpkv_backend_triton.indexer_topk", "_fused_filter_kernel")
attention = import_kernels("cpkv_backend_triton.attention", "_indexer_kernel")

pytestmark = pytest.mark.skipif(CUDA, reason="CUDA present: kernels are compiled for the GPU")

#: the fused path at interpreter sizes: every view long enough, a small sample, small tiles
SMALL = {"MIN_T": 1, "SAMPLE": 64, "CAP_MIN": 16, "BLOCK_M": 16, "BLOCK_N": 32,
         "SELECT_BLOCK": 32, "EXACT_BLOCK_N": 32}


@pytest.fixture(autouse=True)
def _interpreter_env():  # type: ignore[no-untyped-def]
    with interpreter_env():
        yield


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    cfg = {**fused.INDEXER_TOPK, **SMALL}
    monkeypatch.setattr(fused, "INDEXER_TOPK", cfg)
    monkeypatch.setattr(attention, "INDEXER_TOPK", cfg)
    return cfg


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Per fused call: which rows the select left to the exact pass (rows holding more than k
    keys whose ``meta`` is -1)."""
    seen: list[torch.Tensor] = []
    real = fused.select_fused

    def spy(val: torch.Tensor, col: torch.Tensor, count: torch.Tensor, ks: torch.Tensor,
            ke: torch.Tensor, out: torch.Tensor, meta: torch.Tensor, t: int, k: int,
            cap: int) -> None:
        real(val, col, count, ks, ke, out, meta, t, k, cap)
        long = (ke.clamp(0, t) - ks.clamp(0, t)) > k
        seen.append(long & (meta[:, 0] < 0))

    monkeypatch.setattr(fused, "select_fused", spy)
    return seen


def _impl() -> Any:
    return attention.AttentionKernels(indexer_config={"FEW_ROWS": 0})


def _inputs(n: int, t: int, heads: int = 4, d: int = 32, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random float queries, weights, keys and causal-tail ranges (row i: [0, t - n + i + 1))."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=g)
    w = torch.randn(n, heads, generator=g).abs() * (heads * d) ** -0.5
    keys = torch.randn(t, d, generator=g)
    ke = torch.arange(t - n + 1, t + 1, dtype=torch.int64)
    return q, w, keys, torch.zeros(n, dtype=torch.int64), ke


def _exact(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, ks: torch.Tensor,
           ke: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Integer queries and keys, power-of-two weights: every logit exact in any summation order,
    so equal keys tie exactly in the kernels and the reference (a BLAS may sum a matmul's edge
    columns in another order: float ties are only ties within an ulp)."""
    return q.round(), torch.full_like(w, 2.0 ** -6), keys.round(), ks, ke


def _check(impl: Any, ref: Any, args: tuple[Any, ...], k: int, *, plain: bool = True) -> None:
    """The reference's set by the top-k rule; with ``plain``, the plain Triton path's set
    exactly (the same logits), each long row's columns ascending (whatever order the atomic
    appends gave the candidates)."""
    q, w, keys, scale, ks, ke = args
    got = impl.indexer_topk(q, w, keys, scale, ks, ke, k)
    logits = ref.indexer_logits(q, w, keys, scale, ks, ke)
    conf._assert_topk("fused", got, ref.topk(logits, k, ks, ke), logits, ks, ke, k)
    if plain:
        want = impl.topk(impl.indexer_logits(q, w, keys, scale, ks, ke), k, ks, ke)
        assert torch.equal(got.sort(1).values, want.sort(1).values)
        long = (ke.clamp(0, keys.shape[0]) - ks.clamp(0, keys.shape[0])) > k
        assert torch.equal(got[long], got[long].sort(1).values)  # ascending, as chosen


def test_layout_caps_a_row_at_twice_the_floors_keys() -> None:
    """512K keys, k = 2048: the floor keeps ~40 of the 4096 sampled keys' share of a row (~5.1K
    keys), CAP the power of two above twice that (16384: 1/16 of the row's logits' bytes);
    1M keys keep ~7.4K (CAP 16384, the largest); short views are capped by their length."""
    big = fused.layout(8192, 524288, 2048)
    assert (big.cap, big.stride, big.sample_cols) == (16384, 128, 4096)
    assert fused.layout(1024, 1 << 20, 2048).cap == 16384
    assert fused.layout(64, 262144, 2048).cap == 8192  # ~3.1K kept at 256K
    assert fused.layout(3, 100, 8, {**fused.INDEXER_TOPK, **SMALL}).cap <= 128


def test_the_ptx_append_declines_rocm_visibly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inline-PTX append on NVIDIA devices only: the interpreter takes the Triton ops
    silently (its design), a ROCm device (also "cuda" to torch) takes them with one
    ``kernel_variant`` fallback however many calls."""
    from cpkv.contracts import FallbackReason
    from cpkv.fallback import recording

    monkeypatch.setattr(fused, "_PTX_DECLINED", set())
    monkeypatch.setattr(torch.version, "hip", None)
    with recording() as rec:
        assert fused.ptx_append(True, False)
        assert not fused.ptx_append(False, False) and not fused.ptx_append(True, True)
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert not fused.ptx_append(True, False) and not fused.ptx_append(True, False)
    events = [e for e in rec.events if e.op == "triton:indexer_topk"]
    assert len(events) == 1, events
    assert events[0].reason is FallbackReason.KERNEL_VARIANT and "ROCm" in events[0].detail


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1 << 17), t=st.integers(1, 1 << 21), k=st.integers(1, 4096))
def test_layout_bounds_the_scratch_and_covers_the_floors_keys(n: int, t: int, k: int) -> None:
    """For any call: CAP a power of two in [CAP_MIN, CAP_MAX], at most the row's length rounded
    up to one, and SAFETY times the keys the floor keeps on average unless that bound cut it;
    the sample's columns ``i * stride`` cover the row (at most SAMPLE of them)."""
    cfg = dict(fused.INDEXER_TOPK)
    lay = fused.layout(n, t, k, cfg)
    cap = lay.cap
    assert cap & (cap - 1) == 0
    row = 1 << max(0, (t - 1).bit_length())
    assert cap <= max(cfg["CAP_MAX"], 16) and cap <= max(row, 16)
    assert cap >= min(cfg["CAP_MIN"], max(row, 16))
    assert lay.sample_cols <= cfg["SAMPLE"] and (lay.sample_cols - 1) * lay.stride < t
    assert lay.sample_cols * lay.stride >= t
    est = k * lay.sample_cols // t
    kept = (est + int(4 * (est + 1) ** 0.5) + 9) / lay.sample_cols * t
    if cap < min(cfg["CAP_MAX"], row):
        assert cap >= min(cfg["SAFETY"] * kept, t)


@pytest.mark.slow  # ~25 s on the interpreter: the suite's attention sizes
def test_conformance(ref: Any, small: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conf, "ATTN_SIZES", ((0, 0, 8), (1, 1, 8), (3, 5, 8), (17, 40, 8),
                                             (64, 200, 16), (5, 700, 64)))
    monkeypatch.setattr(conf, "FP8_TOPK_SIZES", ((17, 40, 8), (24, 200, 16), (5, 300, 64)))
    conf.check_op(_impl(), ref, "indexer_topk", device="cpu")


@pytest.mark.slow  # 4-7 s in the interpreter
def test_causal_tail_equals_the_plain_path(ref: Any, small: dict[str, int],
                                           flags: list[torch.Tensor]) -> None:
    q, w, keys, ks, ke = _inputs(12, 500)
    ks[3], ke[3] = 200, 450  # a range inside the view
    ks[5], ke[5] = 7, 7  # empty
    ke[6] = 10  # shorter than k
    _check(_impl(), ref, (q, w, keys, None, ks, ke), 16)
    assert len(flags) == 1 and not bool(flags[0].any())  # the filter chose every row


@pytest.mark.slow  # 4-7 s in the interpreter
@pytest.mark.parametrize("rounds", [2, 4])  # the table's 3 runs in every other test
def test_a_floor_from_fewer_radix_rounds_keeps_the_set(ref: Any, small: dict[str, int],
                                                       flags: list[torch.Tensor],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       rounds: int) -> None:
    """FLOOR_ROUNDS < 4: the floor is the place's sample key with its low bits cleared (lower,
    so more candidates, never fewer); 4: the key itself. The same set as the plain path either
    way, no row flagged."""
    monkeypatch.setitem(small, "FLOOR_ROUNDS", rounds)
    q, w, keys, ks, ke = _inputs(12, 500, seed=11)
    _check(_impl(), ref, (q, w, keys, None, ks, ke), 16)
    assert len(flags) == 1 and not bool(flags[0].any())


@pytest.mark.slow  # 4-7 s in the interpreter
def test_fp8_queries_and_keys(ref: Any, small: dict[str, int], flags: list[torch.Tensor]) -> None:
    """DeepSeek's fp8 numerics: e4m3 integer grids (exact dots) with power-of-two key scales:
    the fused path picks the plain path's set, and the reference's within its logits'
    tolerance."""
    g = torch.Generator().manual_seed(3)
    n, t, heads, d = 12, 500, 8, 32
    q8 = torch.randint(-4, 5, (n, heads, d), generator=g).float().to(torch.float8_e4m3fn)
    k8 = torch.randint(-4, 5, (t, d), generator=g).float().to(torch.float8_e4m3fn)
    scale = torch.pow(2.0, torch.randint(-8, -3, (t,), generator=g).float())
    w = torch.randn(n, heads, generator=g).abs()
    ks, ke = torch.zeros(n, dtype=torch.int64), torch.arange(t - n + 1, t + 1)
    _check(_impl(), ref, (q8, w, k8, scale, ks, ke), 32)
    assert len(flags) == 1


@pytest.mark.slow  # 4-7 s in the interpreter
def test_a_floor_above_the_kth_key_is_recomputed_exactly(ref: Any, small: dict[str, int],
                                                         flags: list[torch.Tensor]) -> None:
    """Keys at the sample's columns (multiples of the stride) score far above the others, all
    different: the floor is the ~15th of them, fewer than k = 16 keys reach it, every long row
    is flagged."""
    n, t, k = 12, 1024, 16
    q, w, keys, ks, ke = _inputs(n, t, seed=5)
    q[:] = q[0:1].abs()
    stride = fused.layout(n, t, k, small).stride
    cols = keys[::stride].shape[0]
    keys[::stride] = keys[0].abs() * (4.0 + torch.arange(cols, dtype=torch.float32)[:, None])
    _check(_impl(), ref, (q, w, keys, None, ks, ke), k, plain=False)
    assert len(flags) == 1 and bool(flags[0].all())


@pytest.mark.slow  # 4-7 s in the interpreter
def test_ties_overflow_a_row_and_break_by_the_lower_column(
        ref: Any, small: dict[str, int], flags: list[torch.Tensor],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal keys give a row equal logits: all are candidates, the row overflows its CAP, the
    exact pass takes the k lowest columns (as the reference)."""
    monkeypatch.setitem(small, "CAP_MAX", 16)
    q, w, keys, ks, ke = _exact(*_inputs(10, 800, seed=7))
    keys[:] = keys[0]
    got = _impl().indexer_topk(q, w, keys, None, ks, ke, 16)
    assert len(flags) == 1 and bool(flags[0].all())
    want = ref.topk(ref.indexer_logits(q, w, keys, None, ks, ke), 16, ks, ke)
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    assert torch.equal(got.sort(1).values, torch.arange(16, dtype=torch.int32).expand(10, 16))


def test_ties_within_cap_break_by_the_lower_column(ref: Any, small: dict[str, int],
                                                   flags: list[torch.Tensor]) -> None:
    """40 equal keys high above the rest, the k-th place among them: the filter keeps them
    (no row flagged), the select takes the lowest columns among them."""
    q, w, keys, ks, ke = _exact(*_inputs(8, 700, seed=9))
    q[:] = q[0:1].abs() + 1.0
    keys[100:140] = keys[0].abs() * 3.0 + 1.0
    got = _impl().indexer_topk(q, w, keys, None, ks, ke, 16)
    want = ref.topk(ref.indexer_logits(q, w, keys, None, ks, ke), 16, ks, ke)
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    assert len(flags) == 1 and not bool(flags[0].any())
    assert torch.equal(got, torch.arange(100, 116, dtype=torch.int32).expand(8, 16))


@pytest.mark.parametrize("compact", [0, 1])
@pytest.mark.parametrize("kind", ["spread", "mixed", "clustered"])
def test_select_over_unordered_candidates(small: dict[str, int], compact: int,
                                          kind: str) -> None:
    """The select (``select_fused``) over candidates in no order, each row's k largest logits
    by value, ties by the lower column, listed ascending; its last two radix rounds over every
    candidate or (``COMPACT``) over the keys of the k-th key's 16-bit bin copied into the row's
    output slots: that bin small ("spread"), holding several keys ("mixed"), or larger than the
    slots ("clustered": every round over every candidate). Rows with fewer than k candidates
    or over CAP are flagged."""
    small["COMPACT"] = compact
    g = torch.Generator().manual_seed(23)
    n, cap, t, k = 7, 96, 5000, 24
    val = torch.zeros(n * cap)
    col = torch.zeros(n * cap, dtype=torch.int32)
    count = torch.randint(k, cap + 1, (n,), generator=g, dtype=torch.int32)
    count[0], count[1] = k - 1, cap + 3  # flagged: too few, overflowed
    for r in range(n):
        c = min(int(count[r]), cap)
        val[r * cap:r * cap + c] = bin_values(kind, c, g)
        col[r * cap:r * cap + c] = torch.randperm(t, generator=g)[:c].to(torch.int32)
    ks, ke = torch.zeros(n, dtype=torch.int64), torch.full((n,), t, dtype=torch.int64)
    out = torch.full((n, k), -2, dtype=torch.int32)
    meta = torch.zeros(n, 2, dtype=torch.int32)
    fused.select_fused(val, col, count, ks, ke, out, meta, t, k, cap)
    assert meta[:2, 0].tolist() == [-1, -1]
    for r in range(2, n):
        c = int(count[r])
        pairs = sorted(zip(val[r * cap:r * cap + c].tolist(), col[r * cap:r * cap + c].tolist(),
                           strict=True), key=lambda vc: (-vc[0], vc[1]))
        assert int(meta[r, 0]) == k
        assert out[r].tolist() == sorted(cc for _, cc in pairs[:k]), (kind, compact, r)


@pytest.mark.slow  # 4-7 s in the interpreter
def test_short_views_take_the_plain_path(ref: Any, flags: list[torch.Tensor]) -> None:
    q, w, keys, ks, ke = _inputs(12, 300)
    _check(_impl(), ref, (q, w, keys, None, ks, ke), 16, plain=False)
    assert flags == []  # MIN_T (192K keys) not reached
