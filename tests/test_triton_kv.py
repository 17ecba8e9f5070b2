"""The Triton KV kernels (page_gather, page_scatter, rerange, fp8_pack, fp8_unpack) against the
torch reference, bit for bit.

Without a CUDA device the kernels run in the Triton interpreter on the CPU: ``TRITON_INTERPRET=1``
is set here before triton is imported (``triton.jit`` reads it when the kernels are defined) and
set again around each test of this module; it is restored right after the import so that the
other test modules see the environment they expect (the triton backend is unavailable on a CPU
machine without it). With a CUDA device the same tests run on the GPU, plus the ``gpu`` tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cpkv.contracts import KVDtype, KVFormat
from cpkv.fallback import recording
from cpkv.ops import KV_OPS
from cpkv.plugin import PluginHost
from cpkv.testing.conformance import FORMATS, check_fp8_round_trip, check_op
from triton_interp import CUDA, import_kernels, interpreter_env

kv = import_kernels("cpkv_backend_triton.kv", "_copy_rows")
INTERPRET = not CUDA
triton = pytest.importorskip("triton")
with interpreter_env():  # its attention and rope mixins' kernels, as kv's
    from cpkv_backend_triton.ops import TritonOps

DEVICE = "cpu" if INTERPRET else "cuda"
DS = KVFormat.deepseek_v32(KVDtype.FP8)
SMALL = FORMATS["small"]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(scope="module")
def impl() -> TritonOps:
    return TritonOps()


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    a = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a, b):
        bad = (a != b).nonzero().flatten()
        raise AssertionError(f"{bad.numel()} byte(s) differ, first at {bad[:8].tolist()}")


# ---- plugin ----------------------------------------------------------------------------------
def test_plugin_lists_kv_ops_and_is_available_in_the_interpreter() -> None:
    h = PluginHost()
    try:
        reg = h.backends()
        assert set(KV_OPS) <= reg.specs["triton"].ops
        assert reg.specs["triton"].page_sizes is None
        av = reg.availability("triton")
        assert av.available, av.reason
        loaded = reg.load("triton")
        assert isinstance(loaded, TritonOps)
        for op in KV_OPS:
            assert callable(getattr(loaded, op.value))
    finally:
        h.close()


def test_plugin_ops_are_the_ops_triton_ops_has() -> None:
    """The plugin's static list names exactly the ops the kernel modules put on ``TritonOps``."""
    from cpkv_backend_triton import plugin
    from cpkv_backend_triton.ops import IMPORT_ERRORS

    assert not IMPORT_ERRORS
    impl = TritonOps()
    assert impl.provided == plugin.OPS
    assert all(callable(getattr(impl, op.value)) for op in plugin.OPS)
    # the parts' own bound methods, no forwarding layer between the op table and the kernels
    assert impl.page_copy.__self__ is impl.kv_kernels
    assert impl.sparse_mla_paged.__self__ is impl.attention_kernels
    assert impl.rope.__self__ is impl.rope_kernels


def test_load_names_the_import_error_behind_a_missing_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpkv_backend_triton import ops, parts, plugin

    # as if attention.py had failed to import
    monkeypatch.setitem(ops.KERNELS, "attention", None)
    monkeypatch.setattr(ops, "IMPORT_ERRORS", {"attention": "ImportError('no attention')"})
    assert ops.TritonOps().provided == plugin.OPS - parts.PART_OPS["attention"]
    assert not hasattr(ops.TritonOps(), "topk")
    with pytest.raises(AttributeError, match=r"no attention kernels: .*no attention"):
        ops.TritonOps().topk(torch.zeros(1, 1), 1, torch.zeros(1, dtype=torch.int64),
                             torch.ones(1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"lists \['indexer_logits', "
                                           r"'indexer_logits_index_pages', 'indexer_logits_paged', "
                                           r"'indexer_topk', 'sparse_mla', 'sparse_mla_paged', "
                                           r"'topk', 'v4_index_topk'\] "
                                           r"but does not have them: .*no attention"):
        plugin.load()


@pytest.mark.skipif(not INTERPRET, reason="a CUDA device is present")
def test_plugin_unavailable_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpkv_backend_triton import plugin

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    av = plugin.probe()
    assert not av.available
    assert "no CUDA device" in av.reason and "TRITON_INTERPRET=1 is not set" in av.reason
    with pytest.raises(RuntimeError, match="no CUDA device"):
        plugin.load()


# ---- conformance -----------------------------------------------------------------------------
#: the interpreter's slowest ops (9-14 CPU seconds each): CI runs them
SLOW_OPS = {"fp8_store", "peer_gather"}


@pytest.mark.parametrize("op", [pytest.param(o.value, marks=pytest.mark.slow) if o.value in SLOW_OPS
                                else o.value for o in KV_OPS])
def test_conformance(impl: TritonOps, ref: Any, op: str) -> None:
    check_op(impl, ref, op, device=DEVICE)


@pytest.mark.parametrize("fmt", [DS, SMALL], ids=["deepseek_v32", "small"])
@pytest.mark.parametrize("part", ["latent", "index_k"])
def test_fp8_round_trip_bound(impl: TritonOps, fmt: KVFormat, part: str) -> None:
    d = fmt.kv_lora_rank + fmt.rope_dim if part == "latent" else fmt.index_head_dim
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    check_fp8_round_trip(impl, x, fmt, part)


# ---- row movement: layouts -------------------------------------------------------------------
def test_page_movement_on_views_and_odd_layouts(impl: TritonOps, ref: Any) -> None:
    g = torch.Generator().manual_seed(1)
    row_bytes, page = DS.index_bytes_per_token, DS.page_size
    # the pool as one flat buffer; dst is pool_buffer.view(-1, row_bytes) pages, written in place
    buf = torch.randint(0, 256, (5 * page * row_bytes + 8,), generator=g, dtype=torch.uint8)
    buf = buf.to(DEVICE)
    pool = buf[8:].view(-1, row_bytes).view(5, page, row_bytes)  # storage offset 8
    keep = buf.clone()
    index = torch.tensor([3, 0], device=DEVICE)
    src = torch.randint(0, 256, (2, page, row_bytes), generator=g, dtype=torch.uint8).to(DEVICE)
    impl.page_scatter(pool, index, src)
    want = keep.clone()
    want[8:].view(5, page, row_bytes)[index] = src
    _same(buf, want)
    _same(impl.page_gather(pool, index), src)

    # misaligned byte rows (storage offset 1): moved in byte units
    odd = buf[1:1 + 7 * 33].view(7, 33)
    idx = torch.tensor([6, 1, 1, 4], device=DEVICE)
    _same(impl.page_gather(odd, idx), ref.page_gather(odd, idx))

    # strided rows (every other row), non-dense rows (every other column), 1-D rows
    x = torch.randn(12, 5, 3, generator=g).to(DEVICE)
    idx = torch.tensor([5, 0, 3], device=DEVICE)
    for src_t in (x[::2], x[:, :, ::2], x.transpose(1, 2), x[:, 0, 0]):
        _same(impl.page_gather(src_t, idx), ref.page_gather(src_t, idx))
        _same(impl.rerange(src_t, idx), ref.rerange(src_t, idx))
    # scatter into a dst whose rows are not dense (written back in place), from a strided src
    dst = torch.randn(8, 6, generator=g).to(DEVICE)
    view = dst[:, ::2]
    want = dst.clone()
    vals = torch.randn(3, 6, generator=g).to(DEVICE)[:, 1::2]
    ref.page_scatter(want[:, ::2], idx, vals)
    with recording() as rec:
        impl.page_scatter(view, idx, vals)
    _same(dst, want)
    assert [e.reason.value for e in rec.events] == ["kernel_variant"]  # the slow path is reported
    # int32 index, empty rows, zero-width rows
    _same(impl.page_gather(x, idx.int()), ref.page_gather(x, idx))
    _same(impl.page_gather(x[:, :0], idx), ref.page_gather(x[:, :0], idx))
    with pytest.raises(ValueError, match="page_scatter"):
        impl.page_scatter(dst, idx, torch.zeros(2, 6, device=DEVICE))
    with pytest.raises(ValueError, match="index"):
        impl.page_gather(x, idx.float())


# ---- fp8: edge values, bit for bit -----------------------------------------------------------
def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value (fp32), both signs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = codes.view(torch.float8_e4m3fn).float()
    return v[v.isfinite()]


def _encoder_probe_values() -> torch.Tensor:
    """fp32 values in [-448, 448] that exercise every rounding case of fp32 -> e4m3: every e4m3
    value, every midpoint (ties to even), their fp32 neighbours, subnormals, tiny and fp32
    subnormal values, signed zeros."""
    pos = _e4m3_values()
    pos = pos[pos >= 0].unique()
    mid = (pos[1:].double() + pos[:-1].double()).div(2).float()  # exact in fp32
    near = torch.cat([mid, pos])
    up = torch.nextafter(near, torch.full_like(near, 1e9))
    down = torch.nextafter(near, torch.zeros_like(near))
    tiny = torch.tensor([2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-9 * 7.5, 2.0**-6 - 2.0**-10,
                         2.0**-6 - 2.0**-30, 1e-30, 1e-38, 1e-40, 1.4e-45, 0.0, 447.9, 448.0,
                         2.0**-12, 2.0**-11, 2.0**-11 + 2.0**-30])
    vals = torch.cat([near, up, down, tiny]).clamp(0, 448)
    return torch.cat([vals, -vals])


def test_fp8_pack_encoder_bit_exact_on_every_rounding_case(impl: TritonOps, ref: Any) -> None:
    """Rows whose amax is 448 have scale exactly 1, so x / scale = x: the probe values reach the
    e4m3 encoder unchanged (index_k of the small format: 32 values per row, one 448)."""
    vals = _encoder_probe_values()
    per = SMALL.index_head_dim - 1
    vals = torch.cat([vals, vals.new_zeros((-vals.numel()) % per)]).reshape(-1, per)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1).to(DEVICE)
    x[1::2, 0] = -448.0
    _same(impl.fp8_pack(x, SMALL, "index_k"), ref.fp8_pack(x, SMALL, "index_k"))


def _edge_rows(d: int, g: torch.Generator) -> torch.Tensor:
    """Rows of magnitudes from fp32-subnormal to near fp32 max, zeros, single spikes, ties."""
    n = 48
    mag = torch.pow(10.0, torch.empty(n, 1).uniform_(-40, 38, generator=g).double())
    x = (torch.randn(n, d, generator=g).double() * mag).float()
    x[0] = 0.0  # an all-zero row (every block at the amax floor)
    x[1] = -0.0
    x[2] = 1e-13  # amax below the 1e-12 floor
    x[3] = torch.randn(d, generator=g) * 1e-41  # fp32 subnormals
    x[4] = 3.0e38
    x[5] = -3.0e38
    x[6, ::3] = 0.0  # sparse zeros
    x[7] = torch.arange(d) % 5 - 2.0  # exact small integers (many ties)
    x[8] = 1.0
    x[8, 0] = 448.0 * 7  # one spike: most values become tiny subnormals
    return x


@pytest.mark.parametrize("fmt", [DS, SMALL], ids=["deepseek_v32", "small"])
@pytest.mark.parametrize("part", ["latent", "index_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fp8_pack_bit_exact_on_edge_rows(impl: TritonOps, ref: Any, fmt: KVFormat, part: str,
                                         dtype: torch.dtype) -> None:
    d = fmt.kv_lora_rank + fmt.rope_dim if part == "latent" else fmt.index_head_dim
    x = _edge_rows(d, torch.Generator().manual_seed(7))
    if dtype == torch.float16:  # finite inputs only (inf / inf has a platform-dependent NaN)
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    x = x.to(DEVICE)
    _same(impl.fp8_pack(x, fmt, part), ref.fp8_pack(x, fmt, part))
    xt = x.t().contiguous().t()  # column-major input: strided loads
    _same(impl.fp8_pack(xt, fmt, part), ref.fp8_pack(x, fmt, part))


# huge scales overflow to inf, as IEEE says; numpy (the interpreter) warns about it
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fp8_unpack_bit_exact_on_every_code_and_odd_scales(impl: TritonOps, ref: Any,
                                                          dtype: torch.dtype) -> None:
    """Every finite e4m3 code against scales of every kind (fp32 subnormal, huge enough to
    overflow, ordinary), and arbitrary rope bit patterns (not NaN)."""
    fmt, part = SMALL, "latent"
    dims, block, rope = fmt.kv_lora_rank, fmt.quant_block, fmt.rope_dim
    g = torch.Generator().manual_seed(11)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the NaN codes: NaN payloads are not compared
    n = 16
    q = codes[torch.randint(0, codes.numel(), (n, dims), generator=g)]
    q[0, :block] = codes[:block]
    q[1, :block] = codes[block:2 * block]
    scales = torch.tensor([1.0, 2.0**-149, 1e-40, 1e-30, 3e37, 3.4e38, 1e-12 / 448, 0.123,
                           7.5, 1.0 / 448, 5e-3, 2.0**20, 1e-20, 4.4e-39, 9.9, 1e30])
    sc = torch.stack([scales, scales.flip(0)], dim=1)  # [n, 2 blocks]
    rope_bits = torch.randint(0, 1 << 16, (n, rope), generator=g, dtype=torch.int32)
    exp = (rope_bits >> 7) & 0xFF
    rope_bits = torch.where(exp == 0xFF, rope_bits & ~(1 << 14), rope_bits)  # no inf/NaN
    rope_b = rope_bits.to(torch.int16).view(torch.uint8).reshape(n, 2 * rope)
    packed = torch.cat([q, sc.view(torch.uint8).reshape(n, 8), rope_b], dim=1).to(DEVICE)
    _same(impl.fp8_unpack(packed, fmt, part, dtype), ref.fp8_unpack(packed, fmt, part, dtype))
    # a strided (column-sliced) packed buffer
    wide = torch.cat([packed, packed[:, :5]], dim=1)[:, :packed.shape[1]]
    _same(impl.fp8_unpack(wide, fmt, part, dtype), ref.fp8_unpack(packed, fmt, part, dtype))


def test_fp8_ops_reject_bad_shapes(impl: TritonOps) -> None:
    with pytest.raises(ValueError, match="fp8_pack"):
        impl.fp8_pack(torch.zeros(2, 3, device=DEVICE), DS, "latent")
    with pytest.raises(ValueError, match="fp8_unpack"):
        impl.fp8_unpack(torch.zeros(2, 656, device=DEVICE), DS, "latent", torch.float32)
    with pytest.raises(ValueError, match="part"):
        impl.fp8_pack(torch.zeros(2, 3, device=DEVICE), DS, "nope")  # type: ignore[arg-type]


def test_fp8_store_rejects_bad_arguments_and_declines_a_small_rotation(impl: TritonOps) -> None:
    from cpkv.contracts import OpDeclined

    dst = torch.zeros(2, 64, 132, dtype=torch.uint8, device=DEVICE)
    rows = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    x = torch.randn(3, 128, device=DEVICE)
    with pytest.raises(ValueError, match="index-K only"):
        impl.fp8_store(torch.randn(3, 576, device=DEVICE), DS, "latent",
                       torch.zeros(2, 64, 656, dtype=torch.uint8, device=DEVICE), rows, True)
    with pytest.raises(ValueError, match=r"dst uint8 \[S, P, 132\]"):
        impl.fp8_store(x, DS, "index_k", dst[..., :131], rows, False)
    with pytest.raises(ValueError, match="rows int64"):
        impl.fp8_store(x, DS, "index_k", dst, rows.int(), False)
    with pytest.raises(ValueError, match=r"scale_dst uint8 \[2, 64, 4\]"):  # two_part's scales
        impl.fp8_store(x, DS, "index_k", dst[..., :128], rows, False,
                       torch.zeros(2, 64, 8, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match=r"x float \[N, 128\]"):
        impl.fp8_store(x[:, :64], DS, "index_k", dst, rows, False)
    tiny = KVFormat(dtype=KVDtype.FP8, kv_lora_rank=64, rope_dim=16, index_head_dim=8,
                    quant_block=32, page_size=64)
    with pytest.raises(OpDeclined, match="head dim 8"):
        impl.fp8_store(torch.randn(3, 8, device=DEVICE), tiny, "index_k",
                       torch.zeros(2, 64, 12, dtype=torch.uint8, device=DEVICE), rows, True)


def test_fp8_store_check_catches_a_misplaced_or_unrotated_write(ref: Any) -> None:
    """The conformance check fails a store one token off, and one that skips the rotation."""
    from cpkv_backend_torch.ops import TorchOps

    class OneOff(TorchOps):
        def fp8_store(self, x: torch.Tensor, fmt: KVFormat, part: Any, dst: torch.Tensor,
                      rows: torch.Tensor, rotate: bool,
                      scale_dst: torch.Tensor | None = None) -> None:
            super().fp8_store(x, fmt, part, dst, (rows + 1) % (dst.shape[0] * dst.shape[1]),
                              rotate, scale_dst)

    class Unrotated(TorchOps):
        def fp8_store(self, x: torch.Tensor, fmt: KVFormat, part: Any, dst: torch.Tensor,
                      rows: torch.Tensor, rotate: bool,
                      scale_dst: torch.Tensor | None = None) -> None:
            super().fp8_store(x, fmt, part, dst, rows, False, scale_dst)

    with pytest.raises(AssertionError, match=r"fp8_store .* pages"):
        check_op(OneOff(), ref, "fp8_store")
    with pytest.raises(AssertionError, match=r"rotated.*codes are the reference"):
        check_op(Unrotated(), ref, "fp8_store")


# ---- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conformance_on_gpu(impl: TritonOps, ref: Any, seed: int) -> None:
    for op in KV_OPS:
        check_op(impl, ref, op.value, device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1000, 4096 + 17, 65536])
def test_large_sizes_on_gpu_bit_exact(impl: TritonOps, ref: Any, tokens: int) -> None:
    """DeepSeek rows at up to 64K tokens, against the reference on the GPU and on the CPU."""
    g = torch.Generator().manual_seed(tokens)
    page = DS.page_size
    for row_bytes in (656, 132, 1152, 256):
        pages = -(-tokens // page)
        pool = torch.randint(0, 256, (4 * pages, page, row_bytes), generator=g,
                             dtype=torch.uint8).cuda()
        index = torch.randperm(4 * pages, generator=g)[:pages].cuda()
        _same(impl.page_gather(pool, index), ref.page_gather(pool, index))
        src = torch.randint(0, 256, (pages, page, row_bytes), generator=g,
                            dtype=torch.uint8).cuda()
        a, b = pool.clone(), pool.clone()
        impl.page_scatter(a, index, src)
        ref.page_scatter(b, index, src)
        _same(a, b)
        rows = pool.view(-1, row_bytes)
        perm = torch.randperm(rows.shape[0], generator=g)[:tokens].cuda()
        _same(impl.rerange(rows, perm), ref.rerange(rows, perm))
    hid = torch.randn(tokens + 64, 7168, generator=g).to(torch.bfloat16).cuda()
    perm = torch.randperm(tokens + 64, generator=g)[:tokens].cuda()
    _same(impl.rerange(hid, perm), ref.rerange(hid, perm))
    for part in ("latent", "index_k"):
        d = DS.kv_lora_rank + DS.rope_dim if part == "latent" else DS.index_head_dim
        x = (torch.randn(tokens, d, generator=g) * torch.pow(
            10.0, torch.empty(tokens, 1).uniform_(-6, 6, generator=g))).cuda()
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            packed = impl.fp8_pack(xd, DS, part)
            _same(packed, ref.fp8_pack(xd, DS, part))
            _same(packed, ref.fp8_pack(xd.cpu(), DS, part))  # the CPU reference too
            for out in (torch.float32, torch.bfloat16):
                _same(impl.fp8_unpack(packed, DS, part, out),
                      ref.fp8_unpack(packed, DS, part, out))
