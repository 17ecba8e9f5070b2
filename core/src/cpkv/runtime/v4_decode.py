"""DeepSeek-V4 decode on one rank: :func:`v4_extend` appends tokens to a request's
:class:`~cpkv.kv.v4_state.V4DecodeState` (one a step when decoding), and :func:`v4_greedy`
decodes greedily from a state.

Per layer and step (docs/models.md, "DeepSeek-V4 decode"): the new row's query and K = V row;
its window is the ring's ``W - 1`` rows and itself; each compressor takes the new row's
``(kv, gate)`` into its open window and, when the window fills (every ``m`` tokens), pools it
into a new entry (CSA with the prior window's Ca half); CSA's indexer scores the new row against
the index keys and the stable top-k selects main entries, HCA reads every complete one;
attention with the sink, the output projection, the MoE; then the ring keeps the last
``W - 1`` rows. The same code on an empty state and a whole prompt is a one-rank prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpkv.kv.v4_state import (
    COMPRESSOR_NAMES,
    V4CompressorCarry,
    V4CompressorState,
    V4DecodeState,
    V4LayerState,
)
from cpkv.models.deepseek_v4 import DeepseekV4, V4Compressor
from cpkv.models.v4_config import CSA
from cpkv.models.v4_reference import attend_and_ffn, compressed_index, window_index

__all__ = ["V4Appended", "v4_draft", "v4_empty_state", "v4_extend", "v4_extend_all",
           "v4_extend_streams", "v4_greedy", "v4_truncate"]


def v4_empty_state(model: DeepseekV4) -> V4DecodeState:
    """The state of a request with no tokens yet (the MTP layer's window ring too, when the
    model has one)."""
    c, dt, dev = model.config, model.dtype, model.device
    layers = []
    for i in range(model.kv_layers):
        comps = {}
        for name, comp in zip(COMPRESSOR_NAMES, model.compressors(i), strict=True):
            if comp is None:
                continue
            w = comp.wkv.shape[0]
            carry = V4CompressorCarry(rate=comp.rate, entries=0,
                                      open_kv=torch.zeros((0, w), dtype=dt, device=dev),
                                      open_gate=torch.zeros((0, w), dtype=dt, device=dev))
            comps[name] = V4CompressorState(
                entries=torch.zeros((0, comp.dim), dtype=dt, device=dev), carry=carry)
        layers.append(V4LayerState(
            window=torch.zeros((c.sliding_window - 1, c.head_dim), dtype=dt, device=dev),
            compressors=comps))
    return V4DecodeState(length=0, layers=layers)


@dataclass
class V4Appended:
    """What :func:`v4_extend` appended, kept to cut it back (:func:`v4_truncate`): the state
    before (a fork: it shares the tensors) and per layer the new rows' K = V rows and each
    compressor's ``(kv, gate)`` projections."""

    before: V4DecodeState
    rows: int
    kv: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def _advance(model: DeepseekV4, comp: V4Compressor, st: V4CompressorState, start: int,
             ckv: torch.Tensor, cg: torch.Tensor) -> None:
    """Feed projections ``(ckv, cg)`` of rows at positions ``start ..`` to a compressor: pool
    the windows they fill. Every field is replaced, never written into."""
    c = st.carry
    kv, gate = torch.cat([c.open_kv, ckv]), torch.cat([c.open_gate, cg])
    m = comp.rate
    n = kv.shape[0] // m
    if n:
        prior = (None if c.prior_kv is None or c.prior_gate is None
                 else (c.prior_kv, c.prior_gate))
        new = model.compress(comp, kv, gate, start // m, prior if comp.overlap else None)
        st.entries = torch.cat([st.entries, new])
        if comp.overlap:
            c.prior_kv, c.prior_gate = kv[(n - 1) * m: n * m], gate[(n - 1) * m: n * m]
    c.open_kv, c.open_gate = kv[n * m:], gate[n * m:]
    c.entries = st.entries.shape[0]


def _layer(model: DeepseekV4, i: int, st: V4LayerState, x: torch.Tensor, ids: torch.Tensor,
           pos: torch.Tensor, start: int, keep: V4Appended | None,
           window: torch.Tensor) -> torch.Tensor:
    """Layer ``i`` over new rows (streams ``x``, positions ``pos`` from ``start``; ``window``:
    their windows as indices into ``[ring, new rows]``, the same at every layer), advancing its
    state ``st``; -> the new streams."""
    c = model.config
    hw = c.sliding_window - 1
    post, comb, collapsed = model.hc_pre(i, "attn", x)
    h = model.attn_norm(i, collapsed)
    q, q_res = model.query(i, h, pos)
    new = model.window_kv(i, h, pos)
    rows = torch.cat([st.window, new])
    kv, indices = rows, window
    st.window = rows[rows.shape[0] - hw:]
    main, index = model.compressors(i)
    inputs = {}
    for name, comp in zip(COMPRESSOR_NAMES, (main, index), strict=True):
        if comp is not None:
            inputs[name] = model.compressor_inputs(comp, h)
            _advance(model, comp, st.compressors[name], start, *inputs[name])
    if keep is not None:
        keep.kv[i], keep.inputs[i] = new, inputs
    if main is not None:
        ikeys = st.compressors["index"].entries if model.layer_kind(i) == CSA else None
        entries = st.compressors["main"].entries
        ci = compressed_index(model, i, h, q_res, pos, entries.shape[0], ikeys, rows.shape[0])
        kv, indices = torch.cat([rows, entries]), torch.cat([indices, ci], dim=1)
    return attend_and_ffn(model, i, q, kv, indices, pos, post, comb, x, ids)


def v4_extend(model: DeepseekV4, state: V4DecodeState, ids: torch.Tensor) -> torch.Tensor:
    """Append tokens ``ids`` ``[N]`` to ``state`` (in place); their logits ``[N, vocab]``
    float32."""
    return model.final_logits(v4_extend_streams(model, state, ids)[0])


def v4_extend_streams(model: DeepseekV4, state: V4DecodeState, ids: torch.Tensor,
                      keep: bool = False) -> tuple[torch.Tensor, V4Appended | None]:
    """Append tokens ``ids`` ``[N]`` to the target layers of ``state`` (in place):
    ``(streams [N, n, hidden] after the last layer, what was appended when keep)``."""
    ids = ids.to(model.device)
    start = state.length
    pos = torch.arange(start, start + ids.shape[0], device=model.device)
    record = V4Appended(before=state.fork(), rows=ids.shape[0]) if keep else None
    x = model.embed(ids)
    window = window_index(pos, start - model.config.sliding_window + 1,
                          model.config.sliding_window)
    for i in range(model.num_layers):
        x = _layer(model, i, state.layers[i], x, ids, pos, start, record, window)
    state.length = start + ids.shape[0]
    return x, record


def v4_truncate(model: DeepseekV4, state: V4DecodeState, appended: V4Appended, keep: int) -> None:
    """Cut ``state`` back to the first ``keep`` of the rows ``appended`` added (rule: the state
    equals one that was extended by those rows alone, bit for bit)."""
    if not 0 <= keep <= appended.rows:
        raise ValueError(f"keep {keep} of {appended.rows} appended rows")
    before = appended.before
    hw = model.config.sliding_window - 1
    for i, kv in appended.kv.items():
        old, st = before.layers[i], state.layers[i]
        st.window = torch.cat([old.window, kv[:keep]])[keep: keep + hw]
        overlap = {n: comp.overlap for n, comp in zip(COMPRESSOR_NAMES, model.compressors(i),
                                                      strict=True) if comp is not None}
        for name, (ckv, cg) in appended.inputs[i].items():
            o, cur = old.compressors[name], st.compressors[name]
            m = o.carry.rate
            kvs = torch.cat([o.carry.open_kv, ckv[:keep]])
            gates = torch.cat([o.carry.open_gate, cg[:keep]])
            n = kvs.shape[0] // m
            cur.entries = cur.entries[: o.entries.shape[0] + n]
            c = cur.carry
            c.entries = cur.entries.shape[0]
            c.open_kv, c.open_gate = kvs[n * m:], gates[n * m:]
            c.prior_kv, c.prior_gate = ((kvs[(n - 1) * m: n * m], gates[(n - 1) * m: n * m])
                                        if n and overlap[name]
                                        else (o.carry.prior_kv, o.carry.prior_gate))
    state.length = before.length + keep


def v4_draft(model: DeepseekV4, state: V4DecodeState, streams: torch.Tensor,
             next_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer over rows at positions ``start ..``: the target's ``streams`` and each
    row's next token ``next_ids``; its window ring in ``state`` advances.
    -> ``(draft logits [N, vocab] float32, its output streams)``."""
    i = model.mtp_layer
    if i is None:
        raise ValueError("this DeepseekV4 was loaded without its MTP draft layer")
    nxt = next_ids.to(model.device)
    pos = torch.arange(start, start + nxt.shape[0], device=model.device)
    window = window_index(pos, start - model.config.sliding_window + 1,
                          model.config.sliding_window)
    y = _layer(model, i, state.layers[i], model.draft_input(streams, nxt), nxt, pos, start, None,
               window)
    return model.draft_logits(y), y


def v4_extend_all(model: DeepseekV4, state: V4DecodeState, ids: torch.Tensor,
                  after: int | None = None) -> torch.Tensor:
    """:func:`v4_extend` of a prompt's piece, and with the MTP layer its rows too (the next
    tokens: the piece's own, then ``after``, the token after the piece, or None: the target's
    argmax at the last row, where the prompt ends). -> the target's logits."""
    if model.mtp_layer is None:
        return v4_extend(model, state, ids)
    start = state.length
    x, _ = v4_extend_streams(model, state, ids)
    logits = model.final_logits(x)
    end = logits[-1:].argmax(-1) if after is None else torch.tensor([after])
    ids = ids.to(end.device)
    v4_draft(model, state, x, torch.cat([ids[1:], end.to(ids.dtype)]), start)
    return logits


def v4_greedy(model: DeepseekV4, state: V4DecodeState, first: int, steps: int) -> list[int]:
    """Greedy decode: feed ``first`` (the prefill's next token) and each argmax after it;
    ``steps`` tokens, ``first`` included."""
    out = [first]
    while len(out) < steps:
        logits = v4_extend(model, state, torch.tensor([out[-1]], dtype=torch.long))
        out.append(int(logits[-1].argmax()))
    return out
