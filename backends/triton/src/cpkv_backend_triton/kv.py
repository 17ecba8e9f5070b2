"""The KV ops (page_gather, page_scatter, page_copy, rerange, peer_gather, fp8_pack, fp8_store,
fp8_unpack, page_rows) as thin wrappers over :mod:`.kernels.kv`: :class:`KVKernels` (a part of
:class:`cpkv_backend_triton.ops.TritonOps`). fp8 is bit-exact with
:func:`cpkv.ops.api.quantize_fp8`. Design: docs/triton.md, "KV, rope, quantization, norm".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton

from cpkv.ops.api import (
    FallbackReason,
    OpDeclined,
    check_fp8_store_args,
    check_page_copy_args,
    check_page_rows_args,
    check_peer_gather_args,
    fp8_layout,
    report_fallback,
    scale_format,
)

from .kernels.kv import (
    MAX_PEERS,
    _copy_rows,
    _fp8_pack_kernel,
    _fp8_unpack_kernel,
    _page_rows_kernel,
    _peer_copy_rows,
)
from .quant import AMAX_FLOOR_F32, INV_E4M3_MAX_F32, OUT_DTYPES, UE8M0_FLOOR_F32, f32

if TYPE_CHECKING:
    from cpkv.ops.api import KVFormat, KVPart


__all__ = ["KVKernels"]


_UNIT_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


#: bytes one program of ``_copy_rows`` moves, at most ``COPY_COL_BYTES`` of a row per column
#: block; its warps: 8 from 8 KB up, 4 from 4 KB, else 2 (docs/triton.md: the sweep)
COPY_PROGRAM_BYTES = 8192
COPY_COL_BYTES = 4096


def _dense_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` [P, ...] as a [P, R] view (R elements per row, any row stride) when each row is dense
    in memory, else None."""
    p = t.shape[0]
    r = math.prod(t.shape[1:])
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expect:
            return None
        expect *= size
    return t.as_strided((p, r), (t.stride(0) if p > 1 else r, 1))


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` [P, ...] as a [P, R] view (row stride R)."""
    return t.contiguous().view(t.shape[0], math.prod(t.shape[1:]))


def _dense_rows_or_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` [P, ...] as a [P, R] view (:func:`_dense_rows`), of a contiguous copy when its rows
    are not dense in memory."""
    v = _dense_rows(t)
    return v if v is not None else _contiguous_rows(t)


class _CopyShape:
    """How ``_copy_rows`` / ``_peer_copy_rows`` move ``n`` rows of [*, R] views of one dtype
    (rows dense, any row stride): the widest unit (8, 4, 2 or 1 bytes) that the row bytes, every
    base pointer and every row stride allow, a ``vec``-unit (up to 16 B) alignment, and the
    launch shape (about :data:`COPY_PROGRAM_BYTES` per program)."""

    def __init__(self, views: list[torch.Tensor], n: int) -> None:
        first = views[0]
        isz = first.element_size()
        row_bytes = first.shape[1] * isz
        g = 16
        for t in views:
            for v in (row_bytes, t.data_ptr(), t.stride(0) * isz):
                g = math.gcd(g, v)
        unit = min(g, 8)
        self.vec = g // unit
        self.dtype = _UNIT_DTYPE[unit]
        self.row_units = row_bytes // unit
        self.block_c = min(triton.next_power_of_2(self.row_units),
                           max(16, COPY_COL_BYTES // unit))
        # several rows per program when rows are short
        self.block_r = max(1, min(64, (COPY_PROGRAM_BYTES // unit) // self.block_c,
                                  triton.next_power_of_2(n)))
        self.grid = (triton.cdiv(n, self.block_r), triton.cdiv(self.row_units, self.block_c))
        block_bytes = self.block_r * self.block_c * unit
        self.num_warps = 8 if block_bytes >= 8192 else 4 if block_bytes >= 4096 else 2

    def units(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` viewed in the copy unit."""
        return t.view(torch.uint8).view(self.dtype) if t.dtype != self.dtype else t

    def stride(self, t: torch.Tensor) -> int:
        """``t``'s row stride in groups of ``vec`` units."""
        return t.stride(0) // self.vec


def _launch_copy(src2: torch.Tensor, dst2: torch.Tensor, src_index: torch.Tensor | None,
                 dst_index: torch.Tensor | None, n: int) -> None:
    """Launch ``_copy_rows`` on [*, R] views of one dtype (rows dense, any row stride): rows
    ``src_index`` (or 0..n-1) of ``src2`` into rows ``dst_index`` (or 0..n-1) of ``dst2``."""
    if n == 0 or src2.shape[1] == 0:
        return
    sh = _CopyShape([src2, dst2], n)
    s, d = sh.units(src2), sh.units(dst2)
    some = src_index if src_index is not None else dst_index
    assert some is not None
    _copy_rows[sh.grid](s, d, src_index if src_index is not None else some,
                        dst_index if dst_index is not None else some, n,
                        sh.row_units // sh.vec, sh.stride(s), sh.stride(d),
                        SRC_IDX=src_index is not None, DST_IDX=dst_index is not None,
                        VEC=sh.vec, BLOCK_R=sh.block_r, BLOCK_C=sh.block_c,
                        num_warps=sh.num_warps)


def _launch_peer_copy(srcs: list[torch.Tensor], dst2: torch.Tensor, owner: torch.Tensor,
                      rows: torch.Tensor, n: int) -> None:
    """``_peer_copy_rows`` over [*, R] source views of one dtype and one row stride, in passes of
    :data:`MAX_PEERS` sources."""
    sh = _CopyShape([dst2, *srcs], n)
    d = sh.units(dst2)
    ss = [sh.units(s) for s in srcs]
    for base in range(0, len(ss), MAX_PEERS):
        part = tuple(ss[base: base + MAX_PEERS])
        _peer_copy_rows[sh.grid](part, d, owner, rows, n, sh.row_units // sh.vec,
                                 sh.stride(ss[0]), sh.stride(d), base, NSRC=len(part),
                                 VEC=sh.vec, BLOCK_R=sh.block_r, BLOCK_C=sh.block_c,
                                 num_warps=sh.num_warps)


def _check_index(op: str, index: torch.Tensor, t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype not in (
            torch.int64, torch.int32):
        raise ValueError(f"{op}: index must be a 1-D int64 tensor, got "
                         f"{getattr(index, 'dtype', type(index).__name__)} "
                         f"{tuple(getattr(index, 'shape', ()))}")
    if t.dim() < 1:
        raise ValueError(f"{op}: {what} must have a row dim 0, got a 0-d tensor")
    if index.device != t.device:
        raise ValueError(f"{op}: index on {index.device}, {what} on {t.device}")
    return index.contiguous()


def _gather(op: str, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    index = _check_index(op, index, src, "src")
    n = index.shape[0]
    out = torch.empty((n, *src.shape[1:]), dtype=src.dtype, device=src.device)
    if n == 0 or out.numel() == 0:
        return out
    _launch_copy(_dense_rows_or_copy(src), out.view(n, -1), index, None, n)
    return out


def _launch_pack(x: torch.Tensor, fmt: KVFormat, part: KVPart, dst: torch.Tensor,
                 rows: torch.Tensor | None, rotate: bool,
                 scale_dst: torch.Tensor | None = None) -> None:
    """``_fp8_pack_kernel`` over the N >= 1 rows of ``x`` (fp32 / bf16 / fp16) into ``dst``
    uint8 [N, 1, B] (row i at ``dst[i]``: ``rows`` None) or [S, P, B] (row i at page / token
    ``rows[i] // P``, ``rows[i] % P``; the scales at the same place of ``scale_dst`` when
    given)."""
    dims, block, rope, _ = fp8_layout(fmt, part)
    n = x.shape[0]
    nblk = dims // block
    pow2 = scale_format(part) == "ue8m0"
    block_q = triton.next_power_of_2(block)
    # the rotation's dot needs >= 16 rows; at 32 its registers spill (sm_90: 255 and 48 B,
    # 156 and none at 16)
    block_n = 16 if rotate else max(1, min(32, 4096 // block_q, triton.next_power_of_2(n)))
    grid = (triton.cdiv(n, block_n), nblk + (1 if rope else 0))
    out = OUT_DTYPES.get(x.dtype, 2)
    sd = dst if scale_dst is None else scale_dst
    _fp8_pack_kernel[grid](x, dst, x if rows is None else rows, sd, n, x.stride(0), x.stride(1),
                           dst.stride(0), dst.stride(1), sd.stride(0), sd.stride(1), dst.shape[1],
                           DIMS=dims, QB=block, NBLK=nblk, ROPE=rope, BLOCK_N=block_n,
                           BLOCK_Q=block_q,
                           BLOCK_RB=triton.next_power_of_2(max(2 * rope, 1)),
                           FLOOR=UE8M0_FLOOR_F32 if pow2 else AMAX_FLOOR_F32, POW2=pow2,
                           INV_MAX=INV_E4M3_MAX_F32, SCATTER=rows is not None, ROTATE=rotate,
                           OUT=out, F32_DOT=out == 2 or x.device.type == "cpu",
                           NORM=f32(dims ** -0.5), SPLIT=scale_dst is not None, num_warps=4)


_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class KVKernels:
    """The KV ops as Triton kernels (a part of ``TritonOps``). Same contract as
    :class:`cpkv.ops.api.KVOps`; results equal the torch reference bit for bit."""

    # ---- page movement ----------------------------------------------------------------------
    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``out[i] = src[index[i]]`` along dim 0; a new contiguous [n, ...] tensor. Indices are
        not range-checked on the device (an out-of-range index is the caller's bug)."""
        return _gather("page_gather", src, index)

    def page_scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[i]] = src[i]`` in place (``dst`` may be a view of a larger buffer);
        ``index`` entries are unique."""
        if (not isinstance(src, torch.Tensor) or dst.dim() < 1
                or src.shape != (index.shape[0], *dst.shape[1:]) or src.dtype != dst.dtype):
            raise ValueError(f"page_scatter: src {tuple(src.shape)} {src.dtype} does not fit "
                             f"index {tuple(index.shape)} into dst {tuple(dst.shape)} {dst.dtype}")
        index = _check_index("page_scatter", index, dst, "dst")
        if src.device != dst.device:
            raise ValueError(f"page_scatter: src on {src.device}, dst on {dst.device}")
        n = index.shape[0]
        if n == 0 or src.numel() == 0:
            return
        d2 = _dense_rows(dst)
        s2 = _dense_rows_or_copy(src)
        if d2 is not None:
            _launch_copy(s2, d2, None, index, n)
            return
        # rows of dst not dense in memory (rare; the pool's buffers never are): scatter into a
        # dense copy, write it back
        report_fallback(op="triton:page_scatter", requested="in-place scatter",
                        selected="scatter into a dense copy, then copy back",
                        reason=FallbackReason.KERNEL_VARIANT,
                        detail=f"destination rows not dense: shape {tuple(dst.shape)}, "
                               f"strides {dst.stride()}")
        tmp = dst.contiguous()
        _launch_copy(s2, _contiguous_rows(tmp), None, index, n)
        dst.copy_(tmp)

    def page_copy(self, dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor,
                  src_index: torch.Tensor) -> None:
        """``dst[dst_index[i]] = src[src_index[i]]`` in one kernel; ``dst`` or ``src`` may be
        pinned host memory (the GPU reads or writes it directly over the bus)."""
        runs = check_page_copy_args(dst, dst_index, src, src_index)
        for name, t in (("dst", dst), ("src", src)):
            if t.device != runs and not t.is_pinned():
                raise ValueError(f"page_copy: {name} is host memory that is not pinned: a GPU "
                                 f"kernel cannot read it")
        n = dst_index.shape[0]
        if n == 0 or dst.numel() == 0:
            return
        d2, s2 = _dense_rows(dst), _dense_rows(src)
        if d2 is None or s2 is None:
            raise ValueError(f"page_copy: rows must be dense in memory, got strides "
                             f"{dst.stride()} and {src.stride()}")
        _launch_copy(s2, d2, src_index.contiguous(), dst_index.contiguous(), n)

    def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """Rank-major padded rows back to natural order: ``natural[n] = gathered[perm[n]]``."""
        return _gather("rerange", gathered, perm)

    def peer_gather(self, srcs: Sequence[torch.Tensor], owner: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
        """``out[i] = srcs[owner[i]][rows[i]]`` in one kernel (per :data:`MAX_PEERS` sources);
        ``srcs[r]`` may live on another GPU mapped into this one (symmetric memory over NVLink).
        Owners and rows are not range-checked on the device."""
        check_peer_gather_args(srcs, owner, rows)
        n = owner.shape[0]
        out = torch.empty((n, *srcs[0].shape[1:]), dtype=srcs[0].dtype, device=owner.device)
        if n == 0 or out.numel() == 0:
            return out
        views = [v for v in (_dense_rows(s) for s in srcs) if v is not None]
        if len(views) < len(srcs) or len({v.stride(0) for v in views}) > 1:
            report_fallback(op="triton:peer_gather", requested="one pass over the sources",
                            selected="dense copies of the sources, then one pass",
                            reason=FallbackReason.KERNEL_VARIANT,
                            detail="source rows not dense or row strides differ: "
                                   f"{[tuple(s.stride()) for s in srcs]}")
            views = [_contiguous_rows(s) for s in srcs]
        _launch_peer_copy(views, out.view(n, -1), owner.contiguous(), rows.contiguous(), n)
        return out

    def page_rows(self, keys: torch.Tensor, block_table: torch.Tensor,
                  row_request: torch.Tensor, page_size: int) -> torch.Tensor:
        """Request-local keys as the pool's token rows in one pass (see
        :class:`cpkv.ops.api.KVOps`); keys are not range-checked on the device."""
        check_page_rows_args(keys, block_table, row_request, page_size)
        n, k = keys.shape
        out = torch.empty((n, k), dtype=torch.int32, device=keys.device)
        if n == 0 or k == 0:
            return out
        block = min(1024, triton.next_power_of_2(k))
        _page_rows_kernel[(n, triton.cdiv(k, block))](
            keys, block_table, row_request, out, k, keys.stride(0), keys.stride(1),
            block_table.stride(0), block_table.stride(1), out.stride(0), page_size,
            BLOCK=block, num_warps=4)
        return out

    # ---- fp8 ---------------------------------------------------------------------------------
    def fp8_pack(self, x: torch.Tensor, fmt: KVFormat, part: KVPart) -> torch.Tensor:
        """Quantise rows to the fp8 pool layout; bytes identical to the torch reference."""
        dims, _, rope, nbytes = fp8_layout(fmt, part)
        if x.dim() != 2 or x.shape[1] != dims + rope:
            raise ValueError(f"fp8_pack({part}): expected x of shape [N, {dims + rope}] for "
                             f"{fmt!r}, got {tuple(x.shape)}")
        if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
            raise ValueError(f"fp8_pack({part}): x must be a float tensor, got {x.dtype}")
        wide = x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
        x_in = x
        if wide:  # float64: the reference rounds the fp8 part to fp32 first, as .float() does
            x = x.float()
        n = x.shape[0]
        out = torch.empty((n, nbytes), dtype=torch.uint8, device=x.device)
        if n:
            _launch_pack(x, fmt, part, out.view(n, 1, nbytes), None, False)
        if wide and rope:  # the reference casts float64 rope straight to bf16 (one rounding)
            out[:, nbytes - 2 * rope:] = x_in[:, dims:].to(torch.bfloat16).contiguous().view(
                torch.uint8)
        return out

    def fp8_store(self, x: torch.Tensor, fmt: KVFormat, part: KVPart, dst: torch.Tensor,
                  rows: torch.Tensor, rotate: bool,
                  scale_dst: torch.Tensor | None = None) -> None:
        """Quantize rows straight into a part's pages at (``rows // P``, ``rows % P``), the
        index-K rotated first when asked. See :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
            OpDeclined: float64 rows, or the rotation of a head dim under 16."""
        check_fp8_store_args(x, fmt, part, dst, rows, rotate, scale_dst)
        if x.dtype not in OUT_DTYPES:
            raise OpDeclined(f"fp8_store: {x.dtype} rows (the kernel takes bf16, fp16, fp32)")
        if rotate and x.shape[1] < 16:
            raise OpDeclined(f"fp8_store: the rotation of head dim {x.shape[1]} (the dot needs "
                             f">= 16)")
        if x.shape[0]:
            _launch_pack(x, fmt, part, dst, rows, rotate, scale_dst)

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: KVPart,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`fp8_pack`: ``float32(q) * scale`` cast once to ``dtype``, rope
        as stored. float32 / bfloat16 / float16 are written by the kernel; any other dtype is
        the kernel's float32 result cast by torch (the same single cast the reference does).
        With ``index`` the kernel reads row ``index[i]`` for output row i (one pass)."""
        dims, block, rope, nbytes = fp8_layout(fmt, part)
        if packed.dim() != 2 or packed.shape[1] != nbytes or packed.dtype != torch.uint8:
            raise ValueError(f"fp8_unpack({part}): expected uint8 [N, {nbytes}] for {fmt!r}, "
                             f"got {packed.dtype} {tuple(packed.shape)}")
        if index is not None:
            index = _check_index("fp8_unpack", index, packed, "packed")
        n = packed.shape[0] if index is None else index.shape[0]
        kind = _OUT_KIND.get(dtype)
        out = torch.empty((n, dims + rope), dtype=dtype if kind is not None else torch.float32,
                          device=packed.device)
        if n > 0:
            nblk = dims // block
            block_q = triton.next_power_of_2(block)
            block_n = max(1, min(32, 4096 // block_q, triton.next_power_of_2(n)))
            grid = (triton.cdiv(n, block_n), nblk + (1 if rope else 0))
            o = out.view(torch.int16) if kind == 1 else out
            _fp8_unpack_kernel[grid](packed, o, index if index is not None else o, n,
                                     packed.stride(0), packed.stride(1),
                                     o.stride(0), DIMS=dims, QB=block, NBLK=nblk, ROPE=rope,
                                     BLOCK_N=block_n, BLOCK_Q=block_q,
                                     BLOCK_R=triton.next_power_of_2(max(rope, 1)),
                                     OUT=0 if kind is None else kind,
                                     HAS_INDEX=index is not None, num_warps=4)
        # fp32 -> dtype once, as the reference (the rope's bf16 -> fp32 step is exact)
        return out if kind is not None else out.to(dtype)
