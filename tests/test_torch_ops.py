"""The torch reference ops (issue #3): the conformance suite on them, checks against independent
formulas and hand-computed bytes, fp8 round-trip properties, and broken backends that the suite
must reject."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.contracts import KVDtype, KVFormat, Op
from cpkv.ops import ALL_OPS
from cpkv.ops.api import FP8_AMAX_FLOOR
from cpkv.plugin import PluginHost
from cpkv.testing.conformance import (
    CHECKS,
    FORMATS,
    FP8_ROUND_TRIP_ABS,
    FP8_ROUND_TRIP_REL,
    check_backend,
    check_fp8_round_trip,
    check_op,
)
from cpkv_backend_torch.ops import TorchOps

DS = FORMATS["deepseek_v32"]
SMALL = FORMATS["small"]

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu])]


# ---- the reference through the registry ------------------------------------------------------
def test_reference_backend_comes_from_the_registry(ref: Any) -> None:
    assert isinstance(ref, TorchOps)
    host = PluginHost()
    try:
        spec = host.backends().specs["torch"]
    finally:
        host.close()
    assert spec.ops == frozenset(ALL_OPS)
    for op in spec.ops:  # the spec lists exactly the methods the object has
        assert callable(getattr(ref, op.value)), op
    assert set(CHECKS) == {o.value for o in ALL_OPS}


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_conformance_suite_runs_every_op(ref: Any, device: str) -> None:
    assert check_backend(TorchOps(), ref, device=device) == [o.value for o in ALL_OPS]


def test_check_backend_with_listed_ops(ref: Any) -> None:
    assert check_backend(ref, ref, ops=[Op.RERANGE, "fp8_pack"]) == ["rerange", "fp8_pack"]


def test_check_op_rejects_unknown_and_missing_ops(ref: Any) -> None:
    with pytest.raises(ValueError, match="no conformance check for op 'bogus'"):
        check_op(ref, ref, "bogus")
    with pytest.raises(AssertionError, match="has no method 'rerange'"):
        check_op(object(), ref, Op.RERANGE)


# ---- independent formulas --------------------------------------------------------------------
def test_page_gather_is_python_indexing() -> None:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(1, 256, (9, 64, 656), generator=g, dtype=torch.uint8)
    index = torch.tensor([4, 0, 4, 8, 1], dtype=torch.int64)
    before = src.clone()
    out = TorchOps().page_gather(src, index)
    assert out.is_contiguous()
    assert torch.equal(out, torch.stack([src[i] for i in (4, 0, 4, 8, 1)]))
    out.zero_()  # a new tensor, not a view of src
    assert torch.equal(src, before)
    assert TorchOps().page_gather(src, torch.empty(0, dtype=torch.int64)).shape == (0, 64, 656)


def test_page_scatter_writes_only_the_indexed_rows() -> None:
    dst = torch.full((6, 132), 0xA5, dtype=torch.uint8)
    src = torch.arange(2 * 132, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(2, 132)
    TorchOps().page_scatter(dst, torch.tensor([5, 2]), src)
    for row in range(6):
        want = {5: src[0], 2: src[1]}.get(row, torch.full((132,), 0xA5, dtype=torch.uint8))
        assert torch.equal(dst[row], want), row


def test_page_scatter_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match=r"src \(3, 8\).*index \(2,\).*dst \(4, 8\)"):
        TorchOps().page_scatter(torch.zeros(4, 8), torch.tensor([0, 1]), torch.zeros(3, 8))


def test_rerange_is_natural_n_equals_gathered_perm_n() -> None:
    gathered = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)  # C=2, max_rank_len=4
    perm = torch.tensor([0, 1, 4, 5, 6, 2])  # rank 1's row 3 and rank 0's row 3 are padding
    out = TorchOps().rerange(gathered, perm)
    assert torch.equal(out, torch.stack([gathered[p] for p in perm.tolist()]))


def _f32(b: torch.Tensor) -> list[float]:
    return list(struct.unpack(f"<{b.numel() // 4}f", bytes(b.tolist())))


def _bf16(b: torch.Tensor) -> list[float]:
    # bf16 is the top half of an fp32: pad two zero bytes below each value (little-endian)
    raw = bytes(b.tolist())
    return [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]


def test_fp8_pack_latent_layout_by_hand() -> None:
    """Small format: 64 latent dims in 2 blocks of 32, 16 rope dims -> 64 + 8 + 32 = 104 B."""
    x = torch.zeros(1, 80)
    x[0, 0], x[0, 1], x[0, 31] = 448.0, -1.0, 2.0   # block 0: amax 448 -> scale 1.0
    x[0, 32], x[0, 40] = 0.5, -0.25                 # block 1: amax 0.5 -> scale 0.5 / 448
    x[0, 64:] = torch.linspace(-3.0, 3.0, 16)
    p = TorchOps().fp8_pack(x, SMALL, "latent")
    assert p.shape == (1, 104) and p.dtype == torch.uint8
    q = p[0, :64]
    # e4m3fn bytes: 448 = 0x7e, -1.0 = 0xb8, 2.0 = 0x40, 0 = 0x00; in block 1 0.5 -> 448 and -0.25
    # -> -224 = 0xf6
    assert (q[0].item(), q[1].item(), q[31].item(), q[2].item()) == (0x7E, 0xB8, 0x40, 0x00)
    assert (q[32].item(), q[40].item()) == (0x7E, 0xF6)
    assert bytes(p[0, 64:68].tolist()) == b"\x00\x00\x80\x3f"  # fp32 1.0, little-endian
    assert _f32(p[0, 64:72]) == [1.0, struct.unpack("<f", struct.pack("<f", 0.5 / 448))[0]]
    assert _bf16(p[0, 72:104]) == x[0, 64:].to(torch.bfloat16).float().tolist()


@pytest.mark.parametrize("fmt", [DS, SMALL], ids=["deepseek_v32", "small"])
def test_fp8_pack_layout_decodes_independently(fmt: KVFormat) -> None:
    g = torch.Generator().manual_seed(7)
    r, qb, rope, d = fmt.kv_lora_rank, fmt.quant_block, fmt.rope_dim, fmt.index_head_dim
    x = torch.randn(5, r + rope, generator=g) * torch.logspace(-3, 3, 5)[:, None]
    p = TorchOps().fp8_pack(x, fmt, "latent")
    nb = r // qb
    assert p.shape == (5, fmt.latent_bytes_per_token)
    if fmt is DS:
        assert p.shape[1] == 656
    scales = p[:, r:r + 4 * nb].contiguous().view(torch.float32)
    amax = x[:, :r].reshape(5, nb, qb).abs().amax(-1)
    assert torch.equal(scales, amax / 448)
    for row in range(5):  # struct, not torch views: an independent decoding
        assert _f32(p[row, r:r + 4 * nb]) == (amax[row] / 448).tolist()
        assert _bf16(p[row, r + 4 * nb:]) == x[row, r:].to(torch.bfloat16).float().tolist()
    q = p[:, :r].view(torch.float8_e4m3fn).float().reshape(5, nb, qb)
    want_q = (x[:, :r].reshape(5, nb, qb) / scales[..., None]).to(torch.float8_e4m3fn).float()
    assert torch.equal(q, want_q)
    assert q.abs().amax(-1).eq(448).all()  # the block maximum maps onto e4m3's largest value

    xi = torch.randn(3, d, generator=g)
    pi = TorchOps().fp8_pack(xi, fmt, "index_k")
    assert pi.shape == (3, fmt.index_bytes_per_token)
    if fmt is DS:
        assert pi.shape[1] == 132
    # the index-K's scale is DeepSeek's ue8m0: the power of two at or above amax / 448
    for row in range(3):
        amax_i = float(xi[row].abs().max())
        assert _f32(pi[row, d:]) == [2.0 ** math.ceil(math.log2(amax_i / 448))]
    qi = pi[:, :d].view(torch.float8_e4m3fn).float()
    assert (qi.abs().amax(-1) >= 224).all() and (qi.abs().amax(-1) <= 448).all()


def test_fp8_unpack_is_e4m3_times_scale() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 80, generator=g)
    p = TorchOps().fp8_pack(x, SMALL, "latent")
    out = TorchOps().fp8_unpack(p, SMALL, "latent", torch.float32)
    q = p[:, :64].view(torch.float8_e4m3fn).float().reshape(4, 2, 32)
    s = torch.tensor([_f32(p[i, 64:72]) for i in range(4)])
    assert torch.equal(out[:, :64], (q * s[..., None]).reshape(4, 64))
    assert torch.equal(out[:, 64:], x[:, 64:].to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_unpack_returns_the_requested_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(3, 576)
    out = TorchOps().fp8_unpack(TorchOps().fp8_pack(x, DS, "latent"), DS, "latent", dtype)
    assert out.dtype == dtype and out.shape == (3, 576)
    xi = torch.randn(3, 128)
    assert TorchOps().fp8_unpack(TorchOps().fp8_pack(xi, DS, "index_k"), DS, "index_k",
                                 dtype).dtype == dtype


def test_fp8_all_zero_block_has_a_positive_scale_and_unpacks_to_zero() -> None:
    x = torch.zeros(2, 576)
    x[1, 128:256] = 1.0  # row 1: one non-zero block among zero blocks
    p = TorchOps().fp8_pack(x, DS, "latent")
    scales = p[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales[0], torch.full((4,), FP8_AMAX_FLOOR / 448, dtype=torch.float32))
    assert scales[1, 1].item() == pytest.approx(1 / 448, rel=1e-7)
    out = TorchOps().fp8_unpack(p, DS, "latent", torch.float32)
    assert torch.equal(out, x)


@pytest.mark.parametrize("n", [0, 1, 7])
def test_fp8_any_row_count(n: int) -> None:
    for part, d, b in (("latent", 576, 656), ("index_k", 128, 132)):
        p = TorchOps().fp8_pack(torch.randn(n, d), DS, part)
        assert p.shape == (n, b)
        assert TorchOps().fp8_unpack(p, DS, part, torch.bfloat16).shape == (n, d)


def test_fp8_pack_accepts_non_contiguous_rows() -> None:
    base = torch.randn(6, 700)
    x = base[::2, :576]
    assert torch.equal(TorchOps().fp8_pack(x, DS, "latent"),
                       TorchOps().fp8_pack(x.contiguous(), DS, "latent"))


def test_fp8_shape_errors_name_the_shapes() -> None:
    ops = TorchOps()
    with pytest.raises(ValueError, match=r"expected x of shape \[N, 576\].*got \(2, 512\)"):
        ops.fp8_pack(torch.randn(2, 512), DS, "latent")
    with pytest.raises(ValueError, match=r"expected x of shape \[N, 128\].*got \(2, 132\)"):
        ops.fp8_pack(torch.randn(2, 132), DS, "index_k")
    with pytest.raises(ValueError, match=r"expected uint8 \[N, 656\].*got torch.uint8 \(2, 655\)"):
        ops.fp8_unpack(torch.zeros(2, 655, dtype=torch.uint8), DS, "latent", torch.float32)
    with pytest.raises(ValueError, match=r"expected uint8 \[N, 132\].*got torch.float32"):
        ops.fp8_unpack(torch.zeros(2, 132), DS, "index_k", torch.float32)
    with pytest.raises(ValueError, match="part must be 'latent' or 'index_k'"):
        ops.fp8_pack(torch.randn(2, 128), DS, "index")  # type: ignore[arg-type]
    bad = KVFormat(kv_lora_rank=100, quant_block=64)  # bf16 pool: the validator allows it
    with pytest.raises(ValueError, match="kv_lora_rank=100, quant_block=64"):
        ops.fp8_pack(torch.randn(2, 164), bad, "latent")


def test_ops_never_read_device_data() -> None:
    """On meta tensors any ``.item()``, ``.tolist()`` or data-dependent shape raises: the ops
    run there, so they never sync the host (rule 22)."""
    ops, meta = TorchOps(), "meta"
    i64 = torch.int64
    assert ops.page_gather(torch.empty(9, 64, 656, dtype=torch.uint8, device=meta),
                           torch.empty(4, dtype=i64, device=meta)).shape == (4, 64, 656)
    ops.page_scatter(torch.empty(9, 132, dtype=torch.uint8, device=meta),
                     torch.empty(4, dtype=i64, device=meta),
                     torch.empty(4, 132, dtype=torch.uint8, device=meta))
    assert ops.rerange(torch.empty(8, 576, dtype=torch.bfloat16, device=meta),
                       torch.empty(6, dtype=i64, device=meta)).shape == (6, 576)
    for part, d, b in (("latent", 576, 656), ("index_k", 128, 132)):
        p = ops.fp8_pack(torch.empty(5, d, dtype=torch.bfloat16, device=meta), DS, part)
        assert p.shape == (5, b) and p.device.type == meta
        assert ops.fp8_unpack(p, DS, part, torch.bfloat16).shape == (5, d)
    with pytest.raises(RuntimeError, match="meta"):  # the premise: a sync would be caught
        torch.empty(1, device=meta).item()


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
def test_ops_do_not_sync_on_cuda(ref: Any) -> None:
    x = torch.randn(64, 576, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = ref.fp8_pack(x, DS, "latent")
        ref.fp8_unpack(p, DS, "latent", torch.bfloat16)
        idx = torch.arange(32, device="cuda")
        ref.page_scatter(p, idx, ref.page_gather(p, idx.flip(0)))
        ref.rerange(p, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """Tensors that are the same view of the same memory get one copy on the device (so an op
    whose source is its destination, or whose ``out`` is ``x``, sees that there too)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (fp8 has no ``torch.equal``; NaNs compare equal)."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


class _OnDevice:
    """Runs ``impl``'s ops (every op of :data:`cpkv.ops.ALL_OPS` ``impl`` has, no list of its
    own to go stale) on ``device`` for inputs that live on the CPU: tensor arguments, also
    inside lists and tuples, are copied there, results come back, and an argument the op wrote
    in place (a destination, an ``out``) is written back into the caller's tensor."""

    def __init__(self, impl: Any, device: str) -> None:
        self.impl, self.device = impl, device

    def __getattr__(self, name: str) -> Any:
        if name not in {o.value for o in ALL_OPS}:
            raise AttributeError(name)
        op = getattr(self.impl, name)  # AttributeError: impl lacks it, so check_backend skips it
        return lambda *args: self._run(op, args)

    def _run(self, op: Any, args: tuple[Any, ...]) -> Any:
        moved: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

        def there(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return moved.setdefault(_key(a), (a, a.to(self.device)))[1]
            if isinstance(a, list | tuple):
                return type(a)(there(x) for x in a)
            return a

        out = op(*(there(a) for a in args))
        for host, dev in moved.values():  # written in place: back into the caller's tensor
            back = dev.cpu()
            if not _same_bytes(back, host):
                host.copy_(back)
        return self._back(out)

    def _back(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out.cpu()
        if isinstance(out, list | tuple):
            return type(out)(self._back(x) for x in out)
        return out


def test_the_device_wrapper_covers_every_op(ref: Any) -> None:
    """The wrapper the CUDA comparison below runs the reference through has every op the
    reference has: the op list grows in one place (:data:`ALL_OPS`), the comparison with it."""
    wrapped = _OnDevice(TorchOps(), "cpu")
    assert [o.value for o in ALL_OPS if callable(getattr(wrapped, o.value, None))] == [
        o.value for o in ALL_OPS]
    assert check_backend(wrapped, ref, ops=[Op.PAGE_COPY, Op.PAGE_SCATTER, Op.INDEX_Q_FP8,
                                            Op.ROPE]) == ["page_copy", "page_scatter",
                                                           "index_q_fp8", "rope"]


@pytest.mark.slow  # ~30 CPU seconds: the whole suite
def test_the_whole_suite_passes_through_the_device_wrapper_on_the_cpu(ref: Any) -> None:
    """What the CUDA comparison runs, on the CPU: a failure there is the device's, not the
    wrapper's (in-place ops, fp8 outputs, aliased arguments)."""
    assert check_backend(_OnDevice(TorchOps(), "cpu"), ref) == [o.value for o in ALL_OPS]


@pytest.mark.gpu
def test_cuda_results_equal_cpu_results_bit_for_bit(ref: Any) -> None:
    """The reference gives the same bytes on CUDA as on the CPU (fp8 rounding included), so a
    CUDA backend checked on CUDA is also checked against the CPU definition (the attention ops
    within the suite's tolerances)."""
    assert check_backend(_OnDevice(TorchOps(), "cuda"), ref) == [o.value for o in ALL_OPS]


# ---- fp8 round-trip properties ---------------------------------------------------------------
@st.composite
def fp8_formats(draw: st.DrawFn) -> KVFormat:
    qb = draw(st.sampled_from([1, 4, 16, 32, 128]))
    return KVFormat(dtype=KVDtype.FP8, kv_lora_rank=qb * draw(st.integers(1, 4)),
                    rope_dim=draw(st.sampled_from([0, 2, 16, 64])),
                    index_head_dim=draw(st.integers(1, 160)), quant_block=qb)


finite32 = st.floats(min_value=-2.0**100, max_value=2.0**100, allow_nan=False, allow_infinity=False,
                     width=32)


@st.composite
def fp8_rows(draw: st.DrawFn) -> tuple[KVFormat, str, torch.Tensor]:
    """A format, a part and rows: random normals at random magnitudes, with drawn exact values
    (zeros, subnormals, huge) planted in them."""
    fmt, part = draw(fp8_formats()), draw(st.sampled_from(["latent", "index_k"]))
    d = fmt.kv_lora_rank + fmt.rope_dim if part == "latent" else fmt.index_head_dim
    n = draw(st.integers(0, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(n, d, generator=g) * 10.0 ** draw(st.integers(-30, 30))
    if n:
        flat = x.view(-1)
        for _ in range(draw(st.integers(0, 8))):
            flat[draw(st.integers(0, flat.numel() - 1))] = draw(finite32)
        if draw(st.booleans()):
            x[draw(st.integers(0, n - 1))] = 0.0
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return fmt, part, x.to(dtype)


@settings(deadline=None, max_examples=200)
@given(fp8_rows())
def test_fp8_round_trip_error_is_bounded(case: tuple[KVFormat, str, torch.Tensor]) -> None:
    """|x - x'| <= 2^-4 |x| + 2^-10 scale per element (half an e4m3 ulp for normals, half the
    subnormal step below), so max |x - x'| <= (2^-4 + 2^-10/448) amax per block; rope exact in
    bf16; every scale positive."""
    fmt, part, x = case
    check_fp8_round_trip(TorchOps(), x, fmt, part)


@pytest.mark.parametrize("qb", [16, 32, 128])
def test_fp8_round_trip_bound_is_tight(qb: int) -> None:
    """The bound is not vacuous: on normal-range values relative errors stay under 2^-4 and come
    close to it, so a coarser quantiser would be noticed."""
    fmt = KVFormat(dtype=KVDtype.FP8, index_head_dim=qb)
    x = torch.randn(256, qb, generator=torch.Generator().manual_seed(0))
    out = TorchOps().fp8_unpack(TorchOps().fp8_pack(x, fmt, "index_k"), fmt, "index_k",
                                torch.float32)
    normal = x.abs() > x.abs().amax(-1, keepdim=True) / 8  # far above e4m3's subnormal range
    rel = ((out - x).abs() / x.abs())[normal]
    assert FP8_ROUND_TRIP_REL / 2 < rel.max().item() <= FP8_ROUND_TRIP_REL
    assert FP8_ROUND_TRIP_ABS < FP8_ROUND_TRIP_REL


@settings(deadline=None, max_examples=100)
@given(fp8_rows())
def test_fp8_pack_is_bytewise_deterministic_and_rope_is_bf16(
        case: tuple[KVFormat, str, torch.Tensor]) -> None:
    fmt, part, x = case
    a, b = TorchOps().fp8_pack(x, fmt, part), TorchOps().fp8_pack(x.clone(), fmt, part)
    assert torch.equal(a, b)
    if part == "latent" and fmt.rope_dim:
        r = fmt.kv_lora_rank
        rope = a[:, r + 4 * (r // fmt.quant_block):].clone(
            memory_format=torch.contiguous_format).view(torch.bfloat16)  # aligned copy
        assert torch.equal(rope, x[:, r:].to(torch.bfloat16))


# ---- the suite can fail ----------------------------------------------------------------------
class OffByOneRerange(TorchOps):
    def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        return gathered.index_select(0, (perm + 1).clamp_max(max(gathered.shape[0] - 1, 0)))


class SwappedScales(TorchOps):
    """Writes the latent block scales in reverse order."""

    def fp8_pack(self, x: torch.Tensor, fmt: KVFormat, part: Any) -> torch.Tensor:
        p = super().fp8_pack(x, fmt, part)
        if part != "latent":
            return p
        r, nb = fmt.kv_lora_rank, fmt.kv_lora_rank // fmt.quant_block
        s = p[:, r:r + 4 * nb].reshape(-1, nb, 4).flip(1).reshape(-1, 4 * nb)
        return torch.cat([p[:, :r], s, p[:, r + 4 * nb:]], dim=1)


class ScatterClobbers(TorchOps):
    """Right rows, but zeroes the rest of the destination first."""

    def page_scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.zero_()
        super().page_scatter(dst, index, src)


class GatherMutatesSource(TorchOps):
    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = super().page_gather(src, index)
        src[:1] = 1
        return out


class UnpackIgnoresDtype(TorchOps):
    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: Any,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        return super().fp8_unpack(packed, fmt, part, torch.float32, index)


class UnpackInBf16(TorchOps):
    """Multiplies in the target dtype: close, but not the reference's values."""

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: Any,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        out = super().fp8_unpack(packed, fmt, part, torch.float32, index)
        return (out.to(torch.bfloat16) * 1.0078125).to(dtype)  # 1 + 2^-7: off by a bf16 ulp


BROKEN = [
    (OffByOneRerange, "rerange", r"rerange \[.*rows.*max difference"),
    (SwappedScales, "fp8_pack", r"fp8_pack \[.*latent.*bytes: differs.*max difference"),
    (ScatterClobbers, "page_scatter", r"page_scatter \[.*destination.*max difference"),
    (GatherMutatesSource, "page_gather", r"page_gather \[.*must not be modified.*max difference"),
    (UnpackIgnoresDtype, "fp8_unpack", r"fp8_unpack \[.*to bfloat16\].*expected torch.bfloat16"),
    (UnpackInBf16, "fp8_unpack", r"fp8_unpack \[.*values: differs.*max difference"),
]


@pytest.mark.parametrize(("broken", "op", "match"), BROKEN)
def test_a_broken_backend_fails_the_suite(ref: Any, broken: type, op: str, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        check_op(broken(), ref, op)
    with pytest.raises(AssertionError, match=match):
        check_backend(broken(), ref)


@pytest.mark.slow  # ~30 CPU seconds each: the whole suite less one op
@pytest.mark.parametrize(("broken", "op", "match"), BROKEN)
def test_a_broken_op_fails_alone(ref: Any, broken: type, op: str, match: str) -> None:
    others = [o for o in CHECKS if o != op]
    assert check_backend(broken(), ref, ops=others) == others  # only the broken op fails


def test_round_trip_check_fails_on_a_coarse_quantiser() -> None:
    class Coarse(TorchOps):  # 2 mantissa bits (e5m2): twice the rounding error
        def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: Any,
                       dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
            out = super().fp8_unpack(packed, fmt, part, torch.float32, index)
            return out.to(torch.float8_e5m2).float().to(dtype)

    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match=r"fp8 round trip \(index_k\).*> bound"):
        check_fp8_round_trip(Coarse(), x, DS, "index_k")
