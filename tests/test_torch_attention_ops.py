"""The torch reference sparse-attention ops (issue #4, rule 19): against independent naive formulas
(Python loops over small sizes), top-k semantics, edge cases, no host sync, and broken backends
that the conformance suite must reject."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.ops import ATTN_OPS
from cpkv.ops.api import KVFormat, quantize_fp8
from cpkv.testing.conformance import (
    FORMATS,
    check_backend,
    check_op,
    sync_check_inputs,
)
from cpkv_backend_torch.ops import TorchOps

DS = FORMATS["deepseek_v32"]
OPS = TorchOps()
NEG_INF = float("-inf")


def _i64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ---- naive formulas (Python floats and loops; no torch arithmetic) ------------------------------
def naive_indexer(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                  ks: list[int], ke: list[int]) -> list[list[float]]:
    n, heads, d = q.shape
    t = k.shape[0]
    qf, wf, kf = q.float().tolist(), w.tolist(), k.float().tolist()
    sc = [1.0] * t if k_scale is None else k_scale.tolist()
    out = []
    for i in range(n):
        row = []
        for j in range(t):
            if not ks[i] <= j < ke[i]:
                row.append(NEG_INF)
                continue
            total = 0.0
            for h in range(heads):
                dot = sum(qf[i][h][c] * kf[j][c] * sc[j] for c in range(d))
                total += wf[i][h] * max(dot, 0.0)
            row.append(total)
        out.append(row)
    return out


def naive_topk(logits: list[list[float]], k: int, ks: list[int], ke: list[int]) -> list[list[int]]:
    """Ascending when the range holds <= k keys, else descending by logit (ties: lower column
    first, which is irrelevant when the logits are distinct); -1 padding."""
    out = []
    for i, row in enumerate(logits):
        t = len(row)
        cols = list(range(max(ks[i], 0), min(ke[i], t)))
        chosen = cols if len(cols) <= k else sorted(cols, key=lambda j: (-row[j], j))[:k]
        out.append(chosen + [-1] * (k - len(chosen)))
    return out


def naive_sparse_mla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float,
                     dv: int) -> list[list[list[float]]]:
    """A loop over the slots of each row (a repeated index counts once per slot)."""
    n, heads, dk = q.shape
    qf, kvf, il = q.float().tolist(), kv.float().tolist(), idx.tolist()
    out = []
    for i in range(n):
        sel = [j for j in il[i] if j != -1]
        per_head = []
        for h in range(heads):
            if not sel:
                per_head.append([0.0] * dv)
                continue
            s = [scale * sum(qf[i][h][c] * kvf[j][c] for c in range(dk)) for j in sel]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            z = sum(e)
            per_head.append([sum(e[a] * kvf[j][c] for a, j in enumerate(sel)) / z
                             for c in range(dv)])
        out.append(per_head)
    return out


def _assert_logits_close(got: torch.Tensor, want: list[list[float]]) -> None:
    w = torch.tensor(want, dtype=torch.float64).reshape(got.shape)
    assert got.dtype == torch.float32
    assert torch.equal(got.isneginf(), w.isneginf())
    fin = w.isfinite()
    torch.testing.assert_close(got.double()[fin], w[fin], rtol=1e-5, atol=1e-5)


# ---- indexer_logits ------------------------------------------------------------------------------
RANGES = ([0, 0, 2, 3, 5, 1], [0, 3, 7, 7, 5, 4])  # empty, prefix, middle, suffix, empty, inner


def _indexer_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(6, 3, 5, generator=g).to(torch.bfloat16)
    w = torch.randn(6, 3, generator=g)
    k = torch.randn(7, 5, generator=g)
    return q, w, k


@pytest.mark.parametrize("kdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_indexer_is_sum_of_weighted_relu_dots(kdtype: torch.dtype) -> None:
    q, w, k = _indexer_case(0)
    k = k.to(kdtype)
    ks, ke = RANGES
    got = OPS.indexer_logits(q, w, k, None, _i64(ks), _i64(ke))
    assert got.shape == (6, 7)
    _assert_logits_close(got, naive_indexer(q, w, k, None, ks, ke))
    # the relu matters: some in-range dot products are negative on these inputs
    dots = torch.einsum("nhd,td->nht", q.float(), k.float())
    assert bool((dots < 0).any())


def test_indexer_dequantises_fp8_keys_by_their_scale() -> None:
    q, w, k = _indexer_case(1)
    packed = OPS.fp8_pack(k, DS.model_copy(update={"index_head_dim": 5}), "index_k")
    k8 = packed[:, :5].view(torch.float8_e4m3fn)  # strided, as the pool hands it out
    scale = packed[:, 5:].clone().view(torch.float32)[:, 0]
    ks, ke = RANGES
    got = OPS.indexer_logits(q, w, k8, scale, _i64(ks), _i64(ke))
    _assert_logits_close(got, naive_indexer(q, w, k8, scale, ks, ke))
    # and it is not the same as ignoring the scale
    unscaled = OPS.indexer_logits(q, w, k8.float(), None, _i64(ks), _i64(ke))
    assert not torch.allclose(got, unscaled)
    # a per-token scale quantised by hand gives the same numbers as the packed bytes (the
    # index-K's ue8m0 scale: the power of two at or above amax / 448)
    s2 = torch.pow(2.0, torch.ceil(torch.log2(k.abs().amax(1) / 448)))
    k2 = (k / s2[:, None]).to(torch.float8_e4m3fn)
    torch.testing.assert_close(OPS.indexer_logits(q, w, k2, s2, _i64(ks), _i64(ke)), got)


def test_indexer_fp8_scale_rules() -> None:
    q, w, k = _indexer_case(2)
    ks, ke = _i64(RANGES[0]), _i64(RANGES[1])
    k8 = k.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"float8_e4m3fn keys need k_scale float32 \[7\], got None"):
        OPS.indexer_logits(q, w, k8, None, ks, ke)
    with pytest.raises(ValueError, match=r"k_scale float32 \[7\], got torch.bfloat16"):
        OPS.indexer_logits(q, w, k8, torch.ones(7, dtype=torch.bfloat16), ks, ke)
    with pytest.raises(ValueError, match=r"k_scale is only for float8_e4m3fn keys.*torch.float32"):
        OPS.indexer_logits(q, w, k, torch.ones(7), ks, ke)
    with pytest.raises(ValueError, match=r"q \(6, 3, 5\) and k \(7, 4\)"):
        OPS.indexer_logits(q, w, k[:, :4], None, ks, ke)
    with pytest.raises(ValueError, match=r"w float32 \[6, 3\], got torch.bfloat16"):
        OPS.indexer_logits(q, w.bfloat16(), k, None, ks, ke)
    with pytest.raises(ValueError, match=r"key_end int64 \[6\], got torch.int32"):
        OPS.indexer_logits(q, w, k, None, ks, ke.int())


def test_indexer_empty_shapes() -> None:
    assert OPS.indexer_logits(torch.empty(0, 4, 8), torch.empty(0, 4), torch.randn(9, 8), None,
                              _i64([]), _i64([])).shape == (0, 9)
    out = OPS.indexer_logits(torch.randn(3, 4, 8), torch.randn(3, 4), torch.empty(0, 8), None,
                             _i64([0, 0, 0]), _i64([0, 0, 0]))
    assert out.shape == (3, 0) and out.dtype == torch.float32


@settings(deadline=None, max_examples=40)
@given(st.data())
def test_indexer_matches_naive_property(data: st.DataObject) -> None:
    n, t = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 6))
    heads, d = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    ks = [data.draw(st.integers(0, t)) for _ in range(n)]
    ke = [data.draw(st.integers(a, t)) for a in ks]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    q, w, k = torch.randn(n, heads, d, generator=g), torch.randn(n, heads, generator=g), \
        torch.randn(t, d, generator=g)
    fp8 = data.draw(st.booleans())
    scale = None
    if fp8:
        k, scale = quantize_fp8(k)
    got = OPS.indexer_logits(q, w, k, scale, _i64(ks), _i64(ke))
    _assert_logits_close(got, naive_indexer(q, w, k, scale, ks, ke))


# ---- topk ----------------------------------------------------------------------------------------
def test_topk_by_hand() -> None:
    logits = torch.tensor([[5.0, 1.0, 9.0, 3.0, 7.0, 2.0],
                           [5.0, 1.0, 9.0, 3.0, 7.0, 2.0],
                           [5.0, 1.0, 9.0, 3.0, 7.0, 2.0],
                           [5.0, 1.0, 9.0, 3.0, 7.0, 2.0],
                           [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]])
    ks, ke = _i64([0, 1, 2, 4, 0]), _i64([6, 4, 5, 4, 3])
    out = OPS.topk(logits, 3, ks, ke)
    assert out.dtype == torch.int32
    assert out.tolist() == [
        [2, 4, 0],     # 6 keys > 3: descending by logit (9, 7, 5)
        [1, 2, 3],     # exactly 3 keys: ascending, whatever the logits
        [2, 3, 4],     # 3 keys: ascending
        [-1, -1, -1],  # empty range
        [0, 1, 2],     # 3 keys
    ]
    # k larger than T: short rows padded with -1
    assert OPS.topk(logits[:2], 8, ks[:2], _i64([6, 3])).tolist() == [
        [0, 1, 2, 3, 4, 5, -1, -1], [1, 2, -1, -1, -1, -1, -1, -1]]


def test_topk_masks_finite_logits_outside_the_range() -> None:
    logits = torch.tensor([[100.0, 1.0, 2.0, 3.0, 4.0, 100.0]])
    assert OPS.topk(logits, 2, _i64([1]), _i64([5])).tolist() == [[4, 3]]


def test_topk_edge_shapes() -> None:
    assert OPS.topk(torch.empty(0, 5), 4, _i64([]), _i64([])).shape == (0, 4)
    assert OPS.topk(torch.empty(2, 0), 4, _i64([0, 0]), _i64([0, 0])).tolist() == [[-1] * 4] * 2
    assert OPS.topk(torch.randn(2, 5), 0, _i64([0, 1]), _i64([5, 3])).shape == (2, 0)
    with pytest.raises(ValueError, match="k must be >= 0, got -1"):
        OPS.topk(torch.randn(2, 5), -1, _i64([0, 1]), _i64([5, 3]))
    with pytest.raises(ValueError, match=r"expected float logits \[N, T\], got torch.int64"):
        OPS.topk(torch.zeros(2, 5, dtype=torch.int64), 1, _i64([0, 1]), _i64([5, 3]))


@settings(deadline=None, max_examples=150)
@given(st.data())
def test_topk_matches_naive_property(data: st.DataObject) -> None:
    """Distinct logits (a permutation), so the naive order is the only right one."""
    n, t, k = data.draw(st.integers(0, 6)), data.draw(st.integers(0, 12)), data.draw(
        st.integers(0, 14))
    ks = [data.draw(st.integers(0, t)) for _ in range(n)]
    ke = [data.draw(st.integers(a, t)) for a in ks]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.stack([torch.randperm(t, generator=g).float() for _ in range(n)]) if n else \
        torch.empty(0, t)
    got = OPS.topk(logits, k, _i64(ks), _i64(ke))
    assert got.dtype == torch.int32 and got.shape == (n, k)
    assert got.tolist() == naive_topk(logits.tolist(), k, ks, ke)


def test_topk_neg_inf_inside_the_range_before_columns_outside() -> None:
    """A row holding more than k keys lists only columns of its range, also when -inf logits
    inside it reach the k-th place (the masked columns left of the range are -inf too)."""
    inf = float("-inf")
    logits = torch.tensor([[5.0, 1.0, inf, 3.0, inf, inf, 2.0]])
    assert OPS.topk(logits, 3, _i64([2]), _i64([6])).tolist() == [[3, 2, 4]]


@settings(deadline=None, max_examples=150)
@given(st.data())
def test_topk_ties_match_naive_property(data: st.DataObject) -> None:
    """Logits from a few values (-inf, -0.0 and 0.0 among them): equal logits by column."""
    n, t, k = data.draw(st.integers(0, 6)), data.draw(st.integers(0, 12)), data.draw(
        st.integers(0, 14))
    ks = [data.draw(st.integers(-2, t + 1)) for _ in range(n)]
    ke = [data.draw(st.integers(-2, t + 2)) for _ in range(n)]
    vals = [float("-inf"), -1.5, -0.0, 0.0, 0.5, 2.0]
    rows = [[data.draw(st.sampled_from(vals)) for _ in range(t)] for _ in range(n)]
    logits = torch.tensor(rows) if n else torch.empty(0, t)
    got = OPS.topk(logits, k, _i64(ks), _i64(ke))
    assert got.tolist() == naive_topk(rows, k, ks, ke)


# ---- sparse_mla ----------------------------------------------------------------------------------
def _mla_case(n: int, heads: int, dk: int, t: int, seed: int,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dk, generator=g).to(dtype),
            torch.randn(t, dk, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_matches_the_naive_loop(dtype: torch.dtype) -> None:
    q, kv = _mla_case(4, 2, 6, 9, 0, dtype)
    idx = torch.tensor([[3, 0, 8, -1], [-1, -1, -1, -1], [5, -1, 5, 2], [1, 2, 3, 4]],
                       dtype=torch.int32)  # -1 anywhere, a repeat, an all -1 row
    got = OPS.sparse_mla(q, kv, idx, 0.4, 4)
    assert got.dtype == torch.float32 and got.shape == (4, 2, 4)
    torch.testing.assert_close(got.double(), torch.tensor(naive_sparse_mla(q, kv, idx, 0.4, 4),
                                                          dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros(2, 4))  # no valid index: zeros, not NaN


def test_sparse_mla_bounds_its_own_temporaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference takes rows in chunks under its temporaries bound (callers chunk by the
    output only): chunked and whole results are the same rows."""
    import cpkv_backend_torch.ops as mod

    q, kv = _mla_case(9, 2, 6, 11, 0, torch.float32)
    idx = torch.randint(-1, 11, (9, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    whole = OPS.sparse_mla(q, kv, idx, 0.3, 4)
    calls: list[int] = []
    real = mod.TorchOps.sparse_mla

    def spy(self: Any, q: torch.Tensor, *a: Any) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(self, q, *a)

    monkeypatch.setattr(mod.TorchOps, "sparse_mla", spy)
    monkeypatch.setattr(mod, "_MLA_TEMP_BYTES", 4 * 5 * (6 + 2 * 2) * 4)  # 4 rows per chunk
    assert torch.equal(OPS.sparse_mla(q, kv, idx, 0.3, 4), whole)
    assert calls == [9, 4, 4, 1]


def test_sparse_mla_is_dense_attention_restricted_to_the_selection() -> None:
    """Indices from the indexer + top-k: a dense softmax over all T keys with the unselected ones
    masked gives the same output."""
    g = torch.Generator().manual_seed(5)
    n, t, heads, dk, dv, k = 7, 30, 3, 12, 8, 6
    q, kv = _mla_case(n, heads, dk, t, 6)
    ks, ke = _i64([0, 0, 3, 10, 10, 5, 29]), _i64([0, 4, 20, 30, 16, 11, 30])
    logits = OPS.indexer_logits(torch.randn(n, 2, 4, generator=g), torch.rand(n, 2, generator=g),
                                torch.randn(t, 4, generator=g), None, ks, ke)
    idx = OPS.topk(logits, k, ks, ke)
    got = OPS.sparse_mla(q, kv, idx, dk ** -0.5, dv)
    sel = torch.zeros(n, t, dtype=torch.bool)
    for i, row in enumerate(idx.tolist()):
        for j in row:
            if j >= 0:
                sel[i, j] = True
    scores = torch.einsum("nhd,td->nht", q.double(), kv.double()) * dk ** -0.5
    scores = scores.masked_fill(~sel[:, None, :], NEG_INF)
    dense = torch.softmax(scores, dim=-1) @ kv.double()[:, :dv]
    dense = torch.where(sel.any(1)[:, None, None], dense, 0.0)  # the empty row: zeros
    torch.testing.assert_close(got.double(), dense, rtol=1e-5, atol=1e-5)
    assert idx[0].eq(-1).all() and got[0].eq(0).all()


def test_sparse_mla_edge_shapes_and_errors() -> None:
    q, kv = _mla_case(3, 2, 6, 5, 1)
    assert OPS.sparse_mla(q[:0], kv, torch.empty(0, 4, dtype=torch.int32), 1.0, 4).shape == (0, 2, 4)
    assert OPS.sparse_mla(q, kv, torch.empty(3, 0, dtype=torch.int32), 1.0, 4).eq(0).all()
    allneg = torch.full((3, 4), -1, dtype=torch.int32)
    assert OPS.sparse_mla(q, kv[:0], allneg, 1.0, 4).eq(0).all()  # T = 0
    assert OPS.sparse_mla(q, kv, allneg, 1.0, 4).eq(0).all()
    with pytest.raises(ValueError, match=r"indices int32 \[3, k\], got torch.int64"):
        OPS.sparse_mla(q, kv, allneg.long(), 1.0, 4)
    with pytest.raises(ValueError, match=r"dv must be in \(0, 6\], got 7"):
        OPS.sparse_mla(q, kv, allneg, 1.0, 7)
    with pytest.raises(ValueError, match=r"q \(3, 2, 6\) and kv \(5, 5\)"):
        OPS.sparse_mla(q, kv[:, :5], allneg, 1.0, 4)


def test_sparse_mla_is_stable_for_large_scores() -> None:
    q, kv = _mla_case(2, 1, 4, 3, 2)
    idx = torch.tensor([[0, 1, 2], [2, -1, -1]], dtype=torch.int32)
    out = OPS.sparse_mla(q * 1e4, kv, idx, 1.0, 4)  # exp overflows without the max subtraction
    assert out.isfinite().all()
    torch.testing.assert_close(out[1, 0], kv[2])


@settings(deadline=None, max_examples=40)
@given(st.data())
def test_sparse_mla_matches_naive_property(data: st.DataObject) -> None:
    n, t, k = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 6)), data.draw(
        st.integers(0, 5))
    heads, dk = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 5))
    dv = data.draw(st.integers(1, dk))
    q, kv = _mla_case(n, heads, dk, t, data.draw(st.integers(0, 2**31)))
    idx = torch.tensor([[data.draw(st.integers(-1, t - 1)) for _ in range(k)] for _ in range(n)],
                       dtype=torch.int32).reshape(n, k)
    got = OPS.sparse_mla(q, kv, idx, 0.5, dv)
    assert got.shape == (n, heads, dv)
    torch.testing.assert_close(got.double(), torch.tensor(
        naive_sparse_mla(q, kv, idx, 0.5, dv), dtype=torch.float64).reshape(n, heads, dv),
        rtol=1e-5, atol=1e-5)


# ---- no host sync (rule 22) ----------------------------------------------------------------------
def test_attention_ops_never_read_device_data() -> None:
    """On meta tensors any ``.item()``, ``.tolist()``, ``.nonzero()`` or boolean-mask gather
    raises: the ops run there, so they never sync the host."""
    meta, i64 = "meta", torch.int64
    q = torch.empty(5, 64, 128, dtype=torch.bfloat16, device=meta)
    w = torch.empty(5, 64, device=meta)
    ks, ke = torch.empty(5, dtype=i64, device=meta), torch.empty(5, dtype=i64, device=meta)
    for k, scale in ((torch.empty(300, 128, dtype=torch.bfloat16, device=meta), None),
                     (torch.empty(300, 128, dtype=torch.float8_e4m3fn, device=meta),
                      torch.empty(300, device=meta))):
        logits = OPS.indexer_logits(q, w, k, scale, ks, ke)
        assert logits.shape == (5, 300) and logits.device.type == meta
    for topk in (16, 2048):  # k below and above T
        idx = OPS.topk(logits, topk, ks, ke)
        assert idx.shape == (5, topk) and idx.dtype == torch.int32
        out = OPS.sparse_mla(torch.empty(5, 16, 576, dtype=torch.bfloat16, device=meta),
                             torch.empty(300, 576, dtype=torch.bfloat16, device=meta), idx,
                             576 ** -0.5, 512)
        assert out.shape == (5, 16, 512) and out.dtype == torch.float32
    with pytest.raises(RuntimeError):  # the premise: a data-dependent shape would be caught
        torch.empty(3, device=meta).nonzero()


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_attention_ops_do_not_sync_on_cuda() -> None:
    dev = "cuda"
    x = sync_check_inputs(dev)
    q, w, k, scale, k8, ks, ke, kv, qm = (x[n] for n in ("q", "w", "k", "scale", "k8", "ks",
                                                         "ke", "kv", "qm"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kk, sc in ((k, None), (k8, scale)):
            logits = OPS.indexer_logits(q, w, kk, sc, ks, ke)
            for topk in (32, 2048):
                OPS.sparse_mla(qm, kv, OPS.topk(logits, topk, ks, ke), 576 ** -0.5, 512)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- the conformance suite: runs, tolerates ties, catches broken backends ------------------------
@pytest.mark.slow  # 7.5-18 s on 2 shared cores: the whole attention suite
def test_suite_runs_the_attention_ops(ref: Any) -> None:
    names = [o.value for o in ATTN_OPS]
    assert check_backend(TorchOps(), ref, ops=names) == names


class TopkTiesLow(TorchOps):
    """Long rows by a stable descending sort: among tied logits the lowest column wins."""

    high = False

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        out = super().topk(logits, k, key_start, key_end)
        n, t = logits.shape
        kk = min(k, t)
        if not kk:
            return out
        col = torch.arange(t, device=logits.device)
        masked = logits.masked_fill(~((col >= key_start[:, None]) & (col < key_end[:, None])),
                                    NEG_INF)
        if self.high:  # sort the columns reversed: the highest tied column comes first
            order = torch.sort(masked.flip(1), dim=1, descending=True, stable=True).indices
            order = t - 1 - order
        else:
            order = torch.sort(masked, dim=1, descending=True, stable=True).indices
        chosen = torch.cat([order[:, :kk], order.new_full((n, k - kk), -1)], dim=1)
        count = (key_end.clamp(0, t) - key_start.clamp(0, t)).clamp_min(0)
        return torch.where((count <= k)[:, None], out, chosen).to(torch.int32)


class TopkTiesHigh(TopkTiesLow):
    high = True


def test_suite_accepts_any_tie_breaking(ref: Any) -> None:
    # the premise: on tied logits (relu zeros) the two really choose different sets
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0, 2.0]])
    ks, ke = _i64([0]), _i64([5])
    low, high = TopkTiesLow().topk(logits, 3, ks, ke), TopkTiesHigh().topk(logits, 3, ks, ke)
    assert low.tolist() == [[0, 4, 1]] and high.tolist() == [[0, 4, 3]]
    check_op(TopkTiesLow(), ref, "topk")
    check_op(TopkTiesHigh(), ref, "topk")


def test_suite_ties_occur_and_differ(ref: Any) -> None:
    """The suite's logits do hold ties at the k-th place on which the two choices differ (so the
    tie rule is exercised, not vacuous)."""
    from cpkv.testing import conformance as cf

    differ = 0
    for variant in ("indexer", "coarse"):
        for n, t, k in cf.ATTN_SIZES:
            g = torch.Generator().manual_seed(n * 7 + t + k)
            logits, ks, ke = cf._topk_logits(variant, n, t, k, ref, g)
            a = TopkTiesLow().topk(logits, k, ks, ke)
            b = TopkTiesHigh().topk(logits, k, ks, ke)
            differ += int((a.sort(1).values != b.sort(1).values).any(1).sum())
    assert differ > 0


class TopkNoPadding(TorchOps):
    """Fills the unused slots with column 0 instead of -1."""

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        return super().topk(logits, k, key_start, key_end).clamp_min(0)


class TopkAlwaysByLogit(TorchOps):
    """Orders short rows by logit too (not ascending)."""

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        out = super().topk(logits, k, key_start, key_end)
        t = logits.shape[1]
        count = (key_end.clamp(0, t) - key_start.clamp(0, t)).clamp_min(0)
        kk = min(k, t)
        if not kk:
            return out
        col = torch.arange(t, device=logits.device)
        inside = (col >= key_start[:, None]) & (col < key_end[:, None])
        by = torch.topk(logits.masked_fill(~inside, NEG_INF), kk, dim=1).indices
        by = torch.cat([by, by.new_full((logits.shape[0], k - kk), -1)], dim=1)
        by = torch.where(torch.arange(k, device=logits.device) < count[:, None], by, -1)
        return torch.where((count <= k)[:, None], by, out).to(torch.int32)


class TopkAscendingLong(TorchOps):
    """The right set for long rows, but in ascending column order (the contract leaves a full
    row's order to the backend: this one conforms)."""

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        out = super().topk(logits, k, key_start, key_end)
        big = torch.iinfo(torch.int32).max  # -1 slots sort last, then become -1 again
        srt = torch.where(out < 0, big, out).sort(dim=1).values
        return torch.where(srt == big, -1, srt).to(torch.int32)


class TopkSkipsLargest(TorchOps):
    """Long rows take the 2nd to (k+1)-th largest logits: a wrong set."""

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        out = super().topk(logits, k, key_start, key_end)
        wider = super().topk(logits, k + 1, key_start, key_end)
        t = logits.shape[1]
        long = (key_end.clamp(0, t) - key_start.clamp(0, t)) > k
        return torch.where(long[:, None].to(out.device), wider[:, 1:], out)


class IndexerTopkSkipsLargest(TorchOps):
    """The fused op's long rows take the 2nd to (k+1)-th largest logits (topk itself is right)."""

    def indexer_topk(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                     k_scale: torch.Tensor | None, key_start: torch.Tensor,
                     key_end: torch.Tensor, topk: int) -> torch.Tensor:
        logits = self.indexer_logits(q, w, k, k_scale, key_start, key_end)
        out = self.topk(logits, topk, key_start, key_end)
        wider = self.topk(logits, topk + 1, key_start, key_end)
        t = logits.shape[1]
        long = (key_end.clamp(0, t) - key_start.clamp(0, t)) > topk
        return torch.where(long[:, None].to(out.device), wider[:, 1:], out)


class TopkIgnoresRange(TorchOps):
    """Trusts the logits to be -inf outside the range (does not mask finite ones)."""

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        out = super().topk(logits, k, key_start, key_end)
        t = logits.shape[1]
        kk = min(k, t)
        if not kk:
            return out
        raw = torch.topk(logits, kk, dim=1).indices
        raw = torch.cat([raw, raw.new_full((logits.shape[0], k - kk), -1)], dim=1)
        count = (key_end.clamp(0, t) - key_start.clamp(0, t)).clamp_min(0)
        return torch.where((count <= k)[:, None], out, raw).to(torch.int32)


class IndexerNoRelu(TorchOps):
    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        kf = k.float() * (k_scale[:, None] if k_scale is not None else 1.0)
        logits = torch.einsum("nh,nht->nt", w, torch.einsum("nhd,td->nht", q.float(), kf))
        t = k.shape[0]
        col = torch.arange(t, device=q.device)
        inside = (col >= key_start[:, None]) & (col < key_end[:, None])
        return logits.masked_fill(~inside, NEG_INF)


class IndexerIgnoresScale(TorchOps):
    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        return super().indexer_logits(q, w, k.float(), None, key_start, key_end)


class IndexerOffByOneRange(TorchOps):
    """Includes key_end (an inclusive range)."""

    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        return super().indexer_logits(q, w, k, k_scale, key_start,
                                      (key_end + 1).clamp_max(k.shape[0]))


class IndexerInBf16(TorchOps):
    """Rounds the logits to bf16: close, but not fp32."""

    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        out = super().indexer_logits(q, w, k, k_scale, key_start, key_end)
        return out.bfloat16().float()


class PagedIgnoresBlockTable(TorchOps):
    """Reads each request's pages as if they were stored in order (page r * M + p)."""

    def indexer_logits_paged(self, q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor) -> torch.Tensor:
        r, m = block_table.shape
        in_order = torch.arange(r * m, dtype=torch.int32).view(r, m)
        return super().indexer_logits_paged(q, w, pages, fmt, in_order, row_request, key_end)


class PagedOffByOneEnd(TorchOps):
    """Reads one key past each row's key_end (where it exists)."""

    def indexer_logits_paged(self, q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor) -> torch.Tensor:
        end = (key_end + 1).clamp_max(block_table.shape[1] * fmt.page_size)
        return super().indexer_logits_paged(q, w, pages, fmt, block_table, row_request, end)


class MlaNoMask(TorchOps):
    """Treats -1 as column 0 (gathers kv[0] into the softmax)."""

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        if kv.shape[0] == 0:
            return super().sparse_mla(q, kv, indices, scale, dv)
        return super().sparse_mla(q, kv, indices.clamp_min(0), scale, dv)


class MlaNaNOnEmptyRows(TorchOps):
    """A plain softmax: rows without a valid index become NaN."""

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        if kv.shape[0] == 0 or indices.shape[1] == 0:
            return super().sparse_mla(q, kv, indices, scale, dv)
        rows = kv.float()[indices.clamp_min(0).long()]
        s = torch.einsum("nhd,nkd->nhk", q.float(), rows) * scale
        p = torch.softmax(s.masked_fill((indices < 0)[:, None, :], NEG_INF), dim=-1)
        return torch.einsum("nhk,nkd->nhd", p, rows[..., :dv])


class MlaWrongValueWidth(TorchOps):
    """Takes the values from the trailing dv dims instead of the leading ones."""

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        out = super().sparse_mla(q, torch.cat([kv[:, -dv:], kv[:, dv:]], dim=1)
                                 if kv.shape[1] >= 2 * dv else kv.flip(1), indices, scale, dv)
        return out


#: cases that take 10 s or more on 2 CPU cores (the suite's sizes until the broken op is caught)
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(("broken", "op", "match"), [
    (TopkNoPadding, "topk", r"topk \[.*\] indices: the -1 slots differ"),
    (TopkAlwaysByLogit, "topk", r"topk \[.*\] indices: row \d+ holds \d+ <= k=\d+ keys"),
    pytest.param(TopkSkipsLargest, "topk", r"topk \[.*\] indices: row \d+ (picks a different index "
                 r"set|: column \d+ .* is not tied)", marks=_SLOW),
    (IndexerTopkSkipsLargest, "indexer_topk", r"topk \[indexer_topk: .*\] indices: row \d+ "
     r"(picks a different index set|: column \d+ .* is not tied)"),
    pytest.param(TopkIgnoresRange, "topk", r"topk \[finite outside.*\] indices: row \d+ repeats a "
                 r"column or leaves its range", marks=_SLOW),
    pytest.param(IndexerNoRelu, "indexer_logits",
                 r"indexer_logits \[.*\] logits: differs from the reference", marks=_SLOW),
    pytest.param(IndexerIgnoresScale, "indexer_logits", r"indexer_logits \[.*fp8 (q )?keys.*\]",
                 marks=_SLOW),
    pytest.param(IndexerOffByOneRange, "indexer_logits",
                 r"indexer_logits \[.*\] logits: -inf positions", marks=_SLOW),
    pytest.param(IndexerInBf16, "indexer_logits",
                 r"indexer_logits \[.*\] logits: differs.*rtol=1e-05", marks=_SLOW),
    pytest.param(PagedIgnoresBlockTable, "indexer_logits_paged",
                 r"indexer_logits_paged \[.*\] logits: differs from the reference", marks=_SLOW),
    pytest.param(PagedOffByOneEnd, "indexer_logits_paged",
                 r"indexer_logits_paged \[.*\] logits: -inf positions", marks=_SLOW),
    (MlaNoMask, "sparse_mla", r"sparse_mla \[.*\] output: differs from the reference"),
    pytest.param(MlaNaNOnEmptyRows, "sparse_mla", r"sparse_mla \[.*\] output: \d+ NaN value",
                 marks=_SLOW),
    pytest.param(MlaWrongValueWidth, "sparse_mla", r"sparse_mla \[.*\] output: differs",
                 marks=_SLOW),
])
def test_a_broken_attention_backend_fails_the_suite(ref: Any, broken: type, op: str,
                                                    match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        check_op(broken(), ref, op)
    others = [o.value for o in ATTN_OPS if o.value != op]
    assert check_backend(broken(), ref, ops=others) == others  # only the broken op fails


def test_topk_order_of_a_full_row_is_the_backends(ref: Any) -> None:
    """The right sets in ascending column order (not by logit) pass the suite."""
    check_op(TopkAscendingLong(), ref, "topk")
