"""The compute ops: :class:`Op` (their names) and the :class:`KVOps` Protocol (one method per
op: signature, shapes, dtypes and errors in its docstring), written once, side by side
(``tests/test_op_list.py`` checks that the two name the same ops). A backend implements any
subset of them; :class:`OpDeclined` is how one of its ops passes a call on.

Typing only: torch is imported for type checkers, never at runtime (contracts hold no tensors).
The per-run table that binds each op to a backend is :class:`cpkv.ops.OpTable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from .formats import KVFormat

__all__ = ["KVOps", "KVPart", "Op", "OpDeclined", "RopeStyle"]

#: which pool buffer a row belongs to: the MLA latent (nope + rope) or the indexer key
KVPart = Literal["latent", "index_k"]
#: the rotary embedding's pairing: MLA's interleaved pairs written de-interleaved, or the
#: indexer's halves (``rotate_half``)
RopeStyle = Literal["interleave", "half"]


class Op(StrEnum):
    """The compute ops, one per method of :class:`KVOps` (the value is the method's name). A
    backend lists the ops it implements."""

    PAGE_GATHER = "page_gather"
    PAGE_SCATTER = "page_scatter"
    PAGE_COPY = "page_copy"
    RERANGE = "rerange"
    FP8_PACK = "fp8_pack"
    FP8_UNPACK = "fp8_unpack"
    FP8_STORE = "fp8_store"
    PEER_GATHER = "peer_gather"
    INDEXER_LOGITS = "indexer_logits"
    INDEXER_LOGITS_PAGED = "indexer_logits_paged"
    INDEXER_LOGITS_INDEX_PAGES = "indexer_logits_index_pages"
    TOPK = "topk"
    INDEXER_TOPK = "indexer_topk"
    SPARSE_MLA = "sparse_mla"
    SPARSE_MLA_PAGED = "sparse_mla_paged"
    ROPE = "rope"
    INDEX_Q_FP8 = "index_q_fp8"
    PAGE_ROWS = "page_rows"
    RMS_NORM = "rms_norm"
    V4_COMPRESS = "v4_compress"
    V4_INDEX_SCORES = "v4_index_scores"
    V4_TOPK = "v4_topk"
    V4_INDEX_TOPK = "v4_index_topk"
    V4_ATTENTION = "v4_attention"


class OpDeclined(Exception):
    """Raised by a backend's op, before it touches anything, when it cannot take this call
    (a shape, dtype or device its kernel does not support): the next backend of the preference
    that provides the op runs it instead, reported once per reason as fallback ``op_declined``.
    The message says why (it is the event's detail). The decision must depend only on what is
    the same on every rank (shapes, dtypes, settings)."""


class KVOps(Protocol):
    """Signatures of the compute ops, one method per :class:`Op`. Shapes: N rows (tokens) or
    pages along dim 0; B bytes per token.

    Wrong shapes or dtypes raise ValueError naming them (each method's ``Raises`` says what is
    checked: metadata only, the checks of :mod:`cpkv.ops.api`); any op may raise
    :class:`OpDeclined` before touching anything when its kernel does not take the call (the next
    backend of the preference runs it).
    Ops never sync the host and never allocate per-call host tensors.
    """

    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``out[i] = src[index[i]]`` along dim 0.

        ``src`` is [P, ...] (pages or token rows), ``index`` int64 [n] on ``src.device``;
        returns a new contiguous [n, ...] tensor of ``src``'s dtype. Entries may repeat. Nothing
        is checked (the hottest op): an index out of range fails as the device's indexing does.
        """
        ...

    def page_scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[i]] = src[i]`` in place along dim 0; ``index`` entries are unique.

        ``dst`` [P, ...], ``src`` [n, ...] of ``dst``'s dtype and trailing shape, ``index`` int64
        [n] on ``dst.device``.

        Raises:
            ValueError: ``src`` does not have the shape [len(index), *dst.shape[1:]] or the dtype
                of ``dst``.
        """
        ...

    def page_copy(self, dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor,
                  src_index: torch.Tensor) -> None:
        """``dst[dst_index[i]] = src[src_index[i]]`` in place along dim 0, in one pass (no
        intermediate).

        ``dst_index`` entries are unique; ``dst`` and ``src`` have one dtype and trailing shape
        and may be the same tensor (rows not overlapping). One of them may be pinned host memory
        while the other is on a GPU (the prefix cache's host tier): both indices then live on the
        GPU, which runs the copy and reads or writes host memory directly. Otherwise everything
        is on one device. ``dst_index`` / ``src_index`` int64 [n].

        Raises:
            ValueError: dtypes or trailing shapes differ, an index is not 1-D int64 or the two
                differ in length, or the devices do not fit the rule above
                (:func:`cpkv.ops.check_page_copy_args`).
        """
        ...

    def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """Rank-major padded rows back to natural order in one pass: ``natural[n] =
        gathered[perm[n]]``.

        ``gathered`` [G, ...], ``perm`` int64 [N] on its device; returns a new contiguous
        [N, ...] tensor of ``gathered``'s dtype (padded rows unused). Nothing is checked, as for
        :meth:`page_gather`.
        """
        ...

    def fp8_pack(self, x: torch.Tensor, fmt: KVFormat, part: KVPart) -> torch.Tensor:
        """Quantize rows to the pool's fp8 bytes: uint8 [N, B].

        ``part="latent"``: x [N, kv_lora_rank + rope_dim] -> per token ``kv_lora_rank`` e4m3
        bytes, ``kv_lora_rank // quant_block`` fp32 scales, ``rope_dim`` bf16 values (656 B for
        DeepSeek-V3.2). ``part="index_k"``: x [N, index_head_dim] -> e4m3 bytes and one fp32
        scale for the whole key (132 B); ``quant_block`` applies to the latent only. Native
        (little-endian) byte order, in that order. Bit-exact across backends: in fp32,
        ``scale = max(amax, 1e-12) / 448`` as a true division (not a multiply by 1/448, which
        rounds differently), ``q = e4m3(clamp(x / scale, -448, 448))`` rounded to nearest even.

        Raises:
            ValueError: ``x`` is not 2-D or its last dim does not match ``fmt`` and ``part``.
        """
        ...

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: KVPart,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`fp8_pack`: [N, D] ``dtype``, ``float32(q) * scale`` cast once to
        ``dtype``; rope as stored.

        ``packed`` uint8 [N, B] may have any row stride (a column slice of the pool's token
        rows). With ``index`` (int64 [n] on ``packed``'s device) row i of the result is the
        unpacking of ``packed[index[i]]``: the gather fused into the same pass (a full view read
        where the materialization left its rows, no natural-order copy first).

        Raises:
            ValueError: ``packed`` is not 2-D uint8 with B bytes per row.
        """
        ...

    def fp8_store(self, x: torch.Tensor, fmt: KVFormat, part: KVPart, dst: torch.Tensor,
                  rows: torch.Tensor, rotate: bool,
                  scale_dst: torch.Tensor | None = None) -> None:
        """Quantize rows and write them into a part's pages in place, one pass: a decode step's
        KV write (the pack, the page / offset arithmetic and the scatter: five to eight torch
        kernels a part, three more for the index-K's rotation).

        ``dst[rows[i] // P, rows[i] % P] = fp8_pack(x', fmt, part)[i]`` with ``P = dst.shape[1]``
        (the page size) and ``x' = hadamard_rotate(x)`` when ``rotate`` (``part="index_k"``
        only: an fp8 pool stores DeepSeek's rotated index-K), else ``x``. ``dst`` uint8 [S, P, B]
        (B: :meth:`fp8_pack`'s bytes) with unit byte stride and any page and token strides
        (one part of part-major page blocks, or a column slice of token-major rows); ``rows``
        int64 [N] in ``[0, S * P)`` (values not checked: no host sync); a row named twice must
        carry equal rows of ``x`` (a padded decode batch repeats its first request). Every
        other byte of ``dst`` is unchanged. Without ``rotate`` the bytes are :meth:`fp8_pack`'s
        exactly. With it the rotation's fp32 sums may run in another order, as in
        :meth:`index_q_fp8`: conformance asks for the reference's codes on almost every element
        and bounds every dequantized value. ``scale_dst`` uint8 [S, P, 4 x blocks] (same S, P,
        unit byte stride): the scales' own rows (the engines' ``two_part`` index-K keeps a
        page's values, then its scales, DeepGEMM's order); ``dst`` then takes the packed row
        without them (values, then the rope's bytes), [S, P, B - 4 x blocks].

        Raises:
            ValueError: ``x`` not float [N, D] of ``fmt`` and ``part``, ``dst`` (or
                ``scale_dst``) not uint8 [S, P, bytes] with unit byte stride, ``rows`` not int64
                [N], ``rotate`` for the latent or with a head dim that is not a power of two
                (:func:`cpkv.ops.check_fp8_store_args`).
        """
        ...

    def peer_gather(self, srcs: Sequence[torch.Tensor], owner: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
        """``out[i] = srcs[owner[i]][rows[i]]``: [n, ...], one pass that reads each row from the
        buffer of the rank owning it.

        ``srcs[r]``: rank r's buffer as mapped into this process, e.g. over NVLink; every
        ``srcs[r]`` has the same dtype and trailing shape. ``owner`` / ``rows`` int64 [n]; a new
        contiguous tensor on this device. The P2P materialization (``kv.materialize = "p2p"``)
        builds the full view with it, no collective and no send buffer.

        Raises:
            ValueError: no source, sources of different dtypes or trailing shapes, or ``owner``
                / ``rows`` not int64 [n] of one length (:func:`cpkv.ops.check_peer_gather_args`).
        """
        ...

    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        """The lightning indexer (rule 19) for N query rows against the T keys of the flat full
        view: float32 [N, T].

        ``logit[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])`` for ``key_start[i] <= j <
        key_end[i]``, ``-inf`` elsewhere; computed in float32. q [N, Hi, D] (any float dtype),
        w [N, Hi] float32 (every scale already folded in), k [T, D] float/bf16, or
        ``float8_e4m3fn`` with ``k_scale`` [T] float32 (k dequantised as ``k.float() *
        k_scale[:, None]``; ``k_scale`` is None for float keys). With fp8 keys q may be
        ``float8_e4m3fn`` too (its per-(row, head) scale folded into w:
        :func:`cpkv.ops.quantize_index_q`), for fp8 x fp8 tensor cores. key_start/key_end int64
        [N]. The caller chunks rows so that N x T x 4 B stays under the logits budget (rule 21).

        Raises:
            ValueError: shapes or dtypes other than these (:func:`cpkv.ops.check_indexer_args`).
        """
        ...

    def indexer_logits_paged(self, q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor) -> torch.Tensor:
        """:meth:`indexer_logits` reading the keys where they are stored (a decode step, captured
        in CUDA graphs): float32 [N, M * S].

        ``pages`` is one pool layer in the part-major layout (uint8 [P, S, latent + index bytes]
        contiguous, as for ``sparse_mla_paged``: each page's S latent rows, then its S index-K
        rows), ``fmt`` its format, ``block_table`` int32 [R, M] (entry [r, p]: the page slot
        holding request r's p-th page; entries past a request's pages hold any valid slot),
        ``row_request`` int32 [N] (query row i reads request ``row_request[i]``'s keys),
        ``key_end`` int64 [N]: row i reads the request-local keys [0, key_end[i]), key j being
        token row ``block_table[r, j // S] * S + j % S`` of ``pages``. ``logit[i, j] = sum_h
        w[i, h] * relu(q[i, h] . k_j)`` (fp8 pools: times k_j's stored scale, as
        ``indexer_logits``) for ``j < key_end[i]``, ``-inf`` for ``j >= key_end[i]``. q / w as
        ``indexer_logits`` takes them (q [N, Hi, index_head_dim] bf16 / fp32, or
        ``float8_e4m3fn`` with the scales folded into w; w float32 [N, Hi]). Equal to gathering
        each request's keys in order and calling ``indexer_logits`` with key_start 0 (the same
        tolerances). Device work only: no host sync, no value-dependent Python branch; the
        output is the only allocation a backend must make.

        Raises:
            ValueError: shapes or dtypes other than these
                (:func:`cpkv.ops.check_indexer_paged_args`).
        """
        ...

    def indexer_logits_index_pages(self, q: torch.Tensor, w: torch.Tensor,
                                   index_pages: torch.Tensor, fmt: KVFormat,
                                   block_table: torch.Tensor, row_request: torch.Tensor,
                                   key_end: torch.Tensor) -> torch.Tensor:
        """:meth:`indexer_logits_paged` (the same block table, row requests, key ends and
        result) over index-K pages in DeepGEMM's page order: the engines' ``two_part`` index-K
        tensor (:class:`~cpkv.contracts.BufferLayout`), uint8 [P, >= S x index bytes] with unit
        column stride (any page stride), page p's S x index_head_dim values, then (fp8) its S
        fp32 scales. ``fmt`` is the layer's format.

        Raises:
            ValueError: shapes or dtypes other than these
                (:func:`cpkv.ops.check_indexer_index_pages_args`).
        """
        ...

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        """Column indices (RAGGED: offsets into the flat full view) of the k largest logits inside
        each row's [key_start, key_end): int32 [N, k].

        ``logits`` float [N, T], key_start / key_end int64 [N]. When the range holds at most k
        keys, all of them in ascending order; the remaining slots are -1, the only invalid value
        (rule 19). Rows with more than k keys list their choice in an order the backend chooses,
        the same for the same input (the reference: descending logit order; Triton: the order
        its kernels pick them in, which saves a sort per row). The reference breaks ties by the
        lower column so that the choice never depends on the batch's shape; conformance accepts
        any tie order. Logits inside a range are finite; values outside it are ignored.

        Raises:
            ValueError: ``logits`` not float [N, T], ``k < 0``, or the ranges not int64 [N]
                (:func:`cpkv.ops.check_topk_args`).
        """
        ...

    def indexer_topk(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                     k_scale: torch.Tensor | None, key_start: torch.Tensor,
                     key_end: torch.Tensor, topk: int) -> torch.Tensor:
        """:meth:`indexer_logits` then :meth:`topk`, in one op: int32 [N, topk], ``topk(
        indexer_logits(q, w, k, k_scale, key_start, key_end), topk, key_start, key_end)``.

        The arguments are those of the two ops (q [N, Hi, D], w float32 [N, Hi], k [T, D] with
        ``k_scale`` [T] for fp8 keys, key_start / key_end int64 [N], ``topk >= 0``), the result
        and its rules (-1 padding, short rows ascending, the set of the reference with ties by
        the lower column, any order) those of :meth:`topk`. A backend may choose without ever
        storing the [N, T] logits (a long prompt's chunk against ~1M keys: 4 bytes a logit
        written and read back), e.g. by keeping per key tile the keys above a floor from a
        sample; the reference composes the two ops. The caller still chunks rows by the logits
        budget (rule 21): a backend may hold the logits of the rows it recomputes.

        Raises:
            ValueError: shapes or dtypes other than these, or ``topk < 0``
                (:func:`cpkv.ops.check_indexer_topk_args`).
        """
        ...

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        """Sparse MLA over the selected keys (absorbed form, FlashMLA's sparse prefill interface):
        float32 (or q's dtype) [N, H, dv].

        q [N, H, Dk], kv [T, Dk] (the latent full view, nope + rope), indices int32 [N, k] with
        -1 masked. ``s_j = scale * q[i, h] . kv[j]``, ``p = softmax_j(s)`` over valid j,
        ``out[i, h] = sum_j p_j * kv[j, :dv]``, accumulated in float32 and returned as float32,
        or in q's dtype when q is lower precision and the kernel writes its output in it
        (FlashMLA: bf16; widening would cost a pass over the output, and the caller casts to
        the model dtype anyway). A row with no valid index gives zeros.

        Raises:
            ValueError: shapes or dtypes other than these, or ``dv`` outside (0, Dk]
                (:func:`cpkv.ops.check_sparse_mla_args`).
        """
        ...

    def sparse_mla_paged(self, q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                         fmt: KVFormat, scale: float, dv: int) -> torch.Tensor:
        """:meth:`sparse_mla` reading the selected latent rows where they are stored: float32
        (or q's dtype) [N, H, dv].

        ``pages`` is a part-major page buffer (uint8 [P, S, latent + index bytes],
        :class:`PageLayout` ``PART_MAJOR``: each page's S latent rows, then its S index-K rows),
        ``rows`` int32 [N, k] token rows of it (page x S + slot, -1 empty), ``fmt`` its format.
        Equal to dequantizing those latent rows (``fp8_unpack`` / the float view) and calling
        ``sparse_mla`` with them: a decode step reads its 2048 picks in place (FlashMLA's fp8
        sparse decode on Hopper) instead of dequantizing a copy.

        Raises:
            ValueError: shapes or dtypes other than these, or ``dv`` outside (0, Dk]
                (:func:`cpkv.ops.check_sparse_mla_paged_args`).
        """
        ...

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The rotary embedding of a layer's query and key rows: [N, ..., R] of x's dtype.

        Model math, but the layer's largest elementwise pass: ~13 ms per 64K prefill of the
        DeepSeek-V3.2 stack as six strided torch ops per rotation. x [N, R] or [N, H, R] float
        (any strides), cos / sin [N, R] of x's dtype in ``cat(f, f)`` form (both halves equal),
        one row per x row. With ``h = R / 2``: ``style="interleave"`` rotates the pairs
        ``(x[2j], x[2j+1])`` and writes them de-interleaved, ``out[j] = x[2j] c_j - x[2j+1]
        s_j``, ``out[h+j] = x[2j+1] c_j + x[2j] s_j`` (transformers'
        ``apply_rotary_pos_emb_interleave``); ``style="half"``: ``out[j] = x[j] c_j - x[h+j]
        s_j``, ``out[h+j] = x[h+j] c_j + x[j] s_j`` (``rotate_half``). ``out``: a tensor of x's
        shape and dtype to write (may be x itself: in place; no other overlap), else a new one;
        returned. The reference rounds each product to x's dtype as transformers does; a backend
        may round once (fp32 inside): conformance allows ``4 u (|x_a c| + |x_b s|)`` per
        element, u the unit roundoff of x's dtype (2^-8 for bf16).

        Raises:
            ValueError: ``style`` unknown, x not [N, R] / [N, H, R] with R even, cos / sin /
                out not of x's dtype and shape (:func:`cpkv.ops.check_rope_args`).
        """
        ...

    def page_rows(self, keys: torch.Tensor, block_table: torch.Tensor, row_request: torch.Tensor,
                  page_size: int) -> torch.Tensor:
        """Request-local keys as token rows of the pool: int32 [N, k] -> a new int32 [N, k].

        Key ``j`` of row ``i`` becomes ``block_table[row_request[i], j // page_size] *
        page_size + j % page_size`` (the block table and row requests of
        ``indexer_logits_paged``: int32 [R, M] and int32 [N]); -1 (an empty pick) stays -1.
        Keys are expected in ``[-1, M * page_size)`` (values are not checked: no host sync). A
        decode step maps its top-k picks for ``sparse_mla_paged`` with it (five torch kernels a
        layer as index arithmetic; one pass in a kernel).

        Raises:
            ValueError: keys, block_table or row_request not int32 of these shapes, or
                ``page_size < 1`` (:func:`cpkv.ops.check_page_rows_args`).
        """
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of rows: a new [N, D] tensor of x's dtype.

        x float [N, D] (any row stride, unit column stride: a column slice of a wider
        projection), weight [D] of x's dtype. ``out[i] = x[i] * rsqrt(mean(x[i]^2) + eps) *
        weight`` in fp32, rounded once (torch's fused ``F.rms_norm``, the models' GPU path;
        transformers rounds before the weight). The mean's order of summation is the backend's:
        conformance allows ``2 u |ref| + 2 u`` per element (u the unit roundoff of x's dtype).
        Model math, but a decode step's norms are nine small kernels of ~6 us each.

        Raises:
            ValueError: x not float [N, D] with unit column stride, or weight not [D] of x's
                dtype (:func:`cpkv.ops.check_rms_norm_args`).
        """
        ...

    def index_q_fp8(self, q: torch.Tensor, w: torch.Tensor,
                    rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries in fp8 with their scales folded into the head weights, one pass.

        q float [N, H, D] (any strides; D a power of two when ``rotate``), w float32 [N, H].
        Returns ``(q8, w')``: float8_e4m3fn [N, H, D] and float32 [N, H], new tensors, defined as
        :func:`cpkv.ops.api.quantize_index_q` of :func:`cpkv.ops.api.hadamard_rotate` ``(q)``
        (``rotate``: DeepSeek's ``rotate_activation``, for an fp8 pool's rotated index-K) or of
        ``q``: per (row, head) a "ue8m0" power-of-two scale ``s``, ``q8 = e4m3(q / s)``, ``w' = w
        * s``. Without ``rotate`` a backend gives the reference's bits. With it, the rotation's
        fp32 sums may run in another order (a tensor-core dot): a value can land one bf16 ulp
        away where the sum sits at a rounding boundary, so conformance asks for the reference's
        codes on almost every element and, on every one, ``|float(q8) s - ref| <= 2^-3 |ref|``
        plus one e4m3 subnormal step of the larger scale. The model's index query path: 13
        torch kernels per layer before (the decode step's glue).

        Raises:
            ValueError: q is not float [N, H, D], w not float32 [N, H], or ``rotate`` with D not
                a power of two (:func:`cpkv.ops.check_index_q_args`).
        """
        ...

    # ---- DeepSeek-V4 (contract rules 33-40; docs/models.md, "DeepSeek-V4") ------------------
    # Each row's result depends on that row's inputs only: not on how many rows, entries or
    # masked trailing keys the call holds (a context-parallel rank, a chunk and the one-piece
    # prefill compute the same row alike).

    def v4_compress(self, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, rate: int,
                    overlap: bool, prior: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> torch.Tensor:
        """The compressor's gated-softmax pool of whole windows: float [n, d] of kv's dtype,
        ``n = rows // rate`` (a partial last window is ignored), before the entry's norm and rope.

        kv / gate [rows, w] (rows from a window boundary), ape float32 [rate, w] (the position
        bias, added to the gate). Without ``overlap`` w = d and entry i is ``sum_j
        softmax_j(gate + ape)[j] * kv[j]`` over its window's ``rate`` rows; with it (CSA) w = 2d
        and the pool runs over 2 x rate slots: the previous window's first-half columns (Ca,
        ``[:, :d]``) and this window's second half (Cb, ``[:, d:]``). ``prior``: the
        ``(kv, gate)`` [rate, w] rows of the window before the first (its Ca half); None: no
        such window (entry 0), its slots take no weight. Softmax in float32.

        Raises:
            ValueError: kv / gate not float [rows, w] of one shape, ape not float32 [rate, w],
                w odd with ``overlap``, or ``prior`` not two [rate, w] tensors
                (:func:`cpkv.ops.check_v4_compress_args`).
        """
        ...

    def v4_index_scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                        limit: torch.Tensor, scale: float) -> torch.Tensor:
        """The V4 lightning indexer over compressed index keys: float32 [N, E],
        ``score[i, e] = sum_h relu(q[i, h] . keys[e]) * scale * w[i, h]``, -inf where
        ``e >= limit[i]`` (entry e's window is not complete for row i).

        q float [N, H, d] (roped), w float32 [N, H] (head weights, their scale folded in),
        keys float [E, d], limit int64 [N].

        Raises:
            ValueError: a shape or dtype does not fit (:func:`cpkv.ops.check_v4_index_scores_args`).
        """
        ...

    def v4_topk(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Top-``k`` entries per row of ``scores`` float [N, E] (-inf: not selectable): int64
        [N, k], score descending, equal scores by ascending entry (rule 39), -1 where fewer
        than ``k`` are selectable.

        Raises:
            ValueError: scores not 2-D float, or ``k < 0`` (:func:`cpkv.ops.check_v4_topk_args`).
        """
        ...

    def v4_index_topk(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                      limit: torch.Tensor, scale: float, k: int) -> torch.Tensor:
        """:meth:`v4_index_scores` then :meth:`v4_topk`, in one op: int64 [N, k], the set of
        ``v4_topk(v4_index_scores(q, w, keys, limit, scale), k)`` (rule 39's choice; equal
        scores may be chosen in another order within 1e-6), -1 where fewer than ``k`` are
        selectable, the chosen entries in an order the backend picks (the same for the same
        row, whatever rows are beside it). A backend may choose without storing the [N, E]
        scores (a 1M-token prompt's chunk against 256K compressed keys).

        Raises:
            ValueError: a shape or dtype does not fit, or ``k < 0``
                (:func:`cpkv.ops.check_v4_index_scores_args`, :func:`cpkv.ops.check_v4_topk_args`).
        """
        ...

    def v4_attention(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
        """Sparse softmax attention with a per-head sink over rows of one K = V buffer:
        [N, H, D] of kv's dtype. ``out[i, h] = sum_j p_j kv[indices[i, j]]`` with ``p =
        softmax([scale * q[i, h] . kv[indices[i, j]] for the j where indices[i, j] >= 0] ++
        [sink[h]])`` without the sink's column; a row with no index read gives zeros. The
        slots of a row are summed in their order (a row's bits depend on its own indices only).
        FlashMLA's ``flash_mla_sparse_fwd(q, kv[:, None], indices[:, None], scale, D,
        attn_sink=sink)`` computes it.

        q [N, H, D], kv [S, D] of q's dtype, indices int32 / int64 [N, K] (-1: no key),
        sink float32 [H].

        Raises:
            ValueError: a shape or dtype does not fit (:func:`cpkv.ops.check_v4_attention_args`).
        """
        ...
