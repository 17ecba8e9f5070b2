"""The torch reference ops: one method per :class:`cpkv.contracts.Op` the backend provides.

Every other backend is checked against these (``cpkv.testing.conformance``), bit for bit, so the
formulas here are the definition:

* ``page_gather`` / ``rerange``: ``index_select`` along dim 0; ``page_scatter``: ``index_copy_``.
* ``fp8_pack``: :func:`cpkv.ops.api.quantize_fp8` per quantisation block of one token, in the
  part's scale format (:func:`cpkv.ops.api.scale_format`): the latent's fp32
  ``scale = max(amax, FP8_AMAX_FLOOR) / FP8_E4M3_MAX`` by IEEE division, not x * (1/448); the
  index-K's DeepSeek ``ue8m0`` power of two ``2^ceil(log2(max(amax, 1e-4) * (1/448)))``;
  stored as 4 little-endian bytes; ``q = e4m3(clamp(x_block / scale, +-448))``, round to
  nearest even); rope (latent only) is ``x[:, kv_lora_rank:]`` cast to bf16 and stored as 2
  bytes per value. The index-K arrives rotated (the driver's :func:`cpkv.ops.api.hadamard_rotate`).
* ``fp8_store``: ``fp8_pack`` of the rows (rotated first by :func:`cpkv.ops.api.hadamard_rotate`
  when asked), written with ``index_put_`` at ``(rows // P, rows % P)`` of the [S, P, B] part
  (with ``scale_dst``: the scales' bytes there, the rest in ``dst``).
* ``fp8_unpack``: ``(float32(q) * scale)`` then one cast to the requested dtype; rope is the stored
  bf16 cast to the requested dtype.

* ``indexer_logits`` (rule 19), in fp32 over the whole [N, T] rectangle, one head at a time (so
  the working memory is two [N, T] buffers)::

      kf        = k.float()  (* k_scale[:, None] for float8_e4m3fn keys)
      logit     = sum_h w[:, h, None] * relu(q[:, h].float() @ kf.T)
      logit[i, j] = -inf  unless  key_start[i] <= j < key_end[i]

  Chunking rows under the logits budget (rule 21) is the caller's job.
* ``indexer_logits_paged``: one query row at a time (a loop over the row count, a shape), its
  request's keys copied out of the pages in order (:func:`cpkv.ops.api.paged_index_keys`), then
  ``indexer_logits`` with the range ``[0, key_end[i])``: equal to it by construction.
* ``topk``: ``torch.topk`` (sorted, descending) over the logits with everything outside the
  row's range set to -inf; rows whose range holds at most k keys take ``key_start + arange(k)``
  instead (ascending), and every slot past the row's key count is -1. Selected by ``torch.where``,
  so no row count is ever read on the host. Logits inside a range are expected to be finite (a
  -inf logit inside a range of more than k keys could lose to a masked column).
* ``indexer_topk``: ``topk`` of ``indexer_logits`` (the two ops composed: the definition).
* ``sparse_mla_paged``: the selected latent rows read from the part-major pages through
  :func:`cpkv.ops.api.paged_latent`, dequantized to float32, then ``sparse_mla``.
* ``page_rows``: ``block_table[row_request][i, j // S] * S + j % S`` in int64 (a gather of the
  rows' block-table rows), -1 where the key is -1, cast to int32.
* ``rms_norm``: ``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, rounded once to x's dtype.
* ``index_q_fp8``: :func:`cpkv.ops.api.quantize_index_q` of
  :func:`cpkv.ops.api.hadamard_rotate` ``(q)`` (or of ``q`` without the rotation).
* ``sparse_mla``: gathers ``kv[max(index, 0)]``, fp32 scores ``scale * q . kv`` with -1 slots at
  -inf, a max-subtracted softmax over the valid slots, and ``p @ kv[:, :dv]``; a row without a
  valid slot (max = -inf) divides 0 by 1 and gives zeros, never NaN. Its temporaries are
  O(N * k * Dk): it takes rows in chunks that keep them under 256 MB itself.

* ``v4_compress``, ``v4_index_scores``, ``v4_topk``, ``v4_index_topk``, ``v4_attention``:
  DeepSeek-V4's, in :mod:`cpkv_backend_torch.v4` (each row's result independent of the call's
  other rows).

No op syncs the host (no ``.item()``, no data-dependent shapes) and none builds host tensors, so
they run unchanged on CPU and CUDA tensors, for any number of rows including 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

import cpkv.ops.api as api  # the argument checks, as api.check_*
from cpkv.models.rope import apply_rope
from cpkv.ops.api import (
    KVFormat,
    fp8_layout,
    hadamard_rotate,
    index_page_keys,
    pack_fp8,
    paged_index_keys,
    paged_index_tokens,
    paged_latent,
    quantize_index_q,
)

from .v4 import V4TorchOps

if TYPE_CHECKING:
    from cpkv.ops.api import KVPart, RopeStyle

__all__ = ["TorchOps"]

_FP8 = torch.float8_e4m3fn
#: sparse_mla takes rows in chunks whose gathered rows and scores stay under this many bytes
_MLA_TEMP_BYTES = 256 << 20


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A packed [N, k] byte slice as its own dense tensor, so it can be viewed as a wider dtype
    (``.contiguous()`` may keep a misaligned storage offset: 1 row, or 0 rows)."""
    return t.clone(memory_format=torch.contiguous_format)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, D] of any dtype -> [N, D * itemsize] uint8 (native byte order: little-endian)."""
    return t.contiguous().view(torch.uint8)


def _pack(x: torch.Tensor, fmt: KVFormat, part: KVPart) -> torch.Tensor:
    """``fp8_pack``'s formula (:func:`cpkv.ops.api.pack_fp8`), shared by ``fp8_store``."""
    return pack_fp8(x, fmt, part)


class TorchOps(V4TorchOps):
    """Reference implementation of cpkv's compute ops in plain torch (CPU and GPU); DeepSeek-V4's
    ``v4_*`` ops are :class:`~cpkv_backend_torch.v4.V4TorchOps`'."""

    # ---- page movement ----------------------------------------------------------------------
    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``out[i] = src[index[i]]`` along dim 0.

        Args:
            src: [P, ...] pages or token rows, any dtype.
            index: int64 [n] on ``src.device``; entries may repeat.

        Returns:
            a new contiguous [n, ...] tensor.
        """
        return src.index_select(0, index)

    def page_scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[i]] = src[i]`` in place along dim 0; other rows of ``dst`` are untouched.

        Args:
            dst: [P, ...] destination (pages or rows).
            index: int64 [n] unique entries on ``dst.device``.
            src: [n, ...] rows of ``dst``'s dtype and trailing shape.

        Raises:
            ValueError: ``src`` does not have the shape [len(index), *dst.shape[1:]] or the dtype
                of ``dst``.
        """
        if src.shape != (index.shape[0], *dst.shape[1:]) or src.dtype != dst.dtype:
            raise ValueError(f"page_scatter: src {tuple(src.shape)} {src.dtype} does not fit "
                             f"index {tuple(index.shape)} into dst {tuple(dst.shape)} {dst.dtype}")
        dst.index_copy_(0, index, src)

    def page_copy(self, dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor,
                  src_index: torch.Tensor) -> None:
        """``dst[dst_index[i]] = src[src_index[i]]`` in place along dim 0 (``index_select`` then
        ``index_copy_``). ``dst`` or ``src`` may be host memory while the other is on a GPU (the
        rows then cross once, and an index on the other device is moved: a host sync).

        Raises:
            ValueError: the indices differ in length, or ``dst`` and ``src`` differ in dtype or
                trailing shape.
        """
        api.check_page_copy_args(dst, dst_index, src, src_index)
        rows = src.index_select(0, src_index.to(src.device))
        dst.index_copy_(0, dst_index.to(dst.device), rows.to(dst.device))

    def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """Rank-major padded rows back to natural order: ``natural[n] = gathered[perm[n]]``.

        Args:
            gathered: [C * max_rank_len, ...] all-gathered rows.
            perm: int64 [N] on ``gathered.device`` (the plan's permutation; padded rows unused).

        Returns:
            a new contiguous [N, ...] tensor.
        """
        return gathered.index_select(0, perm)

    # ---- fp8 ---------------------------------------------------------------------------------
    def fp8_pack(self, x: torch.Tensor, fmt: KVFormat, part: KVPart) -> torch.Tensor:
        """Quantise rows to the fp8 pool layout (see the module docstring for the formula).

        Args:
            x: [N, kv_lora_rank + rope_dim] (``latent``) or [N, index_head_dim] (``index_k``),
                any float dtype.

        Returns:
            uint8 [N, B]: e4m3 bytes, fp32 block scales, then (latent) bf16 rope; B is 656 / 132
            for DeepSeek-V3.2.

        Raises:
            ValueError: ``x`` is not 2-D or its last dim does not match ``fmt`` and ``part``.
        """
        return _pack(x, fmt, part)

    def fp8_store(self, x: torch.Tensor, fmt: KVFormat, part: KVPart, dst: torch.Tensor,
                  rows: torch.Tensor, rotate: bool,
                  scale_dst: torch.Tensor | None = None) -> None:
        """Quantize rows into a part's pages in place (see :class:`cpkv.ops.api.KVOps`):
        :meth:`fp8_pack` of ``x`` (rotated first when ``rotate``), ``index_put_`` at (page,
        offset).

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_fp8_store_args(x, fmt, part, dst, rows, rotate, scale_dst)
        packed = _pack(hadamard_rotate(x) if rotate else x, fmt, part)
        ps = dst.shape[1]
        at = (rows // ps, rows % ps)
        if scale_dst is None:
            dst.index_put_(at, packed)
            return
        dims, block, _, _ = fp8_layout(fmt, part)
        end = dims + 4 * (dims // block)
        dst.index_put_(at, torch.cat([packed[:, :dims], packed[:, end:]], dim=1))
        scale_dst.index_put_(at, packed[:, dims:end])

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: KVPart,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`fp8_pack`: dequantised values (e4m3 x block scale; rope as stored).

        Args:
            packed: uint8 [N, B] as produced by :meth:`fp8_pack`.
            dtype: dtype of the result.
            index: optional int64 [n]: unpack rows ``packed[index]`` (here: gathered first).

        Returns:
            [N, kv_lora_rank + rope_dim] or [N, index_head_dim] of ``dtype``.

        Raises:
            ValueError: ``packed`` is not 2-D uint8 with B bytes per row.
        """
        dims, block, rope, nbytes = fp8_layout(fmt, part)
        if packed.dim() != 2 or packed.shape[1] != nbytes or packed.dtype != torch.uint8:
            raise ValueError(f"fp8_unpack({part}): expected uint8 [N, {nbytes}] for {fmt!r}, "
                             f"got {packed.dtype} {tuple(packed.shape)}")
        if index is not None:
            packed = packed.index_select(0, index)
        n, blocks = packed.shape[0], dims // block
        q = packed[:, :dims].view(_FP8).float().reshape(n, blocks, block)
        scale = _dense(packed[:, dims:dims + 4 * blocks]).view(torch.float32)
        vals = (q * scale.unsqueeze(-1)).reshape(n, dims).to(dtype)
        if not rope:
            return vals
        rope_vals = _dense(packed[:, dims + 4 * blocks:]).view(torch.bfloat16).to(dtype)
        return torch.cat([vals, rope_vals], dim=1)

    def peer_gather(self, srcs: Sequence[torch.Tensor], owner: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
        """``out[i] = srcs[owner[i]][rows[i]]`` along dim 0.

        Args:
            srcs: one buffer per rank, [R, ...] of one dtype and trailing shape, readable from
                this device (a peer's buffer mapped over NVLink, or shared host memory).
            owner: int64 [n], each in [0, len(srcs)).
            rows: int64 [n], each a row of its owner's buffer.

        Returns:
            a new contiguous [n, ...] tensor.

        Every source is read at every position (clamped to row 0 where it is not the owner) and
        the owner's value selected: no boolean-mask gather, so no host sync.
        """
        api.check_peer_gather_args(srcs, owner, rows)
        n = owner.shape[0]
        out = torch.zeros((n, *srcs[0].shape[1:]), dtype=srcs[0].dtype, device=owner.device)
        shape = (n,) + (1,) * (out.dim() - 1)
        for r, s in enumerate(srcs):
            if s.shape[0] == 0:
                continue
            mine = owner == r
            got = s.index_select(0, torch.where(mine, rows, 0))
            out = torch.where(mine.view(shape), got, out)
        return out

    # ---- sparse attention (rule 19) --------------------------------------------------------
    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        """The lightning indexer: ``logit[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])`` inside
        ``[key_start[i], key_end[i])``, -inf elsewhere, in fp32.

        Args:
            q: [N, Hi, D] any float dtype.
            w: [N, Hi] float32 head weights (every scale folded in).
            k: [T, D] float keys, or ``float8_e4m3fn`` keys dequantised by ``k_scale``.
            k_scale: float32 [T] per-key scale for fp8 keys; None for float keys.
            key_start, key_end: int64 [N] per-row key range (columns of the flat full view).

        Returns:
            float32 [N, T].

        Raises:
            ValueError: a shape or dtype does not match, a float key comes with a scale or an fp8
                key without one.
        """
        api.check_indexer_args(q, w, k, k_scale, key_start, key_end)
        n, heads, d = q.shape
        t = k.shape[0]
        logits = torch.full((n, t), float("-inf"), dtype=torch.float32, device=q.device)
        if n == 0 or t == 0:
            return logits
        # the check gives fp8 keys, and only them, a scale
        kf = k.float() * k_scale[:, None] if k_scale is not None else k.float()
        qf, w32 = q.float(), w.float()
        # host tensors: reading a piece's key bounds costs no sync (tests of rule 22 turn this
        # off to check, on a CPU, the path a GPU takes)
        host = q.device.type == "cpu" and READ_HOST_BOUNDS
        # all heads in one matmul, then the head sum as a batched [1, H] x [H, cols] product;
        # row pieces keep the [rows, H, cols] temporary near 4 MB (in cache on a CPU: 2x faster
        # than pieces of the [N, T] output's size at 4096 x 4096 x 16 heads), and on a CPU each
        # piece computes only its rows' key columns (causal rows: half the work)
        step = max(1, _piece(q.device) // (heads * t))
        for s in range(0, n, step):  # a loop over a shape, not over data
            e = min(n, s + step)
            lo, hi = 0, t
            if host:
                lo = int(key_start[s:e].min().clamp(0, t))
                hi = int(key_end[s:e].max().clamp(lo, t))
                if hi <= lo:
                    continue
            sc = torch.relu_((qf[s:e].reshape(-1, d) @ kf[lo:hi].t()).view(e - s, heads, hi - lo))
            part = torch.bmm(w32[s:e, None, :], sc).view(e - s, hi - lo)
            inside = _in_range(hi, key_start[s:e], key_end[s:e], lo)
            logits[s:e, lo:hi] = part.masked_fill_(~inside, float("-inf"))
        return logits

    def indexer_logits_paged(self, q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor) -> torch.Tensor:
        """The lightning indexer over keys read from part-major pages through a block table:
        row i against request ``row_request[i]``'s keys ``[0, key_end[i])``, -inf after; float32
        [N, M * S]. See :class:`cpkv.ops.api.KVOps`.

        Each row's request keys are gathered (``page_gather``) and passed to
        :meth:`indexer_logits`, one row at a time: O(M * S) key memory per row, never all
        requests' keys at once.

        Raises:
            ValueError: a shape or dtype does not match (as every backend).
        """
        api.check_indexer_paged_args(q, w, pages, fmt, block_table, row_request, key_end)
        return self._rows_over_pages(q, w, fmt, block_table, row_request, key_end,
                                     lambda tok, gather: paged_index_keys(pages, fmt, tok, gather))

    def _rows_over_pages(self, q: torch.Tensor, w: torch.Tensor, fmt: KVFormat,
                         block_table: torch.Tensor, row_request: torch.Tensor,
                         key_end: torch.Tensor, keys_of: Callable[..., tuple[torch.Tensor,
                                                                              torch.Tensor | None]]
                         ) -> torch.Tensor:
        """The paged indexers' one row at a time: row i's request keys (``keys_of(tokens,
        page_gather)``: the keys of those token rows) into :meth:`indexer_logits`."""
        n = q.shape[0]
        cols = block_table.shape[1] * fmt.page_size
        out = torch.full((n, cols), float("-inf"), dtype=torch.float32, device=q.device)
        if cols == 0:
            return out
        tokens = paged_index_tokens(block_table, fmt.page_size)  # [R, M * S]
        start = key_end.new_zeros(1)
        request = row_request.long()
        for i in range(n):  # a loop over a shape, not over data
            keys, scale = keys_of(tokens.index_select(0, request[i:i + 1]).view(-1),
                                  lambda src, index: TorchOps.page_gather(self, src, index))
            # the reference's own indexer (a subclass that overrides it changes that op alone)
            out[i:i + 1] = TorchOps.indexer_logits(self, q[i:i + 1], w[i:i + 1], keys, scale,
                                                   start, key_end[i:i + 1])
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The rotary embedding of ``x`` rows (see :class:`cpkv.ops.api.KVOps`), transformers' op
        sequence (each product rounded to x's dtype): the models' own
        :func:`~cpkv.models.rope.apply_rope`.

        Raises:
            ValueError: a shape, dtype or style does not fit (as every backend).
        """
        api.check_rope_args(x, cos, sin, style, out)
        return apply_rope(x, cos, sin, style, out)

    def page_rows(self, keys: torch.Tensor, block_table: torch.Tensor,
                  row_request: torch.Tensor, page_size: int) -> torch.Tensor:
        """Request-local keys as the pool's token rows (see :class:`cpkv.ops.api.KVOps`): the
        formula in int64, -1 kept.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_page_rows_args(keys, block_table, row_request, page_size)
        k = keys.long()
        valid = k >= 0
        page = torch.where(valid, k, 0) // page_size
        slot = block_table.index_select(0, row_request).long().gather(1, page)
        rows = slot * page_size + torch.where(valid, k, 0) % page_size
        return torch.where(valid, rows, -1).to(torch.int32)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of rows in fp32, rounded once (see :class:`cpkv.ops.api.KVOps`).

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_rms_norm_args(x, weight)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    def index_q_fp8(self, q: torch.Tensor, w: torch.Tensor,
                    rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's fp8 queries and folded weights (see :class:`cpkv.ops.api.KVOps`):
        :func:`~cpkv.ops.api.quantize_index_q` of the rotated (``rotate``) or given ``q``.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_index_q_args(q, w, rotate)
        return quantize_index_q(hadamard_rotate(q) if rotate else q, w)

    def indexer_logits_index_pages(self, q: torch.Tensor, w: torch.Tensor,
                                   index_pages: torch.Tensor, fmt: KVFormat,
                                   block_table: torch.Tensor, row_request: torch.Tensor,
                                   key_end: torch.Tensor) -> torch.Tensor:
        """:meth:`indexer_logits_paged` over index-K pages in DeepGEMM's page order (the
        engines' ``two_part`` index-K tensor): each row's request keys copied out
        (:func:`cpkv.ops.api.index_page_keys`), then :meth:`indexer_logits`, one row at a time.
        See :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape or dtype does not match (as every backend).
        """
        api.check_indexer_index_pages_args(q, w, index_pages, fmt, block_table, row_request, key_end)
        return self._rows_over_pages(
            q, w, fmt, block_table, row_request, key_end,
            lambda tok, gather: index_page_keys(index_pages, fmt, tok, gather))

    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        """Columns of the k largest logits inside each row's ``[key_start, key_end)``.

        A row whose range (clipped to the T columns) holds at most k keys lists all of them in
        ascending order; a longer one lists its choice in descending logit order, equal logits by
        ascending column (deterministic: CP and single-rank runs choose alike). Slots past the
        row's count are -1.

        Args:
            logits: [N, T] float (values outside a row's range are ignored).
            k: slots per row (>= 0); T may be smaller than k.
            key_start, key_end: int64 [N].

        Returns:
            int32 [N, k].

        Raises:
            ValueError: ``logits`` is not 2-D float, ``k`` is negative or a range is mis-shaped.
        """
        api.check_topk_args(logits, k, key_start, key_end)
        n, t = logits.shape
        dev = logits.device
        slot = torch.arange(k, device=dev, dtype=torch.int64)
        start = key_start.clamp(0, t)
        count = (key_end.clamp(0, t) - start).clamp_min(0)  # [N]
        few = slot < count[:, None]  # [N, k]: slot holds a key
        ascending = torch.where(few, start[:, None] + slot, -1)
        kk = min(k, t)
        if kk:
            # row pieces of ~4 MB keep the temporaries in cache (a loop over a shape)
            step = max(1, _piece(logits.device) // t)
            chosen = torch.cat([_top_columns(logits[s:s + step].float(), _in_range(
                t, key_start[s:s + step], key_end[s:s + step]), kk) for s in range(0, n, step)]) \
                if n else logits.new_zeros((0, kk), dtype=torch.int64)
            if kk < k:
                chosen = torch.cat([chosen, chosen.new_full((n, k - kk), -1)], dim=1)
        else:
            chosen = ascending
        out = torch.where((count <= k)[:, None], ascending, chosen)
        return out.to(torch.int32)

    def indexer_topk(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                     k_scale: torch.Tensor | None, key_start: torch.Tensor,
                     key_end: torch.Tensor, topk: int) -> torch.Tensor:
        """``topk(indexer_logits(q, w, k, k_scale, key_start, key_end), topk, key_start,
        key_end)``: int32 [N, topk].

        Raises:
            ValueError: an argument does not fit (as every backend).
        """
        api.check_indexer_topk_args(q, w, k, k_scale, key_start, key_end, topk)
        # the reference's own two ops (a subclass that overrides one changes that op alone)
        logits = TorchOps.indexer_logits(self, q, w, k, k_scale, key_start, key_end)
        return TorchOps.topk(self, logits, topk, key_start, key_end)

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        """Sparse MLA (absorbed form) over the selected latent rows, in fp32.

        ``s_j = scale * q[i, h] . kv[j]`` for the valid (not -1) ``j`` in ``indices[i]``,
        ``out[i, h] = sum_j softmax(s)_j * kv[j, :dv]``; a row with no valid index gives zeros.

        Args:
            q: [N, H, Dk] any float dtype.
            kv: [T, Dk] latent rows of the flat full view (nope + rope), any float dtype.
            indices: int32 [N, k], entries in [0, T) or -1.
            scale: softmax scale.
            dv: value width (the leading ``dv`` dims of a kv row), 0 < dv <= Dk.

        Returns:
            float32 [N, H, dv].

        Raises:
            ValueError: a shape or dtype does not match, or ``dv`` is out of range.
        """
        api.check_sparse_mla_args(q, kv, indices, dv)
        n, heads, dk = q.shape
        if kv.shape[0] == 0 or indices.shape[1] == 0:  # nothing to attend to: every row is zeros
            return torch.zeros(n, heads, dv, dtype=torch.float32, device=q.device)
        # the gathered rows and scores are O(rows x k x (Dk + H)) fp32: bound them here, so that
        # callers chunk rows by the output's size only (a fused kernel has no such temporaries)
        per = max(1, _MLA_TEMP_BYTES // (4 * indices.shape[1] * (dk + 2 * heads)))
        if n > per:
            return torch.cat([self.sparse_mla(q[s:s + per], kv, indices[s:s + per], scale, dv)
                              for s in range(0, n, per)])
        valid = indices >= 0  # [N, k]
        rows = kv.float().index_select(0, indices.clamp_min(0).reshape(-1).long())
        rows = rows.reshape(n, indices.shape[1], dk)  # [N, k, Dk]
        s = torch.einsum("nhd,nkd->nhk", q.float(), rows) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: exp gives 0
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        out = torch.einsum("nhk,nkd->nhd", p, rows[..., :dv])
        return out / torch.where(denom > 0, denom, torch.ones_like(denom))

    def sparse_mla_paged(self, q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                         fmt: KVFormat, scale: float, dv: int) -> torch.Tensor:
        """Sparse MLA over latent rows read from part-major pages: the selected rows dequantized
        (float32) then :meth:`sparse_mla`; float32 [N, H, dv].

        Args:
            q: [N, H, kv_lora_rank + rope_dim] any float dtype.
            pages: uint8 [P, page_size, latent + index bytes], part-major, contiguous.
            rows: int32 [N, k] token rows (page x page_size + slot) or -1.
            fmt: the pages' format.

        Raises:
            ValueError: a shape or dtype does not match, or ``dv`` is out of range.
        """
        api.check_sparse_mla_paged_args(q, pages, rows, fmt, dv)
        lat, idx = paged_latent(pages, rows, fmt, torch.float32,
                                lambda src, f, part, dt, i: TorchOps.fp8_unpack(self, src, f, part,
                                                                                 dt, i),
                                lambda src, i: src.index_select(0, i))
        # the reference's own sparse MLA (a subclass that overrides it changes that op alone)
        return TorchOps.sparse_mla(self, q, lat, idx, scale, dv)


#: on a CPU, the indexer reads each row piece's key bounds (host ints) and computes only those
#: columns; False computes every column as on a GPU (the no-host-sync tests set it)
READ_HOST_BOUNDS = True


def _piece(device: torch.device) -> int:
    """fp32 elements of one row piece's temporaries: ~4 MB on a CPU (cache-sized), 256 MB on
    a GPU (few launches)."""
    return 1 << 20 if device.type == "cpu" else 1 << 26


def _top_columns(x: torch.Tensor, inside: torch.Tensor, kk: int) -> torch.Tensor:
    """int64 [N, kk]: the columns of each row's kk largest values inside its range (``inside``),
    in descending value order, equal values by ascending column; columns outside the range come
    after every column inside it (-inf logits inside included).

    ``torch.topk`` breaks ties differently for different T, so it only finds the k-th value; the
    columns are then chosen exactly (every one above it, the lowest columns equal to it) with a
    second ``topk`` over a key that has no ties, and ordered by a stable sort of kk values: O(T)
    per row instead of a sort of all T (6x faster at 4096 x 4096 on a CPU core).
    """
    t = x.shape[1]
    x = x.masked_fill(~inside, float("-inf"))
    if t > 2**24:  # the column key below is exact in fp32 up to 2^24
        return _inside_first(x, inside)[:, :kk]
    kth = torch.topk(x, kk, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    col = torch.arange(t, device=x.device, dtype=torch.float32)
    # above the k-th value: +inf; equal to it inside the range: -column (the lowest columns
    # win); below it, or outside the range: -inf (outside columns come last: -t - column)
    key = torch.where(x > kth, float("inf"),
                      torch.where((x == kth) & inside, -col, -float(t) - col))
    cols = torch.topk(key, kk, dim=1, sorted=False).indices.sort(dim=1).values
    return cols.gather(1, _inside_first(x.gather(1, cols), inside.gather(1, cols)))


def _inside_first(x: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """The order of each row's columns: descending value, columns inside the range before those
    outside, equal values by ascending column (two stable sorts)."""
    order = torch.sort(x, dim=1, descending=True, stable=True).indices
    outside = (~inside).gather(1, order).to(torch.uint8)
    return order.gather(1, torch.sort(outside, dim=1, stable=True).indices)


def _in_range(t: int, key_start: torch.Tensor, key_end: torch.Tensor,
              lo: int = 0) -> torch.Tensor:
    """bool [N, T - lo]: ``key_start[i] <= j < key_end[i]`` for the columns j in [lo, T)."""
    col = torch.arange(lo, t, device=key_start.device, dtype=torch.int64)
    return (col >= key_start[:, None]) & (col < key_end[:, None])
