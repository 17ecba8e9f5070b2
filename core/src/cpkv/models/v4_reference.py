"""The one-rank DeepSeek-V4 forward of one prompt, from :class:`DeepseekV4`'s per-row API: the
reference a context-parallel run is compared with, and the spelled-out order of the pieces.

Per layer: mHC collapse -> ``attn_norm`` -> query, window rows, compressed entries (main; CSA
also index keys) -> keys per row (window rows ``[t-W+1, t]`` + HCA's causal entries or CSA's
top-k) -> attention with the sink -> output projection -> mHC expand; then the same for the MoE.
The compressor's pool, the indexer, the top-k and the attention run on the model's op table.
"""

from __future__ import annotations

import torch

from .deepseek_v4 import DeepseekV4
from .v4_config import CSA, HCA

__all__ = ["attend_and_ffn", "compressed_index", "entry_index", "reference_draft",
           "reference_forward", "reference_streams", "window_index"]


def window_index(positions: torch.Tensor, first: int, window: int, base: int = 0
                 ) -> torch.Tensor:
    """Each row's window ``[t - window + 1, t]`` as indices into a buffer of rows at absolute
    positions ``first, first + 1, ..`` starting at buffer row ``base`` (a context-parallel
    rank's segment with its halo rows before it): int64 ``[N, window]``, oldest first; -1 for
    positions before ``first`` or below 0."""
    offs = torch.arange(window - 1, -1, -1, device=positions.device)  # oldest first
    absolute = positions[:, None] - offs[None, :]
    return torch.where(absolute >= max(first, 0), absolute - first + base, -1)


def entry_index(model: DeepseekV4, entries: int, positions: torch.Tensor,
                selected: torch.Tensor | None, base: int) -> torch.Tensor:
    """The compressed entries rows read, as indices into a buffer holding entry 0 at row
    ``base``: HCA every complete entry (``selected`` None: ``(w + 1) * m <= t + 1``), CSA the
    ``selected`` ``[N, k]`` (-1: none)."""
    if selected is None:
        m = model.config.compress_rate_hca
        limit = (positions + 1) // m
        ids = torch.arange(entries, device=positions.device)[None, :]
        return torch.where(ids < limit[:, None], ids + base, -1)
    return torch.where(selected >= 0, selected + base, -1)


def compressed_index(model: DeepseekV4, layer: int, h: torch.Tensor, q_res: torch.Tensor,
                     positions: torch.Tensor, entries: int, index_keys: torch.Tensor | None,
                     base: int) -> torch.Tensor:
    """The compressed entries rows read (:func:`entry_index`): CSA (``index_keys`` given) the
    indexer's stable top-k, HCA every complete one."""
    selected = None
    if index_keys is not None:
        selected = model.select(layer, h, q_res, positions, index_keys)
    return entry_index(model, entries, positions, selected, base)


def attend_and_ffn(model: DeepseekV4, layer: int, q: torch.Tensor, kv: torch.Tensor,
                   indices: torch.Tensor, positions: torch.Tensor, post: torch.Tensor,
                   comb: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rest of a layer after its keys: attention with the sink over ``indices`` of
    ``kv``, the output projection, the mHC expand, then the MoE block; -> the new streams."""
    o = model.attend(layer, q, kv, indices)
    x = model.hc_post(post, comb, model.attention_output(layer, o, positions), x)
    post, comb, collapsed = model.hc_pre(layer, "ffn", x)
    return model.hc_post(post, comb, model.moe(layer, collapsed, ids), x)


def reference_forward(model: DeepseekV4, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, vocab]`` float32 of prompt ``ids`` ``[T]`` on one rank."""
    return model.final_logits(reference_streams(model, ids))


def reference_streams(model: DeepseekV4, ids: torch.Tensor) -> torch.Tensor:
    """The target's streams ``[T, n, hidden]`` after its last layer (before ``hc_head``) of
    prompt ``ids`` ``[T]`` on one rank."""
    ids = ids.to(model.device)
    pos = torch.arange(ids.shape[0], device=model.device)
    x = model.embed(ids)
    for i in range(model.num_layers):
        x = _block(model, i, x, ids, pos)
    return x


def reference_draft(model: DeepseekV4, ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The MTP draft layer's logits ``[T, vocab]`` float32 over prompt ``ids`` ``[T]`` on one
    rank: row i from the target's streams at i and ``next_ids[i]`` (token i + 1: ``ids[1:]``
    and then the token after the prompt), a guess of token i + 2."""
    assert model.mtp_layer is not None, "a model loaded with its MTP layer"
    nxt = next_ids.to(model.device)
    pos = torch.arange(ids.shape[0], device=model.device)
    x = model.draft_input(reference_streams(model, ids), nxt)
    return model.draft_logits(_block(model, model.mtp_layer, x, nxt, pos))


def _block(model: DeepseekV4, i: int, x: torch.Tensor, ids: torch.Tensor,
           pos: torch.Tensor) -> torch.Tensor:
    """Layer ``i`` over a whole sequence's streams ``x`` from position 0."""
    c = model.config
    kind = model.layer_kind(i)
    post, comb, collapsed = model.hc_pre(i, "attn", x)
    h = model.attn_norm(i, collapsed)
    q, q_res = model.query(i, h, pos)
    kv = model.window_kv(i, h, pos)
    indices = window_index(pos, 0, c.sliding_window)
    main, index = model.compressors(i)
    if main is not None:
        entries = model.compress(main, *model.compressor_inputs(main, h), 0)
        ikeys = None
        if kind == CSA:
            assert index is not None
            ikeys = model.compress(index, *model.compressor_inputs(index, h), 0)
        else:
            assert kind == HCA
        ci = compressed_index(model, i, h, q_res, pos, entries.shape[0], ikeys, kv.shape[0])
        kv, indices = torch.cat([kv, entries]), torch.cat([indices, ci], dim=1)
    return attend_and_ffn(model, i, q, kv, indices, pos, post, comb, x, ids)
