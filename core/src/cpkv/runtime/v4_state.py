"""What each rank keeps of a DeepSeek-V4 request after its CP prefill, for decode: the
compressed entries it owns (it computed them) and, on the rank that computed the last token,
the tail bundle (every layer's window ring and compressor carry state with entry counts).
Assembled (:func:`~cpkv.kv.v4_state.assemble_v4_state`) they are the one-rank decode state,
bit for bit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import SplitMode
from cpkv.kv.v4_state import (
    COMPRESSOR_NAMES,
    V4CompressorCarry,
    V4OwnedEntries,
    V4TailBundle,
    V4TailLayer,
)
from cpkv.models.deepseek_v4 import DeepseekV4, V4Compressor

from .v4_prefill import V4Carry, V4SegmentRows, v4_prefill_logits

__all__ = ["owned_entries", "tail_bundle", "v4_prefill_state"]


def _named(model: DeepseekV4, layer: int) -> list[tuple[str, V4Compressor]]:
    return [(n, c) for n, c in zip(COMPRESSOR_NAMES, model.compressors(layer), strict=True)
            if c is not None]


def owned_entries(model: DeepseekV4, carry: V4Carry, rank: int) -> V4OwnedEntries:
    """The entries ``rank`` computed during the prefill that filled ``carry``."""
    assert carry.layout is not None, "the carry of a finished prefill"
    out = {}
    for i in range(model.num_layers):
        for name, comp in _named(model, i):
            ids = carry.layout.entries[comp.rate][rank]
            out[(i, name)] = (ids, carry.owned[(i, name)])
    return V4OwnedEntries(rank=rank, entries=out)


def _carry(comp: V4Compressor, rows: V4SegmentRows, name: str) -> V4CompressorCarry:
    m = comp.rate
    kv, gate = rows.inputs[name]
    n = kv.shape[0]
    full = n - rows.end % m  # the rows kept start on a window boundary
    out = V4CompressorCarry(rate=m, entries=rows.end // m, open_kv=kv[full:],
                            open_gate=gate[full:])
    if comp.overlap:
        if full >= m:
            out.prior_kv, out.prior_gate = kv[full - m: full], gate[full - m: full]
        elif rows.end >= m:  # the window before the segment: the halo's
            out.prior_kv, out.prior_gate = rows.priors[name]
    return out


def tail_bundle(model: DeepseekV4, carry: V4Carry) -> V4TailBundle | None:
    """The tail bundle on the rank that computed the last token (None on the others)."""
    if not carry.last_rows:
        return None
    hw = model.config.sliding_window - 1
    layers = []
    for i in range(model.kv_layers):
        rows = carry.last_rows[i]
        # the halo's W - 1 rows come first: the window rows are never fewer than the ring's
        layers.append(V4TailLayer(window=rows.window[rows.window.shape[0] - hw:],
                                  carry={n: _carry(c, rows, n) for n, c in _named(model, i)}))
    return V4TailBundle(length=carry.last_rows[0].end, layers=layers)


def v4_prefill_state(model: DeepseekV4, ids: torch.Tensor, group: CPGroup, *,
                     page_size: int = 64, mode: SplitMode | str = SplitMode.ZIGZAG,
                     chunks: Sequence[int] | None = None
                     ) -> tuple[torch.Tensor, V4OwnedEntries, V4TailBundle | None]:
    """CP prefill of ``ids`` (:func:`~cpkv.runtime.v4_prefill.v4_prefill_logits`) keeping this
    rank's part of the decode state: ``(logits [T, vocab], owned entries, tail bundle or None)``.
    """
    carry = V4Carry()
    logits = v4_prefill_logits(model, ids, group, page_size=page_size, mode=mode, chunks=chunks,
                               carry=carry)
    return logits, owned_entries(model, carry, group.rank), tail_bundle(model, carry)
