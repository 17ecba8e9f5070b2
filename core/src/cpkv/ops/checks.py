"""The argument checks every backend runs before an op: one wording of the errors for all.

Each reads host-side metadata only (shapes, dtypes, devices), never tensor values, so it costs no
device sync. Each raises :class:`ValueError` naming the op, the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cpkv.contracts import KVDtype

if TYPE_CHECKING:
    import torch

    from cpkv.contracts import KVFormat, KVPart, RopeStyle

__all__ = ["check_fp8_store_args", "check_index_q_args", "check_indexer_args",
           "check_indexer_index_pages_args", "check_indexer_paged_args", "check_indexer_topk_args",
           "check_page_copy_args", "check_page_rows_args", "check_peer_gather_args",
           "check_rms_norm_args", "check_rope_args", "check_sparse_mla_args",
           "check_sparse_mla_paged_args", "check_topk_args", "check_v4_attention_args",
           "check_v4_compress_args", "check_v4_index_scores_args", "check_v4_topk_args"]


def _check_ranges(op: str, n: int, key_start: torch.Tensor, key_end: torch.Tensor) -> None:
    import torch

    for name, r in (("key_start", key_start), ("key_end", key_end)):
        if r.shape != (n,) or r.dtype != torch.int64:
            raise ValueError(f"{op}: expected {name} int64 [{n}], got {r.dtype} {tuple(r.shape)}")


def _check_head_weights(op: str, w: torch.Tensor, n: int, heads: int) -> None:
    import torch

    if w.shape != (n, heads) or w.dtype != torch.float32:
        raise ValueError(f"{op}: expected w float32 [{n}, {heads}], got {w.dtype} "
                         f"{tuple(w.shape)}")


def _check_pages(op: str, pages: torch.Tensor, fmt: KVFormat) -> None:
    import torch

    want = (fmt.page_size, fmt.bytes_per_token)
    if pages.dim() != 3 or tuple(pages.shape[1:]) != want or pages.dtype != torch.uint8 \
            or not pages.is_contiguous():
        raise ValueError(f"{op}: expected contiguous uint8 pages [P, {want[0]}, {want[1]}], got "
                         f"{pages.dtype} {tuple(pages.shape)}")


def check_rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle,
                    out: torch.Tensor | None) -> None:
    """Validate ``rope`` arguments.

    Raises:
        ValueError: x is not [N, R] or [N, H, R] float with R even, cos / sin are not [N, R] of
            x's dtype, ``style`` is unknown, or ``out`` has another shape or dtype.
    """
    if style not in ("interleave", "half"):
        raise ValueError(f"rope: style must be 'interleave' or 'half', got {style!r}")
    if x.dim() not in (2, 3) or not x.dtype.is_floating_point or x.shape[-1] % 2:
        raise ValueError(f"rope: expected x float [N, R] or [N, H, R] with R even, got {x.dtype} "
                         f"{tuple(x.shape)}")
    want = (x.shape[0], x.shape[-1])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or t.dtype != x.dtype:
            raise ValueError(f"rope: expected {name} {x.dtype} {list(want)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"rope: out must be {x.dtype} {tuple(x.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")


def check_index_q_args(q: torch.Tensor, w: torch.Tensor, rotate: bool) -> None:
    """Validate ``index_q_fp8`` arguments.

    Raises:
        ValueError: q is not float [N, H, D] (D >= 1), w is not float32 [N, H], or ``rotate``
            with D not a power of two.
    """
    import torch

    if q.dim() != 3 or not q.dtype.is_floating_point or q.dtype == torch.float8_e4m3fn \
            or q.shape[2] < 1:
        raise ValueError(f"index_q_fp8: expected q float [N, H, D] with D >= 1, got {q.dtype} "
                         f"{tuple(q.shape)}")
    if w.dtype != torch.float32 or tuple(w.shape) != tuple(q.shape[:2]):
        raise ValueError(f"index_q_fp8: expected w float32 {list(q.shape[:2])}, got {w.dtype} "
                         f"{tuple(w.shape)}")
    d = q.shape[2]
    if rotate and (d < 1 or d & (d - 1)):
        raise ValueError(f"index_q_fp8: the rotation needs a power-of-two head dim, got {d}")


def check_fp8_store_args(x: torch.Tensor, fmt: KVFormat, part: KVPart, dst: torch.Tensor,
                         rows: torch.Tensor, rotate: bool,
                         scale_dst: torch.Tensor | None = None) -> None:
    """Validate ``fp8_store`` arguments.

    Raises:
        ValueError: x not float [N, D] (D: ``fmt``'s dims of ``part``), dst not uint8 [S, P, B]
            (B: the packed bytes, less the scales' with ``scale_dst``) or scale_dst not uint8
            [S, P, 4 x blocks], with unit byte strides, rows not int64 [N], ``rotate`` for the
            latent or with a head dim that is not a power of two.
    """
    import torch

    from .layout import fp8_layout

    dims, block, rope, nbytes = fp8_layout(fmt, part)
    d = dims + rope
    sbytes = 4 * (dims // block)
    if scale_dst is not None:
        nbytes -= sbytes
        if scale_dst.dim() != 3 or scale_dst.dtype != torch.uint8 or tuple(
                scale_dst.shape) != (*dst.shape[:2], sbytes) or scale_dst.stride(2) != 1:
            raise ValueError(f"fp8_store({part}): expected scale_dst uint8 "
                             f"[{', '.join(map(str, dst.shape[:2]))}, {sbytes}] with unit byte "
                             f"stride, got {scale_dst.dtype} {tuple(scale_dst.shape)} strides "
                             f"{scale_dst.stride()}")
    if x.dim() != 2 or x.shape[1] != d or not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(f"fp8_store({part}): expected x float [N, {d}] for {fmt!r}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if dst.dim() != 3 or dst.dtype != torch.uint8 or dst.shape[2] != nbytes or (
            nbytes > 1 and dst.stride(2) != 1):
        raise ValueError(f"fp8_store({part}): expected dst uint8 [S, P, {nbytes}] with unit "
                         f"byte stride, got {dst.dtype} {tuple(dst.shape)} strides "
                         f"{dst.stride()}")
    if rows.dtype != torch.int64 or tuple(rows.shape) != (x.shape[0],):
        raise ValueError(f"fp8_store({part}): expected rows int64 [{x.shape[0]}], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    if rotate and part != "index_k":
        raise ValueError(f"fp8_store({part}): the rotation applies to the index-K only")
    if rotate and (d < 1 or d & (d - 1)):
        raise ValueError(f"fp8_store({part}): the rotation needs a power-of-two head dim, "
                         f"got {d}")


def check_page_rows_args(keys: torch.Tensor, block_table: torch.Tensor,
                         row_request: torch.Tensor, page_size: int) -> None:
    """Validate ``page_rows`` arguments.

    Raises:
        ValueError: keys is not int32 [N, k], block_table not int32 [R, M], row_request not
            int32 [N], or ``page_size < 1``.
    """
    import torch

    if keys.dim() != 2 or keys.dtype != torch.int32:
        raise ValueError(f"page_rows: expected keys int32 [N, k], got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"page_rows: expected block_table int32 [R, M], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if row_request.dtype != torch.int32 or tuple(row_request.shape) != (keys.shape[0],):
        raise ValueError(f"page_rows: expected row_request int32 [{keys.shape[0]}], got "
                         f"{row_request.dtype} {tuple(row_request.shape)}")
    if page_size < 1:
        raise ValueError(f"page_rows: page_size must be >= 1, got {page_size}")


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Validate ``rms_norm`` arguments.

    Raises:
        ValueError: x is not float [N, D] with unit column stride, or weight is not [D] of
            x's dtype.
    """
    if x.dim() != 2 or not x.dtype.is_floating_point or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"rms_norm: expected x float [N, D] with unit column stride, got "
                         f"{x.dtype} {tuple(x.shape)} strides {tuple(x.stride())}")
    if weight.dtype != x.dtype or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"rms_norm: expected weight {x.dtype} [{x.shape[1]}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")


def check_indexer_args(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> bool:
    """Validate ``indexer_logits`` arguments; returns whether the keys are fp8 (scaled).

    Raises:
        ValueError: a shape or dtype does not match, a float key comes with a scale or an fp8 key
            without one.
    """
    import torch

    if q.dim() != 3 or k.dim() != 2 or q.shape[2] != k.shape[1]:
        raise ValueError(f"indexer_logits: expected q [N, Hi, D] and k [T, D], got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    n, heads, _ = q.shape
    t = k.shape[0]
    fp8 = torch.float8_e4m3fn
    if not q.dtype.is_floating_point or (q.dtype == fp8 and k.dtype != fp8):
        raise ValueError(f"indexer_logits: q must be a float tensor (float8_e4m3fn only with "
                         f"float8_e4m3fn keys), got q {q.dtype} with k {k.dtype}")
    _check_head_weights("indexer_logits", w, n, heads)
    _check_ranges("indexer_logits", n, key_start, key_end)
    if k.dtype == torch.float8_e4m3fn:
        if k_scale is None or k_scale.shape != (t,) or k_scale.dtype != torch.float32:
            got = "None" if k_scale is None else f"{k_scale.dtype} {tuple(k_scale.shape)}"
            raise ValueError(f"indexer_logits: float8_e4m3fn keys need k_scale float32 [{t}], "
                             f"got {got}")
        return True
    if not k.dtype.is_floating_point:
        raise ValueError(f"indexer_logits: k must be a float or float8_e4m3fn tensor, got {k.dtype}")
    if k_scale is not None:
        raise ValueError(f"indexer_logits: k_scale is only for float8_e4m3fn keys, got "
                         f"{k.dtype} keys with a k_scale {tuple(k_scale.shape)}")
    return False


def check_indexer_paged_args(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor, op: str = "indexer_logits_paged") -> bool:
    """Validate ``indexer_logits_paged`` arguments (``op`` names the op in the errors); returns
    whether the keys are fp8 (scaled).

    Raises:
        ValueError: a shape or dtype does not match ``fmt`` or the other arguments, or q is
            ``float8_e4m3fn`` while the pool's keys are not.
    """
    import torch

    d = fmt.index_head_dim
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"{op}: expected q [N, Hi, {d}], got {tuple(q.shape)}")
    n, heads, _ = q.shape
    fp8 = fmt.dtype is KVDtype.FP8
    if not q.dtype.is_floating_point or (q.dtype == torch.float8_e4m3fn and not fp8):
        raise ValueError(f"{op}: q must be a float tensor (float8_e4m3fn only with an fp8 pool), "
                         f"got q {q.dtype} with a {fmt.dtype.value} pool")
    _check_head_weights(op, w, n, heads)
    _check_pages(op, pages, fmt)
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"{op}: expected block_table int32 [R, M], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if row_request.shape != (n,) or row_request.dtype != torch.int32:
        raise ValueError(f"{op}: expected row_request int32 [{n}], got {row_request.dtype} "
                         f"{tuple(row_request.shape)}")
    if key_end.shape != (n,) or key_end.dtype != torch.int64:
        raise ValueError(f"{op}: expected key_end int64 [{n}], got {key_end.dtype} "
                         f"{tuple(key_end.shape)}")
    return fp8


def check_indexer_index_pages_args(q: torch.Tensor, w: torch.Tensor, index_pages: torch.Tensor,
                                   fmt: KVFormat, block_table: torch.Tensor,
                                   row_request: torch.Tensor, key_end: torch.Tensor) -> bool:
    """Validate ``indexer_logits_index_pages`` arguments; returns whether the keys are fp8.

    Raises:
        ValueError: as :func:`check_indexer_paged_args`, and ``index_pages`` is not uint8
            [P, >= S x index bytes] with unit column stride.
    """
    import torch

    per = fmt.page_size * fmt.index_bytes_per_token
    if index_pages.dtype != torch.uint8 or index_pages.dim() != 2 or not fmt.index_k \
            or index_pages.shape[1] < per or (index_pages.stride(1) != 1
                                              and index_pages.shape[1] > 1):
        raise ValueError(f"indexer_logits_index_pages: expected uint8 [P, >= {per}] index-K "
                         f"pages with unit column stride, got {index_pages.dtype} "
                         f"{tuple(index_pages.shape)} strides {tuple(index_pages.stride())}"
                         + ("" if fmt.index_k else " (the format caches no index-K)"))
    pages = index_pages.new_empty(0, fmt.page_size, fmt.bytes_per_token)
    return check_indexer_paged_args(q, w, pages, fmt, block_table, row_request, key_end,
                                    op="indexer_logits_index_pages")


def check_topk_args(logits: torch.Tensor, k: int, key_start: torch.Tensor,
                    key_end: torch.Tensor) -> None:
    """Validate ``topk`` arguments.

    Raises:
        ValueError: ``logits`` is not 2-D float, ``k`` is negative or a range is mis-shaped.
    """
    import torch

    if (logits.dim() != 2 or not logits.dtype.is_floating_point
            or logits.dtype == torch.float8_e4m3fn):
        raise ValueError(f"topk: expected float logits [N, T], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if k < 0:
        raise ValueError(f"topk: k must be >= 0, got {k}")
    _check_ranges("topk", logits.shape[0], key_start, key_end)


def check_indexer_topk_args(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                            k_scale: torch.Tensor | None, key_start: torch.Tensor,
                            key_end: torch.Tensor, topk: int) -> bool:
    """Validate ``indexer_topk`` arguments (those of ``indexer_logits``, and ``topk``); returns
    whether the keys are fp8 (scaled).

    Raises:
        ValueError: an ``indexer_logits`` argument does not fit, or ``topk`` is negative.
    """
    fp8 = check_indexer_args(q, w, k, k_scale, key_start, key_end)
    if topk < 0:
        raise ValueError(f"indexer_topk: topk must be >= 0, got {topk}")
    return fp8


def check_page_copy_args(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor,
                         src_index: torch.Tensor) -> torch.device:
    """Validate ``page_copy`` arguments (metadata only); returns the device that runs the copy
    (where both indices live: the GPU when one side is host memory).

    Raises:
        ValueError: ``dst`` / ``src`` differ in dtype or trailing shape, the indices are not
            1-D integer tensors of one length on one device, or the devices do not fit.
    """
    import torch

    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"page_copy: {name} must be a tensor with a row dim 0")
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"page_copy: dst {tuple(dst.shape)} {dst.dtype} and src "
                         f"{tuple(src.shape)} {src.dtype} differ in dtype or row shape")
    for name, t in (("dst_index", dst_index), ("src_index", src_index)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 1
                or t.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"page_copy: {name} must be a 1-D int64 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if dst_index.shape != src_index.shape or dst_index.device != src_index.device:
        raise ValueError(f"page_copy: dst_index {tuple(dst_index.shape)} on {dst_index.device} "
                         f"and src_index {tuple(src_index.shape)} on {src_index.device} differ")
    runs = dst_index.device
    for name, t in (("dst", dst), ("src", src)):
        if t.device != runs and not (t.device.type == "cpu" and runs.type == "cuda"):
            raise ValueError(f"page_copy: {name} on {t.device}, indices on {runs}")
    return runs


def check_peer_gather_args(srcs: Sequence[torch.Tensor], owner: torch.Tensor,
                           rows: torch.Tensor) -> None:
    """Validate ``peer_gather`` arguments (metadata only: owner/row values are not read).

    Raises:
        ValueError: no source, sources differ in dtype / trailing shape / device, or owner and
            rows are not int64 [n] on the sources' device.
    """
    import torch

    if not srcs:
        raise ValueError("peer_gather: need at least one source buffer")
    first = srcs[0]
    for r, s in enumerate(srcs):
        if (not isinstance(s, torch.Tensor) or s.dim() < 1 or s.dtype != first.dtype
                or s.shape[1:] != first.shape[1:] or s.device != first.device):
            raise ValueError(f"peer_gather: source {r} is {getattr(s, 'dtype', type(s).__name__)} "
                             f"{tuple(getattr(s, 'shape', ()))} on {getattr(s, 'device', '?')}; "
                             f"every source must be [*, {', '.join(map(str, first.shape[1:]))}] "
                             f"{first.dtype} on {first.device}")
    for name, t in (("owner", owner), ("rows", rows)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64
                or t.device != first.device):
            raise ValueError(f"peer_gather: {name} must be int64 [n] on {first.device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if owner.shape != rows.shape:
        raise ValueError(f"peer_gather: owner {tuple(owner.shape)} and rows {tuple(rows.shape)} "
                         "differ in length")


def check_sparse_mla_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                          dv: int) -> None:
    """Validate ``sparse_mla`` arguments (q/kv float, not fp8: the caller unpacks an fp8 pool).

    Raises:
        ValueError: a shape or dtype does not match, or ``dv`` is out of range.
    """
    import torch

    if q.dim() != 3 or kv.dim() != 2 or q.shape[2] != kv.shape[1]:
        raise ValueError(f"sparse_mla: expected q [N, H, Dk] and kv [T, Dk], got q "
                         f"{tuple(q.shape)} and kv {tuple(kv.shape)}")
    fp8 = torch.float8_e4m3fn
    if not (q.dtype.is_floating_point and kv.dtype.is_floating_point) or fp8 in (q.dtype,
                                                                                 kv.dtype):
        raise ValueError(f"sparse_mla: q and kv must be float tensors, got {q.dtype} and "
                         f"{kv.dtype}")
    n, _, dk = q.shape
    if indices.dim() != 2 or indices.shape[0] != n or indices.dtype != torch.int32:
        raise ValueError(f"sparse_mla: expected indices int32 [{n}, k], got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if not 0 < dv <= dk:
        raise ValueError(f"sparse_mla: dv must be in (0, {dk}], got {dv}")


def check_sparse_mla_paged_args(q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                                fmt: KVFormat, dv: int) -> None:
    """Validate ``sparse_mla_paged`` arguments.

    Raises:
        ValueError: a shape or dtype does not match, or ``dv`` is out of range.
    """
    import torch

    if q.dim() != 3 or q.shape[2] != fmt.kv_lora_rank + fmt.rope_dim:
        raise ValueError(f"sparse_mla_paged: expected q [N, H, {fmt.kv_lora_rank + fmt.rope_dim}]"
                         f", got {tuple(q.shape)}")
    _check_pages("sparse_mla_paged", pages, fmt)
    n = q.shape[0]
    if rows.dim() != 2 or rows.shape[0] != n or rows.dtype != torch.int32:
        raise ValueError(f"sparse_mla_paged: expected rows int32 [{n}, k], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if not 0 < dv <= q.shape[2]:
        raise ValueError(f"sparse_mla_paged: dv must be in (0, {q.shape[2]}], got {dv}")


def _float(t: torch.Tensor) -> bool:
    import torch

    return t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn


def check_v4_compress_args(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, rate: int,
                           overlap: bool, prior: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Validate ``v4_compress`` arguments.

    Raises:
        ValueError: ``rate < 1``, kv / gate not float [rows, w] of one shape and dtype, ape not
            float32 [rate, w], w odd with ``overlap``, or ``prior`` not two [rate, w] float
            tensors.
    """
    import torch

    if rate < 1:
        raise ValueError(f"v4_compress: rate must be >= 1, got {rate}")
    if kv.dim() != 2 or not _float(kv) or gate.shape != kv.shape or gate.dtype != kv.dtype:
        raise ValueError(f"v4_compress: expected kv and gate float [rows, w] of one shape and "
                         f"dtype, got {kv.dtype} {tuple(kv.shape)} and {gate.dtype} "
                         f"{tuple(gate.shape)}")
    w = kv.shape[1]
    if ape.dtype != torch.float32 or tuple(ape.shape) != (rate, w):
        raise ValueError(f"v4_compress: expected ape float32 [{rate}, {w}], got {ape.dtype} "
                         f"{tuple(ape.shape)}")
    if overlap and w % 2:
        raise ValueError(f"v4_compress: an overlapping compressor needs an even width (Ca ++ "
                         f"Cb), got {w}")
    if prior is not None and (len(prior) != 2 or any(
            tuple(p.shape) != (rate, w) or not _float(p) for p in prior)):
        got = [f"{p.dtype} {tuple(p.shape)}" for p in prior]
        raise ValueError(f"v4_compress: expected prior (kv, gate) float [{rate}, {w}], got {got}")


def check_v4_index_scores_args(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                               limit: torch.Tensor) -> None:
    """Validate ``v4_index_scores`` arguments.

    Raises:
        ValueError: q not float [N, H, d], w not float32 [N, H], keys not float [E, d], or
            limit not int64 [N].
    """
    import torch

    if q.dim() != 3 or keys.dim() != 2 or q.shape[2] != keys.shape[1] or not _float(q) \
            or not _float(keys):
        raise ValueError(f"v4_index_scores: expected q float [N, H, d] and keys float [E, d], "
                         f"got q {q.dtype} {tuple(q.shape)} and keys {keys.dtype} "
                         f"{tuple(keys.shape)}")
    _check_head_weights("v4_index_scores", w, q.shape[0], q.shape[1])
    if limit.dtype != torch.int64 or tuple(limit.shape) != (q.shape[0],):
        raise ValueError(f"v4_index_scores: expected limit int64 [{q.shape[0]}], got "
                         f"{limit.dtype} {tuple(limit.shape)}")


def check_v4_topk_args(scores: torch.Tensor, k: int) -> None:
    """Validate ``v4_topk`` arguments.

    Raises:
        ValueError: scores not float [N, E], or ``k < 0``.
    """
    if scores.dim() != 2 or not _float(scores):
        raise ValueError(f"v4_topk: expected float scores [N, E], got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if k < 0:
        raise ValueError(f"v4_topk: k must be >= 0, got {k}")


def check_v4_attention_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                            sink: torch.Tensor) -> None:
    """Validate ``v4_attention`` arguments.

    Raises:
        ValueError: q not float [N, H, D], kv not [S, D] of q's dtype, indices not int32 /
            int64 [N, K], or sink not float32 [H].
    """
    import torch

    if q.dim() != 3 or not _float(q) or kv.dim() != 2 or kv.dtype != q.dtype \
            or kv.shape[1] != q.shape[2]:
        raise ValueError(f"v4_attention: expected q float [N, H, D] and kv [S, D] of its "
                         f"dtype, got q {q.dtype} {tuple(q.shape)} and kv {kv.dtype} "
                         f"{tuple(kv.shape)}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 2 \
            or indices.shape[0] != q.shape[0]:
        raise ValueError(f"v4_attention: expected indices int32 / int64 [{q.shape[0]}, K], got "
                         f"{indices.dtype} {tuple(indices.shape)}")
    if sink.dtype != torch.float32 or tuple(sink.shape) != (q.shape[1],):
        raise ValueError(f"v4_attention: expected sink float32 [{q.shape[1]}], got {sink.dtype} "
                         f"{tuple(sink.shape)}")
