"""Backend conformance suite: run a backend's ops against the torch reference backend.

A backend author subclasses the base test classes in the backend's own tests (pytest collects
one test per op; :class:`BaseOpsTests` says how)::

    from cpkv.testing.conformance import BaseAttentionOpsTests, BaseKVOpsTests

    class TestMyBackendKV(BaseKVOpsTests):
        ops = MyOps()
        device = "cuda"

or calls the functions directly::

    from cpkv.testing.conformance import check_backend, reference_backend

    checked = check_backend(MyOps(), reference_backend(), device="cuda")

Every op is run on fresh random inputs (never all zeros) at several sizes: 0 rows, 1 row, odd
sizes, 64-token pages with the DeepSeek-V3.2 row sizes (656 B latent, 132 B index-K in fp8) and a
small format. Results must match the reference **bit for bit**: ``page_gather``, ``page_scatter``
and ``rerange`` move bytes; ``fp8_pack`` must produce the same bytes, which pins the formula
(:func:`cpkv.ops.api.quantize_fp8`: the latent's fp32 ``scale = max(amax, 1e-12) / 448`` per block,
the index-K's power of two ``2^ceil(log2(max(amax, 1e-4) * (1/448)))`` (DeepSeek's ue8m0),
``q = e4m3(clamp(x / scale, ±448))`` rounded to nearest even, scales as fp32 and rope as bf16,
little-endian); ``fp8_unpack`` must return the same values (``float32(q) * scale`` cast once to
the requested dtype). A mismatch raises ``AssertionError`` naming the op, the case and the largest difference.

The sparse-attention ops (rule 19) run on flat full views holding several requests, with per-row
key ranges that are empty, shorter than k, exactly k, longer than k, and arbitrary (not starting
at a request), for k both smaller and larger than the T keys, and compare as follows:

* ``indexer_logits``: bf16, fp32 and fp8 keys (e4m3 with a per-token fp32 scale, quantised
  directly and taken as slices of the reference's ``fp8_pack`` index-K rows); the -inf positions
  must be identical, the rest ``allclose(rtol=1e-5, atol=1e-5)`` (:data:`ATTN_RTOL`,
  :data:`ATTN_ATOL`); the inputs are scaled like the model's (``w`` carries ``Hi^-0.5 D^-0.5``)
  so the logits are O(1).
* ``indexer_logits_paged``: part-major pools of fp8, bf16 and fp32 formats read through random
  block tables (pages out of order, spare pages in the pool), several query rows per request,
  key_end at 1, inside a page, on a page boundary and at M x S; the tolerances of
  ``indexer_logits`` (fp8 queries: relative to the largest logit) and -inf exactly at the keys
  at or past key_end.
* ``indexer_logits_index_pages``: the same pools with their index-K in DeepGEMM's page order
  (:func:`index_pages_of`, at two page strides), against the reference's part-major result.
* ``topk``: int32 [N, k]; the -1 slots must be exactly the reference's; rows whose range holds
  at most k keys must equal the reference (all keys, ascending); longer rows must list distinct
  columns inside the range, in any order, forming the reference's index set.
  **Tie rule**: the sets may differ only when the k-th and (k+1)-th largest logits of the row
  are equal within :data:`TOPK_TIE_REL` relative (``|a - b| <= 1e-6 * max(|a|, |b|)``), and then
  every column in the symmetric difference must have a logit within that tolerance of the k-th
  one. Logits come from the reference indexer (exact 0.0 ties from the relu), from random values
  that are finite outside the ranges (a backend must mask them itself), and from values rounded
  to a coarse grid (many ties), and from DeepSeek-V3.2's fp8 indexer (below).
* the fp8 indexer's choice: rotated ue8m0 queries and keys from random bf16 values, and e4m3
  integer grids whose dots are exact in any accumulator. ``indexer_logits``: the reference's
  top-k of the backend's logits must choose the reference's keys (by the tie rule above);
  ``topk``: the backend's top-k of the reference's logits likewise. Together the backend's
  whole fp8 indexer chooses the reference's keys, and a broken op fails only its own check.
* ``indexer_topk`` (the indexer and the top-k as one op): the reference's top-k of the
  reference's logits by the tie rule above, on the fp8 indexer's cases and on bf16 / fp32 keys
  (4 heads: many 0.0 ties) at the attention sizes.
* ``sparse_mla``: ``allclose(rtol=1e-5, atol=1e-5)``, no NaN; indices from the reference top-k
  (-1 padded suffixes, all -1 rows) and random ones with -1 anywhere and repeats.

DeepSeek-V4's ops (``v4_compress``, ``v4_index_scores``, ``v4_attention``) compare within
:data:`ATTN_RTOL` / :data:`ATTN_ATOL` with the -inf positions identical, on empty calls, a
single row, rows of no key, CSA windows with and without a prior window and HCA's; ``v4_topk``
bit for bit on scores with many ties (rule 39 fixes the choice and its order).

Inputs are generated on the CPU from ``seed`` and then moved to ``device``, so a CUDA backend sees
exactly the inputs the CPU reference sees. Needs torch (a cpkv-core dependency); never imports a
backend package: :func:`reference_backend` goes through the plugin registry.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from cpkv.contracts import KVDtype, KVFormat, KVOps, KVPart, Op
from cpkv.kv import pack_rows
from cpkv.ops.api import fp8_layout, hadamard_rotate, quantize_fp8, quantize_index_q
from cpkv.plugin import PluginHost

__all__ = [
    "ATTN_ATOL",
    "ATTN_RTOL",
    "CHECKS",
    "FORMATS",
    "FP8_ROUND_TRIP_ABS",
    "FP8_ROUND_TRIP_REL",
    "INDEX_Q_SAME_CODES",
    "TOPK_TIE_REL",
    "BaseAllOpsTests",
    "BaseAttentionOpsTests",
    "BaseFP8OpsTests",
    "BaseKVOpsTests",
    "BaseNormOpsTests",
    "BaseOpsTests",
    "BasePageOpsTests",
    "BaseQuantOpsTests",
    "BaseRopeOpsTests",
    "abs_fp8",
    "abs_index_pages",
    "check_backend",
    "check_fp8_round_trip",
    "check_op",
    "index_pages_of",
    "reference_backend",
]

#: formats every fp8 check runs: DeepSeek-V3.2 (656 B / 132 B rows) and a small one
FORMATS: dict[str, KVFormat] = {
    "deepseek_v32": KVFormat.deepseek_v32(KVDtype.FP8),
    "small": KVFormat(dtype=KVDtype.FP8, kv_lora_rank=64, rope_dim=16, index_head_dim=32,
                      quant_block=32, page_size=64),
}

#: row counts every op runs at: empty, one row, odd sizes, one and several 64-token pages
ROWS: tuple[int, ...] = (0, 1, 3, 17, 64, 131)
#: page counts of the cases that move whole 64-token pages (42 KB each in fp8): kept small
PAGES: tuple[int, ...] = (0, 1, 3, 17)

#: Bound of the fp8 round trip, per element: |x - unpack(pack(x))| <= REL * |x| + ABS * scale.
#: e4m3 has 3 mantissa bits, so rounding a normal value to nearest is off by at most half an ulp,
#: 2^-4 of the value; values below the smallest normal (2^-6 in scaled units, i.e. 2^-6 / 448 of
#: the block's amax) are on a fixed grid of 2^-9 and are off by at most 2^-10 in scaled units,
#: i.e. 2^-10 * scale. The fp32 division and multiplication around it add ~2^-23 relative, which
#: the 2^-20 slack covers. Hence the per block relative error max|x - x'| / amax <= 2^-4 + 2^-20.
FP8_ROUND_TRIP_REL = 2.0**-4 + 2.0**-20
FP8_ROUND_TRIP_ABS = 2.0**-10 + 2.0**-20

#: tolerances of ``indexer_logits`` and ``sparse_mla`` against the reference (fp32 results)
ATTN_RTOL = 1e-5
ATTN_ATOL = 1e-5
#: fp8 x fp8 indexer dots: Hopper's fp8 tensor cores accumulate with fewer mantissa bits than
#: fp32 (a Hopper GPU gave 6.3e-4 absolute on logits of a few units; 1.7e-4 of the row maximum at
#: 1024 x 32K), so each fp8-query logit is compared relative to its terms' absolute sum
#: (``_assert_logits``)
FP8_DOT_REL = 2e-3
#: sparse_mla with 16-bit q/kv: "within dtype tolerance" of the fp32 reference. A kernel that feeds
#: bf16 probabilities to the value matmul (FlashMLA does) is ~4e-3 off; masking or indexing bugs are
#: O(1) off, so this still catches them
LOWP_MLA_REL = 1e-2
#: two logits within this relative distance are a tie: top-k may pick either
TOPK_TIE_REL = 1e-6


# ---- comparison ------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (so -0.0 != 0.0 and NaN == NaN of the same payload)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.numel() == 0:
        return "n/a"
    if a.dtype == torch.uint8 or a.dtype == torch.float8_e4m3fn:
        diff = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
        unit = " (byte value)"
    else:
        diff = (a.double() - b.double()).abs()
        unit = ""
    bad = (_bits(a).reshape(a.shape[0], -1) != _bits(b).reshape(b.shape[0], -1)).any(dim=1)
    rows = bad.nonzero().flatten()[:5].tolist()  # host sync: fine in a test helper
    return f"{diff.max().item()}{unit}; {int(bad.sum())} row(s) differ, first {rows}"


def _assert_like(prefix: str, got: Any, want: torch.Tensor) -> None:
    """``got`` is a tensor of ``want``'s shape, dtype and device type."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{prefix}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{prefix}: got {got.dtype} {tuple(got.shape)}, expected "
                             f"{want.dtype} {tuple(want.shape)}; max difference n/a")
    if got.device.type != want.device.type:
        raise AssertionError(f"{prefix}: result on {got.device}, expected {want.device}")


def _assert_same(op: str, case: str, what: str, got: Any, want: torch.Tensor,
                 against: str = "the reference") -> None:
    """``got`` equals ``want`` bit for bit (shape, dtype, device, bytes)."""
    prefix = f"{op} [{case}] {what}"
    _assert_like(prefix, got, want)
    if not torch.equal(_bits(got).cpu(), _bits(want).cpu()):
        raise AssertionError(f"{prefix}: differs from {against}; max difference "
                             f"{_max_diff(got.cpu(), want.cpu())}")


def _call(op: str, case: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; an exception becomes an AssertionError that names the op and the case."""
    try:
        return fn(*args)
    except Exception as exc:
        raise AssertionError(f"{op} [{case}]: raised {exc!r}") from exc


# ---- inputs ----------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _nonzero(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator,
             spread: bool = False) -> torch.Tensor:
    """Random values of ``dtype`` with no zero element (bytes in 1..255, floats away from 0)."""
    if dtype == torch.uint8:
        return torch.randint(1, 256, shape, generator=g, dtype=torch.uint8)
    x = torch.randn(shape, generator=g)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
    if spread and len(shape) >= 1 and shape[0]:
        # rows of very different magnitudes, so that scales span many binades
        x = x * torch.pow(10.0, torch.empty(shape[0], *(1,) * (len(shape) - 1)).uniform_(
            -4, 4, generator=g))
    return x.to(dtype)


def _row_shapes() -> Iterator[tuple[str, tuple[int, ...], torch.dtype, tuple[int, ...]]]:
    """(label, trailing shape, dtype, row counts) of the tensors gather/scatter/rerange move."""
    ds, small = FORMATS["deepseek_v32"], FORMATS["small"]
    ps = ds.page_size
    yield "latent page fp8", (ps, ds.latent_bytes_per_token), torch.uint8, PAGES  # 64 x 656 B
    yield "index-K page fp8", (ps, ds.index_bytes_per_token), torch.uint8, PAGES  # 64 x 132 B
    yield "latent row fp8", (ds.latent_bytes_per_token,), torch.uint8, ROWS
    yield "index-K row fp8", (ds.index_bytes_per_token,), torch.uint8, ROWS
    yield "small latent row fp8", (small.latent_bytes_per_token,), torch.uint8, ROWS
    yield "latent row bf16", (ds.kv_lora_rank + ds.rope_dim,), torch.bfloat16, ROWS
    yield "odd fp32 rows", (3, 5), torch.float32, ROWS


def _to(device: str | torch.device, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in ts]


def _unchanged(op: str, case: str, before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        _assert_same(op, case, f"input #{i} (must not be modified)", a, b,
                     against="its value before the call")


def _check_row_copy(op: str, case: str, impl: Any, ref: Any, args: tuple[Any, ...],
                    inputs: list[torch.Tensor], independent: torch.Tensor, against: str,
                    contiguous: bool) -> None:
    """A row-moving op on ``args``: equal to the reference, inputs untouched, equal to an
    ``independent`` formula (so that a wrong reference cannot pass with a wrong backend), and a
    contiguous result where the spec says so."""
    keep = [t.clone() for t in inputs]
    want = getattr(ref, op)(*args)
    got = _call(op, case, getattr(impl, op), *args)
    _assert_same(op, case, "output", got, want)
    _unchanged(op, case, keep, inputs)
    _assert_same(op, case, "output", got, independent, against=against)
    if contiguous and not got.is_contiguous():
        raise AssertionError(f"{op} [{case}]: output is not contiguous")


# ---- per-op checks ---------------------------------------------------------------------------
def _check_page_gather(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "page_gather"
    for k, (label, row, dtype, counts) in enumerate(_row_shapes()):
        for j, n in enumerate(counts):
            g = _gen(seed * 1000 + k * 10 + j)
            pages = max(1, n // 2 + 1)  # fewer pages than rows: indices repeat
            case = f"{label}, {n} rows from {pages}"
            src = _nonzero((pages, *row), dtype, g)
            index = torch.randint(0, pages, (n,), generator=g, dtype=torch.int64)
            src, index = _to(device, src, index)
            _check_row_copy(op, case, impl, ref, (src, index), [src, index],
                            src[index], "src[index]", contiguous=True)


def _check_peer_gather(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "peer_gather"
    for k, (label, row, dtype, counts) in enumerate(_row_shapes()):
        for j, n in enumerate(counts):
            for c in (1, 2, 3, 9):  # 9 > one launch's sources (8)
                g = _gen(seed * 1000 + k * 100 + j * 10 + c)
                sizes = [max(1, n // c + 1 + r) for r in range(c)]  # buffers differ in rows
                case = f"{label}, {n} rows from {c} buffers of {sizes} rows"
                srcs = [_nonzero((m, *row), dtype, g) for m in sizes]
                owner = torch.randint(0, c, (n,), generator=g, dtype=torch.int64)
                lim = torch.tensor(sizes, dtype=torch.int64)[owner]
                rows = (torch.rand(n, generator=g) * lim).long().clamp(max=lim - 1)
                *srcs, owner, rows = _to(device, *srcs, owner, rows)
                indep = torch.empty((0, *row), dtype=dtype, device=owner.device) if not n else \
                    torch.stack([srcs[a][b] for a, b in zip(owner.tolist(), rows.tolist(),
                                                            strict=True)])
                _check_row_copy(op, case, impl, ref, (srcs, owner, rows), [*srcs, owner, rows],
                                indep, "srcs[owner[i]][rows[i]]", contiguous=True)


def _check_page_scatter(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "page_scatter"
    for k, (label, row, dtype, counts) in enumerate(_row_shapes()):
        for j, n in enumerate(counts):
            g = _gen(seed * 1000 + 500 + k * 10 + j)
            pages = n + 1 + n // 2  # always some untouched rows
            case = f"{label}, {n} rows into {pages}"
            poison = _nonzero((pages, *row), dtype, g)
            index = torch.randperm(pages, generator=g)[:n]
            src = _nonzero((n, *row), dtype, g)
            poison, index, src = _to(device, poison, index, src)
            keep = [index.clone(), src.clone()]
            want = poison.clone()
            ref.page_scatter(want, index, src)
            got = poison.clone()
            ret = _call(op, case, impl.page_scatter, got, index, src)
            if ret is not None:
                raise AssertionError(f"{op} [{case}]: must return None (in place), got "
                                     f"{type(ret).__name__}")
            _assert_same(op, case, "destination", got, want)
            _unchanged(op, case, keep, [index, src])
            expect = poison.clone()
            expect[index] = src
            _assert_same(op, case, "destination", got, expect,
                         against="dst[index] = src with every other row untouched")


def _check_page_copy(impl: Any, ref: Any, device: str, seed: int) -> None:
    """Device to device (also within one buffer), and on a GPU pinned host memory to the
    device and back (the host tier's load and save)."""
    op = "page_copy"
    cuda = torch.device(device).type == "cuda"
    homes = [("device", "device"), ("same buffer", "same")]
    if cuda:
        homes += [("host to device", "from_host"), ("device to host", "to_host")]
    for k, (label, row, dtype, counts) in enumerate(_row_shapes()):
        for j, n in enumerate(counts):
            for h, (where, kind) in enumerate(homes):
                g = _gen(seed * 1000 + 700 + k * 40 + j * 4 + h)
                pages = 2 * n + 1  # always some untouched rows
                case = f"{label}, {n} rows, {where}"
                perm = torch.randperm(pages, generator=g)
                dst_index, src_index = perm[:n], torch.randperm(pages, generator=g)[:n]
                if kind == "same":  # disjoint rows of one buffer
                    dst_index, src_index = perm[:n], perm[n:2 * n]
                src = _nonzero((pages, *row), dtype, g)
                dst = _nonzero((pages, *row), dtype, g)
                expect = dst.clone()
                if kind == "same":
                    expect[dst_index] = dst[src_index]
                else:
                    expect[dst_index] = src[src_index]
                dst_index, src_index = _to(device, dst_index, src_index)
                src = src.pin_memory() if kind == "from_host" else _to(device, src)[0]
                dst = dst.pin_memory() if kind == "to_host" else _to(device, dst)[0]
                if kind == "same":
                    src = dst
                keep = [dst_index.clone(), src_index.clone(), src.clone()]
                got = dst.clone() if kind != "to_host" else dst.clone().pin_memory()
                want = got.clone()
                if kind == "same":
                    ref.page_copy(want, dst_index, want, src_index)
                    ret = _call(op, case, impl.page_copy, got, dst_index, got, src_index)
                else:
                    ref.page_copy(want, dst_index, src, src_index)
                    ret = _call(op, case, impl.page_copy, got, dst_index, src, src_index)
                if ret is not None:
                    raise AssertionError(f"{op} [{case}]: must return None (in place), got "
                                         f"{type(ret).__name__}")
                if cuda:
                    torch.cuda.synchronize()
                _assert_same(op, case, "destination", got.to(device), want.to(device))
                _assert_same(op, case, "destination", got.cpu(), expect.cpu(),
                             against="dst[dst_index] = src[src_index], every other row untouched")
                if kind != "same":
                    _unchanged(op, case, keep, [dst_index, src_index, src])


def _check_page_rows(impl: Any, ref: Any, device: str, seed: int) -> None:
    """Keys in [-1, M * S) (a strided slice of wider rows, -1 among them), block tables of
    random slots, rows of several requests, page sizes 1, 7 (not a power of two), 16 and 64,
    no rows and no keys: the reference's int32 rows exactly, inputs unchanged."""
    op = "page_rows"
    g = _gen(seed + 17)
    for s, (n, k, reqs, m) in ((1, (5, 3, 2, 4)), (7, (9, 33, 3, 5)), (16, (64, 2048, 64, 40)),
                               (64, (17, 100, 4, 9)), (16, (0, 8, 2, 3)), (16, (3, 0, 2, 3))):
        case = f"S={s} keys [{n}, {k}] over {reqs} requests x {m} pages"
        table = torch.randint(0, 5000, (reqs, m), generator=g, dtype=torch.int32)
        request = torch.randint(0, reqs, (n,), generator=g, dtype=torch.int32)
        wide = torch.randint(-1, m * s, (n, k + 3), generator=g, dtype=torch.int32)
        table, request, wide = _to(device, table, request, wide)
        keys = wide[:, 3:]
        keep = [table.clone(), request.clone(), wide.clone()]
        want = ref.page_rows(keys, table, request, s)
        got = _call(op, case, impl.page_rows, keys, table, request, s)
        _unchanged(op, case, keep, [table, request, wide])
        _assert_same(op, case, "rows", got, want)


def _check_rerange(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "rerange"
    for k, (label, row, dtype, counts) in enumerate(_row_shapes()):
        # (natural rows, C, max_rank_len): sometimes padded past the longest rank, and 0 rows
        # both from an empty gather and from a non-empty one
        cases = [(n, 1 + j % 4, -(-n // (1 + j % 4)) + j % 2) for j, n in enumerate(counts)]
        for j, (n, cp, max_rank_len) in enumerate([*cases, (0, 2, 1)]):
            g = _gen(seed * 1000 + 800 + k * 10 + j)
            rows = cp * max_rank_len
            case = f"{label}, {n} rows from {cp} x {max_rank_len} gathered"
            gathered = _nonzero((rows, *row), dtype, g)
            perm = torch.randperm(rows, generator=g)[:n]
            gathered, perm = _to(device, gathered, perm)
            _check_row_copy(op, case, impl, ref, (gathered, perm), [gathered, perm],
                            gathered[perm], "gathered[perm]", contiguous=False)


def _fp8_cases() -> Iterator[tuple[str, KVFormat, str, int]]:
    for fname, fmt in FORMATS.items():
        for part in ("latent", "index_k"):
            for n in ROWS:
                yield f"{fname} {part}, {n} rows", fmt, part, n


def _fp8_input(fmt: KVFormat, part: str, n: int, dtype: torch.dtype,
               g: torch.Generator) -> torch.Tensor:
    d = fmt.kv_lora_rank + fmt.rope_dim if part == "latent" else fmt.index_head_dim
    return _nonzero((n, d), dtype, g, spread=True)


def _check_fp8_pack(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "fp8_pack"
    for k, (label, fmt, part, n) in enumerate(_fp8_cases()):
        for dtype in (torch.bfloat16, torch.float32):
            case = f"{label}, {str(dtype).removeprefix('torch.')} input"
            (x,) = _to(device, _fp8_input(fmt, part, n, dtype, _gen(seed * 1000 + k)))
            keep = [x.clone()]
            want = ref.fp8_pack(x, fmt, part)
            got = _call(op, case, impl.fp8_pack, x, fmt, part)
            _assert_same(op, case, "bytes", got, want)
            _unchanged(op, case, keep, [x])


def _store_views(b: torch.Tensor, ps: int, nbytes: int, sbytes: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fp8_store``'s destinations in a test buffer: [S, P, nbytes] rows of a page block (2-D:
    after 7 tokens' bytes of another part), of token rows (3-D: a column slice), or (2-D with
    ``sbytes``: the two_part index-K's page) the values' rows then the scales' rows."""
    if b.dim() == 3:
        return b[:, :, 5:5 + nbytes], None
    if not sbytes:
        return b[:, 7 * ps:7 * ps + ps * nbytes].view(-1, ps, nbytes), None
    vb = nbytes - sbytes
    return (b[:, :ps * vb].view(-1, ps, vb),
            b[:, ps * vb:ps * nbytes].view(-1, ps, sbytes))


def _check_fp8_store(impl: Any, ref: Any, device: str, seed: int) -> None:
    """Rows (bf16, fp32) quantized into pages full of other bytes: one part of part-major page
    blocks (a page stride wider than its tokens), a column slice of token-major rows (token
    stride wider than the part) and the two_part layout's pages (values, then scales:
    ``scale_dst``), rows in random order with one named twice (equal x rows, a padded decode
    batch), an empty call. Without ``rotate`` every byte of the pages equals the reference's;
    with it (index-K) the bytes outside the written rows do, and the written rows' codes and
    scales pass :func:`_assert_rotated_codes`."""
    op = "fp8_store"
    for k, (label, fmt, part_name, n) in enumerate(_fp8_cases()):
        part: KVPart = "latent" if part_name == "latent" else "index_k"
        dims, block, _, nbytes = fp8_layout(fmt, part)
        sbytes = 4 * (dims // block)
        ps, slots = fmt.page_size, n // 8 + 3
        g = _gen(seed * 1000 + 600 + k)
        for dtype in (torch.bfloat16, torch.float32):
            x = _fp8_input(fmt, part, n, dtype, g)
            rows = torch.randperm(slots * ps, generator=g)[:n]
            if n > 2:
                rows[-1] = rows[0]
                x[-1] = x[0]
            blocks = torch.randint(0, 256, (slots, ps * (nbytes + 12)), dtype=torch.uint8,
                                   generator=g)
            tokens = torch.randint(0, 256, (slots, ps, nbytes + 9), dtype=torch.uint8,
                                   generator=g)
            x, rows, blocks, tokens = _to(device, x, rows, blocks, tokens)
            for where, buf, sb in (("part-major block", blocks, 0),
                                   ("token-major slice", tokens, 0),
                                   ("two_part page (scales apart)", blocks, sbytes)):
                for rotate in (False, True) if part == "index_k" else (False,):
                    case = (f"{label}, {str(dtype).removeprefix('torch.')} rows into a {where}"
                            f"{', rotated' if rotate else ''}")
                    keep = [x.clone(), rows.clone()]
                    want, got = buf.clone(), buf.clone()
                    ref.fp8_store(x, fmt, part, *_store_views(want, ps, nbytes, sb)[:1], rows,
                                  rotate, _store_views(want, ps, nbytes, sb)[1])
                    gd, gs = _store_views(got, ps, nbytes, sb)
                    _call(op, case, impl.fp8_store, x, fmt, part, gd, rows, rotate,
                          *(() if gs is None else (gs,)))
                    _unchanged(op, case, keep, [x, rows])
                    if not rotate or n == 0:
                        _assert_same(op, case, "pages", got, want)
                        continue
                    (gv, gsv), (wv, wsv) = (_store_views(got, ps, nbytes, sb),
                                            _store_views(want, ps, nbytes, sb))
                    page, off = rows // ps, rows % ps
                    g_rows, w_rows = gv[page, off].cpu(), wv[page, off].cpu()
                    g_sc = (g_rows[:, dims:dims + 4] if gsv is None else gsv[page, off].cpu())
                    w_sc = (w_rows[:, dims:dims + 4] if wsv is None else wsv[page, off].cpu())
                    for v in (gv, wv, gsv, wsv):
                        if v is not None:
                            v[page, off] = 0
                    _assert_same(op, case, "bytes outside the written rows", got, want)
                    _assert_rotated_codes(
                        op, case, g_rows[:, :dims],
                        g_sc.contiguous().view(torch.float32).double(), w_rows[:, :dims],
                        w_sc.contiguous().view(torch.float32).double())


def _check_fp8_unpack(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "fp8_unpack"
    for k, (label, fmt, part, n) in enumerate(_fp8_cases()):
        (x,) = _to(device, _fp8_input(fmt, part, n, torch.float32, _gen(seed * 1000 + 300 + k)))
        packed = ref.fp8_pack(x, fmt, part)  # valid bytes: no NaN codes, positive scales
        keep = [packed.clone()]
        for dtype in (torch.bfloat16, torch.float32):
            case = f"{label}, to {str(dtype).removeprefix('torch.')}"
            want = ref.fp8_unpack(packed, fmt, part, dtype)
            got = _call(op, case, impl.fp8_unpack, packed, fmt, part, dtype)
            _assert_same(op, case, "values", got, want)
            _unchanged(op, case, keep, [packed])
        # with an index (repeats, any order) over column slices of wider token rows: the gather
        # fused into the pass, as a full view is read where the materialization left it
        g = _gen(seed * 1000 + 400 + k)
        n_rows = packed.shape[0]
        wide = torch.randint(0, 256, (n_rows, packed.shape[1] + 12), dtype=torch.uint8,
                             generator=g).to(packed.device)
        wide[:, 5:5 + packed.shape[1]] = packed
        rows = wide[:, 5:5 + packed.shape[1]]
        idx = torch.randint(0, max(n_rows, 1), (n_rows + 3,), generator=g).to(packed.device) \
            if n_rows else torch.zeros(0, dtype=torch.int64, device=packed.device)
        keep = [wide.clone()]
        for dtype in (torch.bfloat16, torch.float32):
            case = f"{label}, to {str(dtype).removeprefix('torch.')}, through an index"
            want = ref.fp8_unpack(packed.index_select(0, idx), fmt, part, dtype)
            got = _call(op, case, impl.fp8_unpack, rows, fmt, part, dtype, idx)
            _assert_same(op, case, "values", got, want)
            _unchanged(op, case, keep, [wide])


# ---- sparse attention (rule 19) ------------------------------------------------------------
#: (rows N, keys T, k) of the attention cases: empty, k larger than T (T < k even with all keys
#: of a row), k smaller than T, and DeepSeek-V3.2's k = 2048 both above and below T
ATTN_SIZES: tuple[tuple[int, int, int], ...] = (
    (0, 0, 8), (0, 50, 8), (1, 1, 8), (3, 5, 8), (17, 40, 8), (17, 40, 64), (64, 200, 16),
    (131, 300, 64), (5, 700, 2048), (7, 2600, 2048))


def _requests(t: int, g: torch.Generator) -> list[tuple[int, int]]:
    """(start, length) of 1-3 requests that tile the flat view of ``t`` keys (none when t = 0)."""
    if t == 0:
        return []
    parts = min(t, 1 + int(torch.randint(0, 3, (1,), generator=g)))
    cuts = sorted(torch.randperm(t - 1, generator=g)[:parts - 1].add(1).tolist()) if t > 1 else []
    bounds = [0, *cuts, t]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


def _key_ranges(n: int, t: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 key_start / key_end [n] in a flat view of ``t`` keys holding several requests.

    Row ``i`` cycles through: empty, shorter than k, exactly min(k, request), the whole request
    (longer than k when the request is), a causal prefix of random length, then alternately the
    whole flat view (longer than k whenever T is) and an arbitrary range of it (both cross
    requests).
    """
    reqs = _requests(t, g)
    ks, ke = [], []

    def rnd(lo: int, hi: int) -> int:  # uniform in [lo, hi]
        return lo + int(torch.randint(0, hi - lo + 1, (1,), generator=g))

    for i in range(n):
        if not reqs:
            ks.append(0)
            ke.append(0)
            continue
        start, length = reqs[rnd(0, len(reqs) - 1)]
        kind = i % 6
        if kind == 0:
            a = rnd(start, start + length)
            b = a
        elif kind == 1:
            a, b = start, start + rnd(1, max(1, min(k - 1, length)))
        elif kind == 2:
            a, b = start, start + min(k, length)
        elif kind == 3:
            a, b = start, start + length
        elif kind == 4:
            a, b = start, start + rnd(1, length)
        elif i % 12 == 5:
            a, b = 0, t
        else:
            a = rnd(0, t)
            b = rnd(a, t)
        ks.append(a)
        ke.append(b)
    return torch.tensor(ks, dtype=torch.int64), torch.tensor(ke, dtype=torch.int64)


def _assert_close(op: str, case: str, what: str, got: Any, want: torch.Tensor,
                  rtol: float = ATTN_RTOL, atol: float = ATTN_ATOL) -> None:
    """Same shape, dtype and device; the same +-inf positions; finite values within
    ``ATTN_RTOL`` / ``ATTN_ATOL``; no NaN."""
    prefix = f"{op} [{case}] {what}"
    _assert_like(prefix, got, want)
    a, b = got.detach().cpu(), want.detach().cpu()
    if bool(a.isnan().any()):
        raise AssertionError(f"{prefix}: {int(a.isnan().sum())} NaN value(s)")
    for name, pat in (("-inf", torch.isneginf), ("+inf", torch.isposinf)):
        if not torch.equal(pat(a), pat(b)):
            bad = (pat(a) != pat(b)).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten()
            raise AssertionError(f"{prefix}: {name} positions differ from the reference in "
                                 f"{bad.numel()} row(s), first {bad[:5].tolist()}")
    fin = b.isfinite()
    if not torch.allclose(a[fin], b[fin], rtol=rtol, atol=atol):
        diff = (a[fin].double() - b[fin].double()).abs()
        raise AssertionError(f"{prefix}: differs from the reference beyond rtol={rtol}, "
                             f"atol={atol:.3g}; max difference {diff.max().item():.3g}")


def _indexer_inputs(fmt_name: str, n: int, t: int, g: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = FORMATS[fmt_name]
    heads, d = (64, fmt.index_head_dim) if fmt_name == "deepseek_v32" else (4, fmt.index_head_dim)
    q = _nonzero((n, heads, d), torch.bfloat16, g)
    w = _nonzero((n, heads), torch.float32, g) * (heads ** -0.5 * d ** -0.5)
    k = _nonzero((t, d), torch.float32, g)
    return q, w, k


def _indexer_keys(k: torch.Tensor, kind: str, fmt: KVFormat, ref: Any
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kind == "bf16":
        return k.to(torch.bfloat16), None
    if kind == "fp32":
        return k, None
    if kind == "fp8":
        return quantize_fp8(k, None, "ue8m0")  # per-token scale, like the pool's index-K
    # "fp8 pool": e4m3 bytes and scale as slices of packed index-K rows (the e4m3 part is a
    # strided view, as the pool hands it out)
    packed = ref.fp8_pack(k, fmt, "index_k")
    d = fmt.index_head_dim
    return (packed[:, :d].view(torch.float8_e4m3fn),
            packed[:, d:].clone(memory_format=torch.contiguous_format).view(torch.float32)[:, 0])


def _check_indexer_logits(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "indexer_logits"
    j = 0
    for fmt_name in FORMATS:
        fmt = FORMATS[fmt_name]
        kinds = ("bf16", "fp32", "fp8", "fp8 pool", "fp8 q") if fmt_name == "deepseek_v32" else (
            "bf16", "fp8", "fp8 q")
        for n, t, topk in ATTN_SIZES:
            for kind in kinds:
                j += 1
                g = _gen(seed * 1000 + 100 + j)
                case = f"{fmt_name}, {kind} keys, {n} rows x {t} keys"
                q, w, k = _indexer_inputs(fmt_name, n, t, g)
                ks, ke = _key_ranges(n, t, topk, g)
                keys, scale = _indexer_keys(k, "fp8" if kind == "fp8 q" else kind, fmt, ref)
                if kind == "fp8 q":  # fp8 x fp8: q quantized, its scales folded into w
                    q, w = quantize_index_q(q, w)
                q, w, keys, ks, ke = _to(device, q, w, keys, ks, ke)
                if scale is not None:
                    (scale,) = _to(device, scale)
                keep = [x.clone() for x in (q, w, keys, ks, ke)]
                want = ref.indexer_logits(q, w, keys, scale, ks, ke)
                got = _call(op, case, impl.indexer_logits, q, w, keys, scale, ks, ke)
                mag = ref.indexer_logits(abs_fp8(q), w.abs(), abs_fp8(keys), scale, ks, ke) if (
                    kind == "fp8 q") else None
                _assert_logits(op, case, got, want, mag)
                _unchanged(op, case, keep, [q, w, keys, ks, ke])
                # independent of the reference: -inf exactly outside each row's range
                col = torch.arange(t)
                outside = ~((col >= ks.cpu()[:, None]) & (col < ke.cpu()[:, None]))
                if not torch.equal(got.cpu().isneginf(), outside):
                    raise AssertionError(f"{op} [{case}] logits: -inf is not exactly the "
                                         f"positions outside [key_start, key_end)")
    _check_fp8_indexer_topk(impl, ref, device, seed)


def _assert_logits(op: str, case: str, got: Any, want: torch.Tensor,
                   magnitude: torch.Tensor | None = None) -> None:
    """Indexer logits against the reference: the attention tolerances, or with fp8 queries
    (fp8 x fp8 dots: ``magnitude`` given) each logit within ``FP8_DOT_REL`` of its magnitude
    (the same logits of the absolute values, ``sum_h |w_h| |q_h| . |k|``: a sum's rounding
    error is bounded by its terms' absolute sum, not by the sum, which the heads' signed
    weights can cancel; sm90's fp8 tensor cores accumulate each wgmma's products in reduced
    precision)."""
    if magnitude is None:
        _assert_close(op, case, "logits", got, want)
        return
    _assert_close(op, case, "logits", got, want, 0.0, float("inf"))  # shape, NaN, +-inf places
    a, b, m = got.detach().cpu().double(), want.cpu().double(), magnitude.cpu().double()
    fin = b.isfinite()
    excess = (a[fin] - b[fin]).abs() - (FP8_DOT_REL * m[fin] + ATTN_ATOL)
    if excess.numel() and bool((excess > 0).any()):
        i = int(excess.argmax())
        raise AssertionError(
            f"{op} [{case}] logits: differ from the reference beyond {FP8_DOT_REL} of their "
            f"magnitude (+{ATTN_ATOL:.3g}) at {int((excess > 0).sum())} place(s); worst "
            f"|diff| {float((a[fin] - b[fin]).abs()[i]):.3g}, magnitude {float(m[fin][i]):.3g}")


def abs_fp8(x: torch.Tensor) -> torch.Tensor:
    """|x| of e4m3 values (the sign bit cleared), other dtypes ``x.abs()``."""
    if x.dtype != torch.float8_e4m3fn:
        return x.abs()
    return (x.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def abs_index_pages(pages: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """A copy of part-major pool pages (uint8 [P, S, B]) whose index-K values are their absolute
    values (fp8: sign bits cleared, the scales kept; float formats: ``abs``)."""
    out = pages.clone()
    p, ps = out.shape[0], fmt.page_size
    idx = out.view(p, -1)[:, ps * fmt.latent_bytes_per_token:].view(p, ps, -1)
    d = fmt.index_head_dim
    if fmt.dtype is KVDtype.FP8:
        idx[..., :d] &= 0x7F
    else:
        kdt = torch.float32 if fmt.dtype is KVDtype.FP32 else torch.bfloat16
        vals = idx[..., :d * kdt.itemsize].view(kdt)
        vals.copy_(vals.abs())
    return out


#: ``indexer_logits_paged`` cases: (requests, pages per request M, query rows per request)
PAGED_INDEXER_SIZES: tuple[tuple[int, int, int], ...] = ((0, 2, 1), (1, 1, 1), (2, 3, 2),
                                                         (3, 4, 3))


def _paged_pool(fmt: KVFormat, pages: int, ref: Any, g: torch.Generator) -> torch.Tensor:
    """A part-major pool layer of ``pages`` pages of random latent and index-K rows, packed by
    the reference (fp8) or stored as the format's floats: uint8 [pages, S, B]."""
    ps, nl = fmt.page_size, fmt.latent_bytes_per_token
    lat = pack_rows(torch.randn(pages * ps, fmt.kv_lora_rank + fmt.rope_dim, generator=g), fmt,
                    "latent", ref)
    idx = pack_rows(torch.randn(pages * ps, fmt.index_head_dim, generator=g), fmt, "index_k",
                    ref)
    buf = torch.cat([lat.reshape(pages, ps * nl), idx.reshape(pages, -1)], 1)
    return buf.reshape(pages, ps, -1).contiguous()


def _paged_rows(fmt: KVFormat, requests: int, m: int, per: int, g: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(block_table int32 [R, M], row_request int32 [N], key_end int64 [N], pool pages) of a
    decode step: a request's M pages are random distinct slots of a pool holding spare pages
    (not contiguous, not in order); its ``per`` rows (speculative tokens) end at consecutive
    keys, the last one at a length that cycles through 1, mid-page, a page boundary, M * S and a
    random one (the first rows of a length-1 request are empty)."""
    ps = fmt.page_size
    pool = requests * m + 3
    table = torch.randperm(pool, generator=g)[:requests * m].reshape(requests, m)
    lengths = []
    for r in range(requests):
        kind = r % 5
        if kind == 0:
            length = 1
        elif kind == 1:
            length = (m - 1) * ps + ps // 2 + 1  # inside the last page
        elif kind == 2:
            length = max(1, m - 1) * ps  # exactly a page boundary
        elif kind == 3:
            length = m * ps
        else:
            length = 1 + int(torch.randint(0, m * ps, (1,), generator=g))
        lengths.append(length)
    row_request = torch.arange(requests).repeat_interleave(per)
    offset = torch.arange(per).repeat(requests) - (per - 1)  # the last row of each request: 0
    key_end = (torch.tensor(lengths, dtype=torch.int64).repeat_interleave(per) + offset).clamp_min(0)
    return table.to(torch.int32), row_request.to(torch.int32), key_end, pool


def index_pages_of(pages: torch.Tensor, fmt: KVFormat, pad: int = 0) -> torch.Tensor:
    """A part-major pool layer's index-K in DeepGEMM's page order (the engines' ``two_part``
    index-K tensor): uint8 [P, S x index bytes], each page's values then its scales; ``pad``
    spare bytes after each page (a wider page stride: the result is a view of that buffer)."""
    p, ps, _ = pages.shape
    ib, d = fmt.index_bytes_per_token, fmt.index_head_dim
    vb = d if fmt.dtype is KVDtype.FP8 else ib
    idx = pages.reshape(p, -1)[:, ps * fmt.latent_bytes_per_token:].reshape(p, ps, ib)
    parts = [idx[..., :vb].reshape(p, ps * vb), idx[..., vb:].reshape(p, -1)]
    out = torch.cat([*parts, torch.zeros(p, pad, dtype=torch.uint8, device=pages.device)], 1)
    return out[:, :ps * ib] if pad else out


def _check_indexer_logits_paged(impl: Any, ref: Any, device: str, seed: int) -> None:
    """Part-major pools of fp8 (DeepSeek-V3.2 and small), bf16 and fp32 formats; random block
    tables over a pool with spare pages; several rows per request; bf16, fp32 and (fp8 pools)
    fp8 queries; the same tolerances as ``indexer_logits``, -inf exactly at ``j >= key_end``,
    inputs unchanged."""
    _check_paged_indexer(impl, ref, device, seed, index_pages=False)


def _check_indexer_logits_index_pages(impl: Any, ref: Any, device: str, seed: int) -> None:
    """``indexer_logits_paged``'s cases with the pools' index-K in DeepGEMM's page order
    (:func:`index_pages_of`; every other case at a wider page stride): equal to the
    reference's ``indexer_logits_paged`` on the part-major pools, the same tolerances."""
    _check_paged_indexer(impl, ref, device, seed, index_pages=True)


def _check_paged_indexer(impl: Any, ref: Any, device: str, seed: int, *,
                         index_pages: bool) -> None:
    op = "indexer_logits_index_pages" if index_pages else "indexer_logits_paged"
    j = 0
    small = {"kv_lora_rank": 64, "rope_dim": 16, "index_head_dim": 32, "page_size": 16}
    cases = [("deepseek_v32 fp8", FORMATS["deepseek_v32"], 8), ("small fp8", FORMATS["small"], 4),
             ("small bf16", KVFormat(dtype=KVDtype.BF16, **small), 4),
             ("small fp32", KVFormat(dtype=KVDtype.FP32, **small), 4)]
    for label, fmt, heads in cases:
        d = fmt.index_head_dim
        kinds = ("bf16", "fp32", "fp8") if fmt.dtype is KVDtype.FP8 else ("bf16", "fp32")
        for (requests, m, per), kind in itertools.product(PAGED_INDEXER_SIZES, kinds):
            j += 1
            g = _gen(seed * 1000 + 900 + j)
            case = (f"{label}, {kind} q, {requests} requests x {m} pages x {per} rows")
            table, row_request, key_end, pool = _paged_rows(fmt, requests, m, per, g)
            pages = _paged_pool(fmt, pool, ref, g)
            n = row_request.shape[0]
            q = _nonzero((n, heads, d), torch.float32 if kind == "fp32" else torch.bfloat16, g)
            w = _nonzero((n, heads), torch.float32, g) * (heads ** -0.5 * d ** -0.5)
            if kind == "fp8":  # fp8 x fp8: q quantized, its scales folded into w
                q, w = quantize_index_q(q, w)
            args = _to(device, q, w, pages, table, row_request, key_end)
            keep = [x.clone() for x in args]
            q, w, pages, table, row_request, key_end = args
            want = ref.indexer_logits_paged(q, w, pages, fmt, table, row_request, key_end)
            if index_pages:
                ipages = index_pages_of(pages, fmt, 16 * (j % 2))
                kept = ipages.clone()
                case += f", page-major index-K, page stride {ipages.stride(0)}"
                got = _call(op, case, impl.indexer_logits_index_pages, q, w, ipages, fmt, table,
                            row_request, key_end)
                _unchanged(op, case, [kept], [ipages])
            else:
                got = _call(op, case, impl.indexer_logits_paged, q, w, pages, fmt, table,
                            row_request, key_end)
            mag = ref.indexer_logits_paged(abs_fp8(q), w.abs(), abs_index_pages(pages, fmt), fmt,
                                           table, row_request, key_end) if kind == "fp8" else None
            _assert_logits(op, case, got, want, mag)
            _unchanged(op, case, keep, args)
            # independent of the reference: -inf exactly at the keys past each row's end
            col = torch.arange(m * fmt.page_size)
            if not torch.equal(got.cpu().isneginf(), col >= key_end.cpu()[:, None]):
                raise AssertionError(f"{op} [{case}] logits: -inf is not exactly the keys at or "
                                     f"past key_end")


def _topk_logits(variant: str, n: int, t: int, topk: int, ref: Any, g: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ks, ke = _key_ranges(n, t, topk, g)
    if variant == "indexer":
        q, w, k = _indexer_inputs("small", n, t, g)  # 4 heads: many exact 0.0 ties (relu)
        return ref.indexer_logits(q, w, k, None, ks, ke), ks, ke
    x = torch.randn(n, t, generator=g) * 3.0
    if variant == "coarse":
        x = x.mul(2).round().div(2)  # steps of 0.5: ties everywhere
    # finite values (larger than any inside) outside the ranges: the op must mask them
    col = torch.arange(t)
    outside = ~((col >= ks[:, None]) & (col < ke[:, None]))
    return torch.where(outside, x.abs() + 100.0, x), ks, ke


def _assert_topk(case: str, got: Any, want: torch.Tensor, logits: torch.Tensor,
                 ks: torch.Tensor, ke: torch.Tensor, k: int) -> None:
    """The comparison of the module docstring (-1 pattern, short rows exact, sets with ties)."""
    op = "topk"
    prefix = f"{op} [{case}] indices"
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{prefix}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{prefix}: got {got.dtype} {tuple(got.shape)}, expected "
                             f"{want.dtype} {tuple(want.shape)}")
    if got.device.type != want.device.type:
        raise AssertionError(f"{prefix}: result on {got.device}, expected {want.device}")
    a, b, lg = got.cpu(), want.cpu(), logits.detach().cpu().double()
    t = lg.shape[1]
    pad = b == -1
    if not torch.equal(a == -1, pad):
        bad = ((a == -1) != pad).any(dim=1).nonzero().flatten()
        raise AssertionError(f"{prefix}: the -1 slots differ from the reference in {bad.numel()} "
                             f"row(s), first {bad[:5].tolist()}")
    count = (ke.cpu().clamp(0, t) - ks.cpu().clamp(0, t)).clamp_min(0)
    for i in range(a.shape[0]):
        c, lo, hi = int(count[i]), int(ks[i]), int(ke[i])
        row, wrow = a[i].tolist(), b[i].tolist()
        if c <= k:
            if row != wrow:
                raise AssertionError(f"{prefix}: row {i} holds {c} <= k={k} keys and must list "
                                     f"them all in ascending order: got {row[:8]}..., expected "
                                     f"{wrow[:8]}...")
            continue
        if len(set(row)) != k or not all(lo <= j < hi for j in row):
            raise AssertionError(f"{prefix}: row {i} repeats a column or leaves its range "
                                 f"[{lo}, {hi}): {row[:8]}...")
        if set(row) == set(wrow):
            continue
        top = lg[i, lo:hi].sort(descending=True).values
        kth, nxt = float(top[k - 1]), float(top[k])
        if abs(kth - nxt) > TOPK_TIE_REL * max(abs(kth), abs(nxt)):
            raise AssertionError(f"{prefix}: row {i} picks a different index set than the "
                                 f"reference and its k-th / (k+1)-th logits {kth!r} / {nxt!r} do "
                                 f"not tie")
        for j in set(row) ^ set(wrow):
            v = float(lg[i, j])
            if abs(v - kth) > TOPK_TIE_REL * max(abs(v), abs(kth)):
                raise AssertionError(f"{prefix}: row {i}: column {j} (logit {v!r}) is not tied "
                                     f"with the k-th logit {kth!r}")


#: the fp8 indexer's top-k cases: (rows, keys, k), every row range longer than k possible
FP8_TOPK_SIZES: tuple[tuple[int, int, int], ...] = ((17, 40, 8), (64, 200, 16), (131, 300, 64),
                                                    (7, 2600, 2048))


def _fp8_indexer_inputs(variant: str, n: int, t: int, ref: Any, g: torch.Generator
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q8, w', k8, k_scale) of DeepSeek-V3.2's fp8 indexer (64 heads x 128).

    ``"deepseek"``: random bf16 queries and keys through the whole definition: both rotated
    (:func:`hadamard_rotate`), the keys packed by the reference's ``fp8_pack`` (ue8m0 index-K,
    taken as the pool hands it out), the queries by :func:`quantize_index_q` (ue8m0, scales
    folded into the head weights). ``"grid"``: e4m3 integers in [-4, 4] with power-of-two key
    scales: every per-head dot is a small integer, exact in any accumulator (Hopper's fp8 tensor
    cores keep fewer than fp32's bits), so only the head sum's order can differ."""
    fmt = KVFormat.deepseek_v32(KVDtype.FP8)  # this indexer's own shape, whatever FORMATS holds
    heads, d = 64, fmt.index_head_dim
    w = _nonzero((n, heads), torch.float32, g) * (heads ** -0.5 * d ** -0.5)
    if variant == "grid":
        q8 = torch.randint(-4, 5, (n, heads, d), generator=g).float().to(torch.float8_e4m3fn)
        k8 = torch.randint(-4, 5, (t, d), generator=g).float().to(torch.float8_e4m3fn)
        scale = torch.pow(2.0, torch.randint(-8, -3, (t,), generator=g).float())
        return q8, w, k8, scale
    q = hadamard_rotate(_nonzero((n, heads, d), torch.bfloat16, g))
    k = hadamard_rotate(_nonzero((t, d), torch.float32, g).to(torch.bfloat16))
    packed = ref.fp8_pack(k, fmt, "index_k")
    k8 = packed[:, :d].view(torch.float8_e4m3fn)
    scale = packed[:, d:].clone(memory_format=torch.contiguous_format).view(torch.float32)[:, 0]
    q8, w8 = quantize_index_q(q, w)
    return q8, w8, k8, scale


def _fp8_topk_cases(ref: Any, device: str, seed: int
                    ) -> Iterator[tuple[str, int, list[torch.Tensor]]]:
    """(case, k, [q8, w', k8, k_scale, key_start, key_end] on ``device``) of the fp8 indexer's
    top-k cases (:data:`FP8_TOPK_SIZES`, both input variants)."""
    j = 0
    for variant in ("grid", "deepseek"):
        for n, t, k in FP8_TOPK_SIZES:
            j += 1
            g = _gen(seed * 1000 + 900 + j)
            q8, w8, k8, scale = _fp8_indexer_inputs(variant, n, t, ref, g)
            ks, ke = _key_ranges(n, t, k, g)
            yield (f"fp8 indexer ({variant}), {n} rows x {t} keys, k={k}", k,
                   _to(device, q8, w8, k8, scale, ks, ke))


def _check_fp8_indexer_topk(impl: Any, ref: Any, device: str, seed: int) -> None:
    """The choice the fp8 indexer's logits make: the reference's top-k of ``impl``'s
    ``indexer_logits`` against its top-k of the reference's logits, by the top-k rule (sets
    equal up to ties within :data:`TOPK_TIE_REL` of the reference's logits). The ``topk``
    check runs a backend's own top-k on the same logits: together the backend's whole fp8
    indexer (logits, then top-k) chooses the reference's keys."""
    for case, k, (q8, w8, k8, scale, ks, ke) in _fp8_topk_cases(ref, device, seed):
        logits = ref.indexer_logits(q8, w8, k8, scale, ks, ke)
        got_logits = _call("indexer_logits", case, impl.indexer_logits, q8, w8, k8, scale,
                           ks, ke)
        _assert_topk(case, ref.topk(got_logits, k, ks, ke), ref.topk(logits, k, ks, ke),
                     logits, ks, ke, k)


def _check_topk(impl: Any, ref: Any, device: str, seed: int) -> None:
    """The op on the fp8 indexer's logits (:func:`_fp8_topk_cases`), reference indexer
    logits, random and coarse logits."""
    for case, k, (q8, w8, k8, scale, ks, ke) in _fp8_topk_cases(ref, device, seed):
        logits = ref.indexer_logits(q8, w8, k8, scale, ks, ke)
        _assert_topk(case, _call("topk", case, impl.topk, logits, k, ks, ke),
                     ref.topk(logits, k, ks, ke), logits, ks, ke, k)
    op = "topk"
    j = 0
    for variant in ("indexer", "finite outside", "coarse"):
        for n, t, k in ATTN_SIZES:
            j += 1
            g = _gen(seed * 1000 + 400 + j)
            case = f"{variant} logits, {n} rows x {t} keys, k={k}"
            logits, ks, ke = _to(device, *_topk_logits(variant, n, t, k, ref, g))
            keep = [logits.clone(), ks.clone(), ke.clone()]
            want = ref.topk(logits, k, ks, ke)
            got = _call(op, case, impl.topk, logits, k, ks, ke)
            _assert_topk(case, got, want, logits, ks, ke, k)
            _unchanged(op, case, keep, [logits, ks, ke])


def _check_indexer_topk(impl: Any, ref: Any, device: str, seed: int) -> None:
    """The fused op against the reference's top-k of the reference's logits, by the top-k rule:
    the fp8 indexer's cases (:func:`_fp8_topk_cases`), and float keys (bf16 and fp32, 4 heads:
    many exact 0.0 ties from the relu) at :data:`ATTN_SIZES`; the inputs unchanged."""
    op = "indexer_topk"
    cases: list[tuple[str, int, list[torch.Tensor], torch.Tensor | None]] = [
        (case, k, [q8, w8, k8, ks, ke], scale)
        for case, k, (q8, w8, k8, scale, ks, ke) in _fp8_topk_cases(ref, device, seed)]
    j = 0
    for n, t, k in ATTN_SIZES:
        for kind in ("bf16", "fp32"):
            j += 1
            g = _gen(seed * 1000 + 950 + j)
            q, w, keys = _indexer_inputs("small", n, t, g)
            ks, ke = _key_ranges(n, t, k, g)
            if kind == "bf16":
                keys = keys.to(torch.bfloat16)
            cases.append((f"{kind} keys, {n} rows x {t} keys, k={k}", k,
                          _to(device, q, w, keys, ks, ke), None))
    for case, k, (q, w, keys, ks, ke), scale in cases:
        keep = [x.clone() for x in (q, w, keys, ks, ke)]
        logits = ref.indexer_logits(q, w, keys, scale, ks, ke)
        got = _call(op, case, impl.indexer_topk, q, w, keys, scale, ks, ke, k)
        _assert_topk(f"{op}: {case}", got, ref.topk(logits, k, ks, ke), logits, ks, ke, k)
        _unchanged(op, case, keep, [q, w, keys, ks, ke])


def _check_sparse_mla(impl: Any, ref: Any, device: str, seed: int) -> None:
    op = "sparse_mla"
    j = 0
    # (label, heads, Dk, dv): DeepSeek-V3.2's latent (512 nope + 64 rope) and a small one
    shapes = (("deepseek_v32", 16, 576, 512), ("small", 4, 80, 64))
    for label, heads, dk, dv in shapes:
        for n, t, k in ATTN_SIZES:
            for variant in ("top-k indices", "scattered -1"):
                for dtype in (torch.bfloat16, torch.float32):
                    j += 1
                    g = _gen(seed * 1000 + 700 + j)
                    case = (f"{label}, {variant}, {str(dtype).removeprefix('torch.')}, {n} rows "
                            f"x {t} keys, k={k}")
                    q = _nonzero((n, heads, dk), dtype, g)
                    kv = _nonzero((t, dk), dtype, g)
                    if variant == "top-k indices":
                        logits, ks, ke = _topk_logits("finite outside", n, t, k, ref, g)
                        idx = ref.topk(logits, k, ks, ke)
                    else:  # any column, repeats allowed, -1 anywhere (about a third)
                        idx = torch.randint(0, max(t, 1), (n, k), generator=g, dtype=torch.int32)
                        drop = torch.rand(n, k, generator=g) < 0.35
                        if n:
                            drop[0] = True  # a row without any valid index
                        idx = torch.where(drop | (t == 0), -1, idx).to(torch.int32)
                    q, kv, idx = _to(device, q, kv, idx)
                    keep = [q.clone(), kv.clone(), idx.clone()]
                    scale = dk ** -0.5
                    want = ref.sparse_mla(q, kv, idx, scale, dv)
                    got = _call(op, case, impl.sparse_mla, q, kv, idx, scale, dv)
                    if dtype == torch.float32:
                        _assert_close(op, case, "output", got, want)
                    else:  # float32, or q's dtype (a kernel that writes its output in it)
                        if isinstance(got, torch.Tensor) and got.dtype == dtype:
                            got = got.float()
                        big = float(want.abs().max()) if want.numel() else 0.0
                        _assert_close(op, case, "output", got, want, LOWP_MLA_REL,
                                      LOWP_MLA_REL * big + ATTN_ATOL)
                    _unchanged(op, case, keep, [q, kv, idx])


def _check_sparse_mla_paged(impl: Any, ref: Any, device: str, seed: int) -> None:
    """Part-major pages of fp8 (DeepSeek-V3.2 and small) and bf16 formats, packed by the
    reference; token rows anywhere in them with repeats, -1 slots and an empty row; bf16 and
    float32 queries; pages and rows unchanged."""
    op = "sparse_mla_paged"
    j = 0
    bf16 = KVFormat(dtype=KVDtype.BF16, kv_lora_rank=64, rope_dim=16, index_head_dim=32,
                    page_size=16)
    cases = [("deepseek_v32 fp8", FORMATS["deepseek_v32"], 16, 512),
             ("small fp8", FORMATS["small"], 4, 64), ("small bf16", bf16, 4, 48)]
    for label, fmt, heads, dv in cases:
        ps, nl = fmt.page_size, fmt.latent_bytes_per_token
        dk = fmt.kv_lora_rank + fmt.rope_dim
        for n, pages, k in ((0, 2, 64), (1, 1, 64), (9, 3, 64), (33, 5, 128)):
            for dtype in (torch.bfloat16, torch.float32):
                j += 1
                g = _gen(seed * 1000 + 800 + j)
                case = (f"{label}, {str(dtype).removeprefix('torch.')} q, {n} rows x k={k} over "
                        f"{pages} pages")
                lat = pack_rows(torch.randn(pages * ps, dk, generator=g), fmt, "latent", ref)
                idx = pack_rows(torch.randn(pages * ps, fmt.index_head_dim, generator=g), fmt,
                                "index_k", ref)
                buf = torch.cat([lat.reshape(pages, ps * nl), idx.reshape(pages, -1)], 1)
                buf = buf.reshape(pages, ps, -1).contiguous()
                rows = torch.randint(0, pages * ps, (n, k), generator=g, dtype=torch.int32)
                drop = torch.rand(n, k, generator=g) < 0.3
                if n:
                    drop[0] = True  # a row without any valid index
                rows = torch.where(drop, -1, rows).to(torch.int32)
                q = _nonzero((n, heads, dk), dtype, g)
                q, buf, rows = _to(device, q, buf, rows)
                keep = [q.clone(), buf.clone(), rows.clone()]
                scale = dk ** -0.5
                want = ref.sparse_mla_paged(q, buf, rows, fmt, scale, dv)
                got = _call(op, case, impl.sparse_mla_paged, q, buf, rows, fmt, scale, dv)
                if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
                    got = got.float()  # q's dtype: a kernel that writes its output in it
                big = float(want.abs().max()) if want.numel() else 0.0
                _assert_close(op, case, "output", got, want, LOWP_MLA_REL,
                              LOWP_MLA_REL * big + ATTN_ATOL)
                _unchanged(op, case, keep, [q, buf, rows])


def _rope_operands(x: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair ``(a_j, b_j)`` each output j of ``rope`` rotates, in float64."""
    x64 = x.double()
    h = x.shape[-1] // 2
    if style == "interleave":
        return x64[..., 0::2], x64[..., 1::2]
    return x64[..., :h], x64[..., h:]


def _check_rope(impl: Any, ref: Any, device: str, seed: int) -> None:
    """x [N, R] and [N, H, R] as strided slices of wider rows (as the model's query and key
    are), both styles, fp32 and bf16, a half that is not a power of two, and three ways of
    writing: a new tensor, ``out`` a slice of another buffer (its other columns untouched), in
    place. Bound per output element against the reference: ``4 u (|a c| + |b s|)`` with u the
    unit roundoff of x's dtype (the reference rounds each product and the sum; a backend that
    rounds once is within it)."""
    op = "rope"
    g = _gen(seed + 11)
    j = 0
    for dtype in (torch.float32, torch.bfloat16):
        u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8  # unit roundoff
        for style in ("interleave", "half"):
            for n, heads, r in ((0, 3, 16), (1, 3, 64), (37, 3, 64), (29, 0, 12), (33, 0, 64)):
                j += 1
                wide = r + 8  # x is the last r columns of wider rows
                shape = (n, heads, wide) if heads else (n, wide)
                base = _nonzero(shape, dtype, g)
                ang = torch.rand(n, r // 2, generator=g, dtype=torch.float64) * 20.0
                cos = torch.cat([ang.cos(), ang.cos()], 1).to(dtype)
                sin = torch.cat([ang.sin(), ang.sin()], 1).to(dtype)
                base, cos, sin = _to(device, base, cos, sin)
                x = base[..., 8:]
                keep = [base.clone(), cos.clone(), sin.clone()]
                want = ref.rope(x.clone(), cos, sin, style)
                a, b = _rope_operands(x, style)
                c = cos.double()[:, : r // 2]
                sn = sin.double()[:, : r // 2]
                if heads:
                    c, sn = c[:, None], sn[:, None]
                bound = 4 * u * torch.cat([(a * c).abs() + (b * sn).abs(),
                                           (b * c).abs() + (a * sn).abs()], -1)
                for mode in ("new", "out", "in place"):
                    case = f"{dtype} {style} x {list(x.shape)} {mode} #{j}"
                    if mode == "new":
                        got = _call(op, case, impl.rope, x, cos, sin, style)
                        _unchanged(op, case, keep, [base, cos, sin])
                    elif mode == "out":
                        dst = _nonzero(shape, dtype, g).to(device)
                        dkeep = dst[..., :8].clone()
                        res = _call(op, case, impl.rope, x, cos, sin, style, dst[..., 8:])
                        got = dst[..., 8:]
                        if not isinstance(res, torch.Tensor) or res.data_ptr() != got.data_ptr():
                            raise AssertionError(f"{op} [{case}]: does not return out")
                        _unchanged(op, case, [dkeep, *keep], [dst[..., :8], base, cos, sin])
                    else:
                        xi = base.clone()
                        res = _call(op, case, impl.rope, xi[..., 8:], cos, sin, style,
                                    xi[..., 8:])
                        got = xi[..., 8:]
                        _unchanged(op, case, [keep[0][..., :8]], [xi[..., :8]])
                    _assert_like(f"{op} [{case}] output", got, want)
                    diff = (got.double() - want.double()).abs().cpu()
                    over = diff > bound.cpu() + 1e-300
                    if bool(over.any()):
                        i = int((diff - bound.cpu()).flatten().argmax())
                        raise AssertionError(
                            f"{op} [{case}]: {int(over.sum())} element(s) beyond 4u(|a c| + |b s|) "
                            f"of the reference; worst at flat index {i}: |got - want| = "
                            f"{diff.flatten()[i].item():.3g} > {bound.flatten()[i].item():.3g}")


def _check_rms_norm(impl: Any, ref: Any, device: str, seed: int) -> None:
    """x [N, D] as a column slice of wider rows (the model's q_a / kv_a are slices of one
    projection) and contiguous, bf16 / fp16 / fp32, DeepSeek's widths (7168, 1536, 512) and an
    odd one, rows of very different magnitudes, an all-zero row (eps alone), no rows. Bound per
    element: ``(2 u + 2^-20) |ref|`` (u the unit roundoff of x's dtype: one rounding of a value
    whose fp32 sum of squares ran in another order, or through an approximate rsqrt)."""
    op = "rms_norm"
    g = _gen(seed + 19)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dtype]
        for n, d, sliced in ((64, 7168, False), (64, 1536, True), (5, 512, True), (3, 37, False),
                             (0, 512, False)):
            case = f"{dtype} x [{n}, {d}]{' a column slice' if sliced else ''}"
            base = _nonzero((n, d + (9 if sliced else 0)), dtype, g, spread=True)
            if dtype == torch.float16:
                base = base.clamp(-200, 200)  # its squares' mean stays finite in fp32 either way
            if n > 2:
                base[1] = 0
            w = _nonzero((d,), dtype, g)
            base, w = _to(device, base, w)
            x = base[:, 9:] if sliced else base
            keep = [base.clone(), w.clone()]
            want = ref.rms_norm(x, w, 1e-6)
            got = _call(op, case, impl.rms_norm, x, w, 1e-6)
            _unchanged(op, case, keep, [base, w])
            _assert_like(f"{op} [{case}] output", got, want)
            diff = (got.double() - want.double()).abs().cpu()
            bound = (2 * u + 2.0 ** -20) * want.double().abs().cpu()
            over = diff > bound
            if bool(over.any()):
                i = int((diff - bound).flatten().argmax())
                raise AssertionError(f"{op} [{case}]: {int(over.sum())} element(s) beyond "
                                     f"(2u + 2^-20) |ref|; worst at flat index {i}: "
                                     f"{got.flatten()[i].item():.6g} vs "
                                     f"{want.flatten()[i].item():.6g}")


#: ``index_q_fp8`` with the rotation: the least share of codes that must be the reference's
#: (a sum at a bf16 rounding boundary may land one ulp away, rarely: ~1e-5 of elements measured)
INDEX_Q_SAME_CODES = 0.999


def _check_index_q_fp8(impl: Any, ref: Any, device: str, seed: int) -> None:
    """q [N, H, D] as a strided slice of wider rows (the model's index query is a column slice
    of the fused projection), bf16 / fp16 / fp32, D 128 (DeepSeek's) and 32, rows of very
    different magnitudes (scales over many binades), an all-zero (row, head) (the floor's
    scale), w with negative values. Without the rotation: the reference's bits. With it: the
    scales, w' and the codes of at least :data:`INDEX_Q_SAME_CODES` of the elements are the
    reference's, and every dequantized value ``float(q8) * s`` is within ``2^-3 |ref|`` plus
    one e4m3 subnormal step (``2^-9``) of the larger scale of the reference's (a value one bf16
    ulp away can round to the next e4m3 code, or move a scale to the next power of two)."""
    op = "index_q_fp8"
    g = _gen(seed + 13)
    j = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n, heads, d in ((0, 4, 128), (1, 64, 128), (37, 8, 128), (19, 3, 32)):
            j += 1
            base = _nonzero((n, heads, d + 8), dtype, g, spread=True)
            if n > 2:
                base[2, 1] = 0  # an all-zero (row, head): amax at the floor
            w = torch.randn(n, heads, generator=g)
            base, w = _to(device, base, w)
            q = base[..., 8:]
            keep = [base.clone(), w.clone()]
            for rotate in (False, True):
                case = f"{dtype} q {list(q.shape)} rotate={rotate} #{j}"
                want_q, want_w = ref.index_q_fp8(q, w, rotate)
                res = _call(op, case, impl.index_q_fp8, q, w, rotate)
                _unchanged(op, case, keep, [base, w])
                if not isinstance(res, tuple) or len(res) != 2:
                    raise AssertionError(f"{op} [{case}]: expected a (q8, w') pair, got "
                                         f"{type(res).__name__}")
                got_q, got_w = res
                if not rotate:
                    _assert_same(op, case, "q8", got_q, want_q)
                    _assert_same(op, case, "w'", got_w, want_w)
                    continue
                _assert_like(f"{op} [{case}] q8", got_q, want_q)
                _assert_like(f"{op} [{case}] w'", got_w, want_w)
                if n == 0:
                    continue
                ww, rw = got_w.cpu(), want_w.cpu()
                _assert_rotated_codes(op, case, got_q.cpu().view(torch.uint8),
                                      (ww / w.cpu()).double()[..., None],
                                      want_q.cpu().view(torch.uint8),
                                      (rw / w.cpu()).double()[..., None])


def _assert_rotated_codes(op: str, case: str, codes: torch.Tensor, scale: torch.Tensor,
                          ref_codes: torch.Tensor, ref_scale: torch.Tensor) -> None:
    """fp8 codes (uint8 [..., D], CPU) of Hadamard-rotated values against the reference's: the
    same code on at least :data:`INDEX_Q_SAME_CODES` of the elements, and every dequantized
    value ``e4m3(code) * scale`` (float64 scales [..., 1]) within ``2^-3 |ref|`` plus one e4m3
    subnormal step (``2^-9``) of the larger scale of the reference's (a rotated value one bf16
    ulp away, the sums in another order, can round to the next code or move a power-of-two
    scale)."""
    same = (codes == ref_codes).double().mean().item()
    deq = codes.view(torch.float8_e4m3fn).double() * scale
    rdeq = ref_codes.view(torch.float8_e4m3fn).double() * ref_scale
    if same < INDEX_Q_SAME_CODES:
        raise AssertionError(f"{op} [{case}]: {same:.5f} of the codes are the reference's "
                             f"(< {INDEX_Q_SAME_CODES}); max difference {_max_diff(deq, rdeq)}")
    bound = rdeq.abs() * 2.0 ** -3 + torch.maximum(scale, ref_scale) * 2.0 ** -9
    over = (deq - rdeq).abs() > bound
    if bool(over.any()):
        i = int(((deq - rdeq).abs() - bound).flatten().argmax())
        raise AssertionError(
            f"{op} [{case}]: {int(over.sum())} dequantized value(s) beyond 2^-3 |ref| "
            f"+ 2^-9 s; worst at flat index {i}: {deq.flatten()[i].item():.6g} vs "
            f"{rdeq.flatten()[i].item():.6g}")


def sync_check_inputs(device: str | torch.device) -> dict[str, torch.Tensor]:
    """Inputs of one layer's attention ops at a realistic shape, for the GPU tests that run the
    ops under ``torch.cuda.set_sync_debug_mode("error")``: 64 query rows x 64 indexer heads x 128
    against 500 keys (``k`` float32, ``k8`` float8_e4m3fn with ``scale``), causal ranges
    ``ks``/``ke``, a 576-wide latent view ``kv`` and 16-head queries ``qm``."""
    k = torch.randn(500, 128, device=device)
    k8, scale = quantize_fp8(k, None, "ue8m0")
    return {
        "q": torch.randn(64, 64, 128, device=device, dtype=torch.bfloat16),
        "w": torch.randn(64, 64, device=device),
        "k": k, "scale": scale, "k8": k8,
        "ks": torch.zeros(64, dtype=torch.int64, device=device),
        "ke": torch.arange(64, dtype=torch.int64, device=device) * 7,
        "kv": torch.randn(500, 576, device=device, dtype=torch.bfloat16),
        "qm": torch.randn(64, 16, 576, device=device, dtype=torch.bfloat16),
    }


# ---- DeepSeek-V4 ------------------------------------------------------------------------------
#: (rows, rate, overlap, with a prior window) of the ``v4_compress`` cases; d = 8
_V4_COMPRESS_CASES = ((0, 4, True, False), (3, 4, True, True), (8, 4, True, False),
                      (20, 4, True, True), (16, 16, False, False), (37, 16, False, False))


def _check_v4_compress(impl: Any, ref: Any, device: str, seed: int) -> None:
    g = _gen(seed)
    for rows, rate, overlap, prior_too in _V4_COMPRESS_CASES:
        w = 16 if overlap else 8
        kv, gate = torch.randn(rows, w, generator=g), torch.randn(rows, w, generator=g)
        ape = torch.randn(rate, w, generator=g)
        prior = ((torch.randn(rate, w, generator=g), torch.randn(rate, w, generator=g))
                 if prior_too else None)
        case = f"rows={rows} rate={rate} overlap={overlap} prior={prior_too}"
        want = ref.v4_compress(kv, gate, ape, rate, overlap, prior)
        moved = _to(device, kv, gate, ape)
        dev_prior = None if prior is None else tuple(_to(device, *prior))
        got = _call("v4_compress", case, impl.v4_compress, *moved, rate, overlap, dev_prior)
        _assert_close("v4_compress", case, "entries", got, want)


def _check_v4_index_scores(impl: Any, ref: Any, device: str, seed: int) -> None:
    g = _gen(seed)
    for n, heads, e in ((0, 4, 5), (1, 16, 0), (5, 16, 3), (17, 4, 40), (33, 64, 130)):
        q = torch.randn(n, heads, 16, generator=g)
        w = torch.randn(n, heads, generator=g) * heads ** -0.5
        keys = torch.randn(e, 16, generator=g)
        limit = torch.randint(0, e + 2, (n,), generator=g)
        case = f"rows={n} heads={heads} entries={e}"
        want = ref.v4_index_scores(q, w, keys, limit, 0.25)
        got = _call("v4_index_scores", case, impl.v4_index_scores, *_to(device, q, w, keys,
                                                                         limit), 0.25)
        _assert_close("v4_index_scores", case, "scores", got, want)


def _check_v4_topk(impl: Any, ref: Any, device: str, seed: int) -> None:
    g = _gen(seed)
    for n, e, k in ((0, 4, 2), (3, 0, 2), (6, 9, 4), (6, 9, 12), (17, 40, 8)):
        scores = torch.randint(0, 3, (n, e), generator=g).float()  # many ties
        scores[torch.rand(n, e, generator=g) < 0.3] = float("-inf")
        case = f"rows={n} entries={e} k={k}"
        want = ref.v4_topk(scores, k)
        got = _call("v4_topk", case, impl.v4_topk, *_to(device, scores), k)
        _assert_same("v4_topk", case, "choice", got, want)


def _check_v4_index_topk(impl: Any, ref: Any, device: str, seed: int) -> None:
    """The fused op against the reference's ``v4_topk`` of its ``v4_index_scores``: the same -1
    slots, and per row the same set but for entries whose scores tie the k-th within 1e-6."""
    g = _gen(seed)
    for n, heads, e, k in ((0, 4, 5, 2), (3, 16, 0, 2), (5, 4, 9, 12), (17, 16, 40, 8),
                           (33, 64, 300, 16)):
        # bf16 queries and keys (the fast kernels' operands; a backend may decline float32)
        q = torch.randn(n, heads, 16, generator=g).to(torch.bfloat16)
        w = torch.randn(n, heads, generator=g) * heads ** -0.5
        keys = torch.randn(e, 16, generator=g).to(torch.bfloat16)
        limit = torch.randint(0, e + 2, (n,), generator=g)
        case = f"rows={n} heads={heads} entries={e} k={k}"
        scores = ref.v4_index_scores(q, w, keys, limit, 0.25)
        want = ref.v4_topk(scores, k)
        got = _call("v4_index_topk", case, impl.v4_index_topk, *_to(device, q, w, keys, limit),
                    0.25, k)
        _assert_v4_choice(case, got, want, scores)


def _assert_v4_choice(case: str, got: Any, want: torch.Tensor, scores: torch.Tensor) -> None:
    prefix = f"v4_index_topk [{case}]"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{prefix}: got {getattr(got, 'dtype', type(got).__name__)} "
                             f"{tuple(getattr(got, 'shape', ()))}, expected {want.dtype} "
                             f"{tuple(want.shape)}")
    a, b = got.cpu(), want.cpu()
    if not torch.equal((a == -1).sum(1), (b == -1).sum(1)):
        raise AssertionError(f"{prefix}: the count of -1 slots differs from the reference")
    for i in range(a.shape[0]):
        mine, theirs = set(a[i].tolist()) - {-1}, set(b[i].tolist()) - {-1}
        if len(mine) != len(a[i]) - int((a[i] == -1).sum()):
            raise AssertionError(f"{prefix}: row {i} repeats an entry: {a[i].tolist()}")
        if mine == theirs:
            continue
        row = scores[i].cpu().double()
        kth = min(float(row[j]) for j in theirs)
        odd = [j for j in mine ^ theirs if not 0 <= j < row.shape[0]
               or abs(float(row[j]) - kth) > 1e-6 * max(1.0, abs(kth))]
        if odd:
            raise AssertionError(f"{prefix}: row {i} chose {sorted(mine - theirs)} instead of "
                                 f"{sorted(theirs - mine)}, not ties of the k-th score {kth}")


def _check_v4_attention(impl: Any, ref: Any, device: str, seed: int) -> None:
    g = _gen(seed)
    for n, heads, k, s in ((0, 4, 9, 5), (1, 4, 1, 3), (5, 8, 13, 40), (17, 4, 140, 300),
                           (3, 2, 300, 64)):
        q = torch.randn(n, heads, 32, generator=g)
        kv = torch.randn(s, 32, generator=g)
        indices = torch.randint(0, s, (n, k), generator=g)
        indices[torch.rand(n, k, generator=g) >= 0.7] = -1
        if n:
            indices[0] = -1  # a row that reads no key: zeros (the sink alone)
        sink = torch.randn(heads, generator=g)
        case = f"rows={n} heads={heads} indices={k} buffer={s}"
        want = ref.v4_attention(q, kv, indices, sink, 32 ** -0.5)
        got = _call("v4_attention", case, impl.v4_attention, *_to(device, q, kv, indices, sink),
                    32 ** -0.5)
        _assert_close("v4_attention", case, "output", got, want)


#: op name -> its check(impl, reference, device, seed)
CHECKS: dict[str, Callable[[Any, Any, str, int], None]] = {
    Op.PAGE_GATHER.value: _check_page_gather,
    Op.PAGE_SCATTER.value: _check_page_scatter,
    Op.PAGE_COPY.value: _check_page_copy,
    Op.RERANGE.value: _check_rerange,
    Op.FP8_PACK.value: _check_fp8_pack,
    Op.FP8_UNPACK.value: _check_fp8_unpack,
    Op.PEER_GATHER.value: _check_peer_gather,
    Op.PAGE_ROWS.value: _check_page_rows,
    Op.FP8_STORE.value: _check_fp8_store,
    Op.INDEXER_LOGITS.value: _check_indexer_logits,
    Op.INDEXER_LOGITS_PAGED.value: _check_indexer_logits_paged,
    Op.INDEXER_LOGITS_INDEX_PAGES.value: _check_indexer_logits_index_pages,
    Op.TOPK.value: _check_topk,
    Op.INDEXER_TOPK.value: _check_indexer_topk,
    Op.SPARSE_MLA.value: _check_sparse_mla,
    Op.SPARSE_MLA_PAGED.value: _check_sparse_mla_paged,
    Op.ROPE.value: _check_rope,
    Op.INDEX_Q_FP8.value: _check_index_q_fp8,
    Op.RMS_NORM.value: _check_rms_norm,
    Op.V4_COMPRESS.value: _check_v4_compress,
    Op.V4_INDEX_SCORES.value: _check_v4_index_scores,
    Op.V4_TOPK.value: _check_v4_topk,
    Op.V4_INDEX_TOPK.value: _check_v4_index_topk,
    Op.V4_ATTENTION.value: _check_v4_attention,
}


# ---- public API ------------------------------------------------------------------------------
def check_op(impl: Any, reference: Any, op: str, *, device: str = "cpu", seed: int = 0) -> None:
    """Run ``op`` of ``impl`` against ``reference`` on random inputs at several sizes.

    Args:
        impl: the backend object under test (has a method named ``op``).
        reference: the torch reference backend object (see :func:`reference_backend`).
        op: an op name (``Op`` member or its value) the suite knows, see :data:`CHECKS`.
        device: where the inputs live (``"cpu"``, ``"cuda"``, ...).
        seed: seeds the inputs; the same seed gives the same inputs on every device.

    Raises:
        AssertionError: ``impl`` lacks the op or disagrees with the reference; the message names
            the op, the case (format, part, rows, dtype) and the largest difference.
        ValueError: the suite has no check for ``op``.
    """
    name = str(op)  # an Op member is a StrEnum: str() is its value
    if name not in CHECKS:
        raise ValueError(f"no conformance check for op {op!r}; checked ops: {sorted(CHECKS)}")
    if not callable(getattr(impl, name, None)):
        raise AssertionError(f"{name}: backend {type(impl).__name__} has no method {name!r}")
    CHECKS[name](impl, reference, str(device), seed)


def check_backend(impl: Any, reference: Any, ops: Iterable[str] | None = None,
                  device: str = "cpu") -> list[str]:
    """Run :func:`check_op` for every op of ``impl`` the suite knows (or for ``ops``).

    Returns:
        the op names checked, in :data:`CHECKS` order (or the order of ``ops``).

    Raises:
        AssertionError: an op disagrees with the reference, or ``ops`` names one ``impl`` lacks.
        ValueError: ``ops`` names an op the suite has no check for.
    """
    own = [n for n in CHECKS if callable(getattr(impl, n, None))]
    names = own if ops is None else [str(o) for o in ops]
    for name in names:
        check_op(impl, reference, name, device=device)
    return names


def reference_backend() -> Any:
    """The torch reference backend object, loaded through the plugin registry (entry point
    ``cpkv.backends: torch``); the core never imports a backend package.

    Raises:
        RuntimeError: the ``torch`` backend is not discovered or not available here.
    """
    host = PluginHost(load_entry_points=True)
    try:
        reg = host.backends()
        av = reg.availability("torch")
        if not av.available:
            raise RuntimeError(f"the torch reference backend cannot be used: {av.reason}")
        return reg.load("torch")
    finally:
        host.close()


def check_fp8_round_trip(impl: Any, x: torch.Tensor, fmt: KVFormat, part: str) -> None:
    """Properties of ``impl``'s fp8 pack/unpack on ``x`` (no reference needed).

    * the packed row has the format's byte count and every block scale is positive and finite;
    * each quantised value is within ``FP8_ROUND_TRIP_REL * |x| + FP8_ROUND_TRIP_ABS * scale``
      of ``x`` (see the bound's derivation at :data:`FP8_ROUND_TRIP_REL`);
    * rope (latent) comes back as exactly ``x``'s rope cast to bf16.

    Raises:
        AssertionError: a property fails; the message names the worst element.
    """
    if part == "latent":
        dims, block, rope = fmt.kv_lora_rank, fmt.quant_block, fmt.rope_dim
    else:
        dims, block, rope = fmt.index_head_dim, fmt.index_head_dim, 0
    n, blocks = x.shape[0], dims // block
    packed = impl.fp8_pack(x, fmt, part)
    nbytes = dims + 4 * blocks + 2 * rope
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, nbytes):
        raise AssertionError(f"fp8_pack({part}): got {packed.dtype} {tuple(packed.shape)}, "
                             f"expected uint8 {(n, nbytes)}")
    scale = packed[:, dims:dims + 4 * blocks].clone(memory_format=torch.contiguous_format).view(
        torch.float32)
    if not bool(((scale > 0) & scale.isfinite()).all()):
        raise AssertionError(f"fp8_pack({part}): non-positive or non-finite scale: "
                             f"{scale[~((scale > 0) & scale.isfinite())][:5].tolist()}")
    back = impl.fp8_unpack(packed, fmt, part, torch.float32)
    xf = x.float()
    err = (back[:, :dims] - xf[:, :dims]).abs().reshape(n, blocks, block)
    bound = (FP8_ROUND_TRIP_REL * xf[:, :dims].abs().reshape(n, blocks, block)
             + FP8_ROUND_TRIP_ABS * scale.unsqueeze(-1))
    over = err > bound
    if bool(over.any()):
        i = int((err - bound).flatten().argmax())
        raise AssertionError(
            f"fp8 round trip ({part}): |x - x'| = {err.flatten()[i].item():.6g} > bound "
            f"{bound.flatten()[i].item():.6g} at flat index {i} "
            f"(x = {xf[:, :dims].flatten()[i].item():.6g}); {int(over.sum())} element(s) over")
    if rope:
        want = xf[:, dims:].to(torch.bfloat16).float()
        if not torch.equal(back[:, dims:], want):
            raise AssertionError(f"fp8 round trip ({part}): rope is not the bf16 of the input; max "
                                 f"difference {(back[:, dims:] - want).abs().max().item()}")


# ---- base test classes a backend's own test module subclasses ---------------------------------
class BaseOpsTests:
    """Base of the conformance test classes (pandas' extension-array base tests are the model).

    A backend's test module subclasses the classes of the ops it provides and names its object::

        from cpkv.testing.conformance import BaseKVOpsTests

        class TestMyBackendKV(BaseKVOpsTests):
            ops = MyOps()
            device = "cuda"

    pytest collects every ``test_*`` method of the subclass (the ``Base*`` classes themselves are
    not collected: their names do not start with ``Test``). Each method runs :func:`check_op` of
    one op against the torch reference for every seed in :attr:`seeds`. A backend that provides
    only some ops of a class lists them in :attr:`provides`: the others are skipped, with a
    reason naming them. pytest is needed only to run the classes (it is not a cpkv dependency).
    """

    #: the backend object under test (one method per op it provides)
    ops: ClassVar[KVOps]
    #: where the inputs live
    device: ClassVar[str] = "cpu"
    #: the seeds each op is checked with (the same seed gives the same inputs on every device)
    seeds: ClassVar[tuple[int, ...]] = (0,)
    #: the ops the backend provides; None: every op of the class
    provides: ClassVar[frozenset[Op] | None] = None

    def check(self, op: Op) -> None:
        """Check ``op`` of :attr:`ops` against the reference (skipped when not provided).

        Raises:
            AssertionError: the op disagrees with the reference (see :func:`check_op`).
        """
        if self.provides is not None and op not in self.provides:
            import pytest

            pytest.skip(f"{type(self).__name__} does not provide {op.value} (provides: "
                        f"{sorted(o.value for o in self.provides)})")
        for seed in self.seeds:
            check_op(self.ops, _cached_reference(), op.value, device=self.device, seed=seed)


class BasePageOpsTests(BaseOpsTests):
    """The page-movement ops: page_gather, page_scatter, page_copy, rerange, peer_gather, and
    page_rows (keys to token rows)."""

    def test_page_gather(self) -> None:
        self.check(Op.PAGE_GATHER)

    def test_page_scatter(self) -> None:
        self.check(Op.PAGE_SCATTER)

    def test_page_copy(self) -> None:
        self.check(Op.PAGE_COPY)

    def test_rerange(self) -> None:
        self.check(Op.RERANGE)

    def test_peer_gather(self) -> None:
        self.check(Op.PEER_GATHER)

    def test_page_rows(self) -> None:
        self.check(Op.PAGE_ROWS)


class BaseFP8OpsTests(BaseOpsTests):
    """fp8_pack, fp8_store and fp8_unpack against the reference (bit for bit; fp8_store's
    rotation within its bound), and the round-trip bound of
    :func:`check_fp8_round_trip` on every format and part."""

    def test_fp8_pack(self) -> None:
        self.check(Op.FP8_PACK)

    def test_fp8_unpack(self) -> None:
        self.check(Op.FP8_UNPACK)

    def test_fp8_store(self) -> None:
        self.check(Op.FP8_STORE)

    def test_fp8_round_trip(self) -> None:
        if self.provides is not None and not {Op.FP8_PACK, Op.FP8_UNPACK} <= self.provides:
            import pytest

            pytest.skip(f"{type(self).__name__} does not provide fp8_pack and fp8_unpack")
        for _name, fmt, part, n in _fp8_cases():
            x = _fp8_input(fmt, part, n, torch.float32, _gen(self.seeds[0]))
            check_fp8_round_trip(self.ops, x.to(self.device), fmt, part)


class BaseKVOpsTests(BasePageOpsTests, BaseFP8OpsTests):
    """Every op the sharded pool and the CP runtime need (``cpkv.ops.KV_OPS``)."""


class BaseAttentionOpsTests(BaseOpsTests):
    """The sparse-attention ops of one layer: indexer_logits, indexer_logits_paged, topk,
    indexer_topk, sparse_mla, sparse_mla_paged."""

    def test_indexer_logits(self) -> None:
        self.check(Op.INDEXER_LOGITS)

    def test_indexer_logits_paged(self) -> None:
        self.check(Op.INDEXER_LOGITS_PAGED)

    def test_indexer_logits_index_pages(self) -> None:
        self.check(Op.INDEXER_LOGITS_INDEX_PAGES)

    def test_topk(self) -> None:
        self.check(Op.TOPK)

    def test_indexer_topk(self) -> None:
        self.check(Op.INDEXER_TOPK)

    def test_sparse_mla(self) -> None:
        self.check(Op.SPARSE_MLA)

    def test_sparse_mla_paged(self) -> None:
        self.check(Op.SPARSE_MLA_PAGED)


class BaseRopeOpsTests(BaseOpsTests):
    """The rotary embedding op."""

    def test_rope(self) -> None:
        self.check(Op.ROPE)


class BaseQuantOpsTests(BaseOpsTests):
    """The index query's rotation and fp8 quantization."""

    def test_index_q_fp8(self) -> None:
        self.check(Op.INDEX_Q_FP8)


class BaseNormOpsTests(BaseOpsTests):
    """The RMSNorm op."""

    def test_rms_norm(self) -> None:
        self.check(Op.RMS_NORM)


class BaseAllOpsTests(BaseKVOpsTests, BaseAttentionOpsTests, BaseRopeOpsTests,
                      BaseQuantOpsTests, BaseNormOpsTests):
    """Every op the suite knows."""


@functools.cache
def _cached_reference() -> Any:
    """:func:`reference_backend`, loaded once per process (the classes' tests share it)."""
    return reference_backend()
