"""Backend conformance suite: run a backend's KV ops against the torch reference backend.

A backend author runs::

    from cpkv.testing.conformance import check_backend, reference_backend

    checked = check_backend(MyOps(), reference_backend(), device="cuda")

Every op is run on fresh random inputs (never all zeros) at several sizes: 0 rows, 1 row, odd
sizes, 64-token pages with the DeepSeek-V3.2 row sizes (656 B latent, 132 B index-K in fp8) and a
small format. Results must match the reference **bit for bit**: ``page_gather``, ``page_scatter``
and ``rerange`` move bytes; ``fp8_pack`` must produce the same bytes, which pins the formula
(fp32 ``scale = max(amax, 1e-12) / 448`` per block, ``q = e4m3(clamp(x / scale, ±448))``
rounded to nearest even, scales as fp32 and rope as bf16, little-endian); ``fp8_unpack`` must
return the same values (``float32(q) * scale`` cast once to the requested dtype). A mismatch raises
``AssertionError`` naming the op, the case and the largest difference.

Inputs are generated on the CPU from ``seed`` and then moved to ``device``, so a CUDA backend sees
exactly the inputs the CPU reference sees. Needs torch (a cpkv-core dependency); never imports a
backend package: :func:`reference_backend` goes through the plugin registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cpkv.contracts import KVDtype, KVFormat, Op
from cpkv.plugin import PluginHost

__all__ = [
    "CHECKS",
    "FORMATS",
    "FP8_ROUND_TRIP_ABS",
    "FP8_ROUND_TRIP_REL",
    "check_backend",
    "check_fp8_round_trip",
    "check_op",
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


def _assert_same(op: str, case: str, what: str, got: Any, want: torch.Tensor,
                 against: str = "the reference") -> None:
    """``got`` equals ``want`` bit for bit (shape, dtype, device, bytes)."""
    prefix = f"{op} [{case}] {what}"
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{prefix}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{prefix}: got {got.dtype} {tuple(got.shape)}, expected "
                             f"{want.dtype} {tuple(want.shape)}; max difference n/a")
    if got.device.type != want.device.type:
        raise AssertionError(f"{prefix}: result on {got.device}, expected {want.device}")
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
@dataclass(frozen=True)
class _Case:
    label: str
    seed: int


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
            keep = [src.clone(), index.clone()]
            want = ref.page_gather(src, index)
            got = _call(op, case, impl.page_gather, src, index)
            _assert_same(op, case, "output", got, want)
            _unchanged(op, case, keep, [src, index])
            # an independent formula, so that a wrong reference cannot pass with a wrong backend
            _assert_same(op, case, "output", got, src[index], against="src[index]")
            if not got.is_contiguous():
                raise AssertionError(f"{op} [{case}]: output is not contiguous")


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
            keep = [gathered.clone(), perm.clone()]
            want = ref.rerange(gathered, perm)
            got = _call(op, case, impl.rerange, gathered, perm)
            _assert_same(op, case, "output", got, want)
            _unchanged(op, case, keep, [gathered, perm])
            _assert_same(op, case, "output", got, gathered[perm], against="gathered[perm]")


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


#: op name -> its check(impl, reference, device, seed)
CHECKS: dict[str, Callable[[Any, Any, str, int], None]] = {
    Op.PAGE_GATHER.value: _check_page_gather,
    Op.PAGE_SCATTER.value: _check_page_scatter,
    Op.RERANGE.value: _check_rerange,
    Op.FP8_PACK.value: _check_fp8_pack,
    Op.FP8_UNPACK.value: _check_fp8_unpack,
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
