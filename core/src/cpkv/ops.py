"""The compute ops a backend provides, and the per-run table that binds each op to a backend.

Backends implement any subset of :class:`~cpkv.contracts.KVOps` (defined with the contracts,
re-exported here; one attribute per :class:`~cpkv.contracts.Op`);
the registry picks, per op, the first backend in the preference order that provides it and is
available on every rank; a call that backend declines (:class:`~cpkv.contracts.OpDeclined`: a
shape its kernel does not take) runs on the next one. The core calls ops only through an
:class:`OpTable`, never by importing a backend. Ops never sync the host and never allocate
per-call host tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cpkv.contracts import (
    FallbackReason,
    KVDtype,
    KVOps,
    KVPart,
    Op,
    OpDeclined,
    PageLayout,
    RopeStyle,
)
from cpkv.fallback import report_fallback
from cpkv.plugin import AgreeFn, BackendRegistry

if TYPE_CHECKING:
    import torch

    from cpkv.contracts import KVFormat

    # for type checkers the table IS a KVOps (each op typed as the Protocol says); at runtime it
    # is a plain object whose __getattr__ hands out the bound callable chosen per op
    _OpsBase = KVOps
else:
    _OpsBase = object

__all__ = ["KV_OPS", "KVOps", "KVPart", "OpTable"]

#: the ops the sharded pool and the CP runtime need (issue #3)
KV_OPS: tuple[Op, ...] = (Op.PAGE_GATHER, Op.PAGE_SCATTER, Op.PAGE_COPY, Op.RERANGE, Op.FP8_PACK,
                          Op.FP8_UNPACK, Op.PEER_GATHER)
#: the sparse-attention ops of one layer (issue #4)
ATTN_OPS: tuple[Op, ...] = (Op.INDEXER_LOGITS, Op.TOPK, Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED,
                            Op.ROPE)
ALL_OPS: tuple[Op, ...] = KV_OPS + ATTN_OPS


def fp8_layout(fmt: KVFormat, part: KVPart) -> tuple[int, int, int, int]:
    """``(dims, quant_block, rope_dim, bytes_per_token)`` of the packed fp8 ``part`` of ``fmt``.

    ``dims`` values per token are e4m3, in blocks of ``quant_block`` with one fp32 scale each;
    ``rope_dim`` bf16 values follow (latent only). The one definition every backend packs to.

    Raises:
        ValueError: unknown ``part``, or ``kv_lora_rank`` not divisible by ``quant_block``.
    """
    if part == "latent":
        dims, block, rope = fmt.kv_lora_rank, fmt.quant_block, fmt.rope_dim
        if dims % block:
            raise ValueError(f"fp8 latent needs kv_lora_rank divisible by quant_block, got "
                             f"kv_lora_rank={dims}, quant_block={block}")
    elif part == "index_k":
        dims, block, rope = fmt.index_head_dim, fmt.index_head_dim, 0
    else:
        raise ValueError(f"part must be 'latent' or 'index_k', got {part!r}")
    return dims, block, rope, dims + 4 * (dims // block) + 2 * rope


# ---- argument checks every backend runs (one wording of the errors, host-side metadata only) ----
def _check_ranges(op: str, n: int, key_start: torch.Tensor, key_end: torch.Tensor) -> None:
    import torch

    for name, r in (("key_start", key_start), ("key_end", key_end)):
        if r.shape != (n,) or r.dtype != torch.int64:
            raise ValueError(f"{op}: expected {name} int64 [{n}], got {r.dtype} {tuple(r.shape)}")


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
    if w.shape != (n, heads) or w.dtype != torch.float32:
        raise ValueError(f"indexer_logits: expected w float32 [{n}, {heads}], got {w.dtype} "
                         f"{tuple(w.shape)}")
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


def quantize_index_q(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries in fp8 with their scales folded into the head weights:
    ``(q8, w')`` where ``q8 = e4m3(q / s)`` per (row, head) with ``s = max(amax, 1e-12) / 448``
    and ``w' = w * s``. Since ``relu(s * x) = s * relu(x)`` for ``s > 0``,
    ``indexer_logits(q8, w', k8, k_scale, ...)`` is the indexer on the quantized q (DeepSeek's
    own inference quantizes the indexer's q and k alike). Plain torch, no host sync."""
    import torch

    amax = q.float().abs().amax(dim=-1).clamp_min(1e-12)  # [N, H]
    s = amax / 448.0
    q8 = (q.float() / s[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q8, w * s


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


def _part_span(fmt: KVFormat, page_size: int, part: KVPart) -> tuple[int, int, int]:
    """(byte offset of ``part`` in a token-major row, its bytes per token, the row step U of a
    part-major buffer: U divides every row start of that part)."""
    nl, b = fmt.latent_bytes_per_token, fmt.bytes_per_token
    lo, n = (0, nl) if part == "latent" else (nl, b - nl)
    first = lo * page_size  # the part's offset inside a part-major page
    return lo, n, math.gcd(page_size * b, first, n)


def part_view(pages: torch.Tensor, fmt: KVFormat, layout: PageLayout, part: KVPart,
              ) -> torch.Tensor:
    """One part's rows of a page buffer, for reading: [R, bytes of the part].

    ``pages`` is a contiguous uint8 [P, S, latent + index bytes] buffer (a pool layer, an
    all-gather's receive buffer) whose token t is slot t % S of page t // S. Token-major: the
    column slice of the token rows (row t is token t). Part-major: the part's rows are not evenly
    spaced, so this is an overlapping strided view whose row i starts i * U bytes in
    (:func:`part_index` gives a token's row): read it, never write through it.
    """
    lo, n, unit = _part_span(fmt, pages.shape[1], part)
    if layout is PageLayout.TOKEN_MAJOR:
        return pages.reshape(-1, fmt.bytes_per_token)[:, lo:lo + n]
    return pages.as_strided(((pages.numel() - n) // unit + 1, n), (unit, 1),
                            pages.storage_offset())


def page_blocks(pages: torch.Tensor, layout: PageLayout, latent_bytes: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Writable views of each page block's latent and index-K bytes: ``[n, S, latent]`` and
    ``[n, S, index]`` of a contiguous uint8 ``[n, S, latent + index]`` tensor of blocks laid out
    in ``layout`` (token-major: each token's latent then index-K bytes; part-major: the S latent
    rows, then the S index-K rows)."""
    n, s, b = pages.shape
    if layout is PageLayout.TOKEN_MAJOR:
        return pages[..., :latent_bytes], pages[..., latent_bytes:]
    flat = pages.view(n, s * b)
    return (flat[:, :s * latent_bytes].view(n, s, latent_bytes),
            flat[:, s * latent_bytes:].view(n, s, b - latent_bytes))


def part_index(tokens: torch.Tensor, fmt: KVFormat, layout: PageLayout, part: KVPart,
               ) -> torch.Tensor:
    """The rows of :func:`part_view` that hold ``tokens`` (int64 token rows: page x S + slot)."""
    if layout is PageLayout.TOKEN_MAJOR:
        return tokens
    s = fmt.page_size
    lo, n, unit = _part_span(fmt, s, part)
    return (tokens // s) * (s * fmt.bytes_per_token // unit) + (lo * s + (tokens % s) * n) // unit


def part_rows(pages: torch.Tensor, fmt: KVFormat, layout: PageLayout, part: KVPart,
              tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(:func:`part_view`, :func:`part_index` of ``tokens``); ``tokens`` None: every token in
    order (token-major only)."""
    if tokens is None and layout is PageLayout.PART_MAJOR:
        raise ValueError("part-major rows are read through a token index")
    rows = part_view(pages, fmt, layout, part)
    return rows, None if tokens is None else part_index(tokens, fmt, layout, part)


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
    want = (fmt.page_size, fmt.bytes_per_token)
    if pages.dim() != 3 or tuple(pages.shape[1:]) != want or pages.dtype != torch.uint8 \
            or not pages.is_contiguous():
        raise ValueError(f"sparse_mla_paged: expected contiguous uint8 pages [P, {want[0]}, "
                         f"{want[1]}], got {pages.dtype} {tuple(pages.shape)}")
    n = q.shape[0]
    if rows.dim() != 2 or rows.shape[0] != n or rows.dtype != torch.int32:
        raise ValueError(f"sparse_mla_paged: expected rows int32 [{n}, k], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if not 0 < dv <= q.shape[2]:
        raise ValueError(f"sparse_mla_paged: dv must be in (0, {q.shape[2]}], got {dv}")


def gather_latent(src: torch.Tensor, idx: torch.Tensor, picks: torch.Tensor, fmt: KVFormat,
                  dtype: torch.dtype, unpack: Callable[..., torch.Tensor],
                  gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent rows ``idx`` of ``src`` (a part's rows: :func:`part_view`), one per entry of
    ``picks`` (int32 [N, k], -1 empty), dequantized into [N * k, Dk] of ``dtype`` in one pass
    (a backend's ``fp8_unpack`` through the index, or its ``page_gather`` for float formats),
    and int32 [N, k] indices into them, -1 kept: what ``sparse_mla`` takes."""
    import torch

    n, k = picks.shape
    if fmt.dtype is KVDtype.FP8:
        lat = unpack(src, fmt, "latent", dtype, idx)
    else:
        width = torch.float32 if fmt.dtype is KVDtype.FP32 else torch.bfloat16
        lat = gather(src, idx).view(width).to(dtype)
    slots = torch.arange(n * k, dtype=torch.int32, device=picks.device).view(n, k)
    return lat, torch.where(picks >= 0, slots, torch.full_like(slots, -1))


def paged_latent(pages: torch.Tensor, rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype,
                 unpack: Callable[..., torch.Tensor],
                 gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_latent` of the token rows ``rows`` (int32 [N, k], -1 empty) of part-major
    ``pages``: ``sparse_mla_paged`` composed from a backend's own ops."""
    tokens = rows.clamp_min(0).reshape(-1).long()
    return gather_latent(part_view(pages, fmt, PageLayout.PART_MAJOR, "latent"),
                         part_index(tokens, fmt, PageLayout.PART_MAJOR, "latent"), rows, fmt,
                         dtype, unpack, gather)


class _Declinable:
    """One op's backends in preference order: the first that does not raise
    :class:`~cpkv.contracts.OpDeclined` runs the call. Each (backend, reason) is reported once,
    as fallback ``op_declined``."""

    def __init__(self, op: str, impls: list[tuple[str, Callable[..., Any]]]) -> None:
        self.op, self.impls = op, impls
        self._seen: set[tuple[str, str]] = set()

    @property
    def __self__(self) -> object:
        """Like a bound method's: the chosen backend's object (reports and tests look at it)."""
        return getattr(self.impls[0][1], "__self__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        last = len(self.impls) - 1
        for i, (name, fn) in enumerate(self.impls):
            try:
                return fn(*args, **kwargs)
            except OpDeclined as exc:
                if i == last:
                    raise RuntimeError(f"{self.op}: every backend declined the call; {name}: "
                                       f"{exc}") from exc
                if (name, str(exc)) not in self._seen:
                    self._seen.add((name, str(exc)))
                    report_fallback(op=self.op, requested=name, selected=self.impls[i + 1][0],
                                    reason=FallbackReason.OP_DECLINED, detail=f"{name}: {exc}")
        raise AssertionError("unreachable")


class OpTable(_OpsBase):
    """Op -> bound callable of the backend chosen for it. Resolved once per run (at plan time).

    Attribute access (``table.rerange(...)``) calls the chosen backend; ``table.chosen`` maps each
    op name to the backend name, for reports. Type checkers see a :class:`KVOps` (only the ops it
    was resolved for are there at runtime: another raises AttributeError naming the resolved ones).
    """

    def __init__(self, impls: dict[str, Callable[..., Any]], chosen: dict[str, str]) -> None:
        self._impls = impls
        self.chosen = dict(chosen)
        #: why backends of the preference were passed over (for reports)
        self.skipped: list[str] = []

    @classmethod
    def resolve(cls, registry: BackendRegistry, preference: Sequence[str],
                ops: Sequence[Op] = KV_OPS, agree: AgreeFn | None = None,
                device_type: str | None = None, quiet: bool = False) -> OpTable:
        """Pick a backend per op (fallbacks reported by the registry), bind the callables.

        Raises:
            LookupError: no backend in ``preference`` provides an op.
        """
        sel = registry.select(preference, [o.value for o in ops], agree=agree,
                              device_type=device_type, quiet=quiet)
        # a call the chosen backend declines goes down the preference
        impls: dict[str, Callable[..., Any]] = {
            k: _Declinable(k, [(s.name, getattr(s.impl, k)),
                               *((n, getattr(i, k)) for n, i in s.then)])
            for k, s in sel.items()}
        table = cls(impls, {k: s.name for k, s in sel.items()})
        table.skipped = sorted({d for s in sel.values() for d in s.skipped})
        return table

    def __getattr__(self, name: str) -> Callable[..., Any]:
        impls: dict[str, Callable[..., Any]] = self.__dict__.get("_impls", {})
        try:
            return impls[name]
        except KeyError:
            raise AttributeError(f"no backend was selected for op {name!r}; resolved ops: "
                                 f"{sorted(impls)}") from None
