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
from cpkv.models.v4_reference import attend_and_ffn, compressed_keys, window_rows

__all__ = ["v4_empty_state", "v4_extend", "v4_greedy"]


def v4_empty_state(model: DeepseekV4) -> V4DecodeState:
    """The state of a request with no tokens yet."""
    c, dt, dev = model.config, model.dtype, model.device
    layers = []
    for i in range(model.num_layers):
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


def _advance(model: DeepseekV4, comp: V4Compressor, st: V4CompressorState, start: int,
             h: torch.Tensor) -> None:
    """Feed rows ``h`` (positions ``start ..``) to a compressor: pool the windows they fill."""
    ckv, cg = model.compressor_inputs(comp, h)
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


def v4_extend(model: DeepseekV4, state: V4DecodeState, ids: torch.Tensor) -> torch.Tensor:
    """Append tokens ``ids`` ``[N]`` to ``state`` (in place); their logits ``[N, vocab]``
    float32."""
    c = model.config
    ids = ids.to(model.device)
    start = state.length
    pos = torch.arange(start, start + ids.shape[0], device=model.device)
    hw = c.sliding_window - 1
    x = model.embed(ids)
    for i in range(model.num_layers):
        st = state.layers[i]
        post, comb, collapsed = model.hc_pre(i, "attn", x)
        h = model.attn_norm(i, collapsed)
        q, q_res = model.query(i, h, pos)
        rows = torch.cat([st.window, model.window_kv(i, h, pos)])
        keys, mask = window_rows(rows, pos, start - hw, c.sliding_window)
        st.window = rows[rows.shape[0] - hw:]
        main, index = model.compressors(i)
        for name, comp in zip(COMPRESSOR_NAMES, (main, index), strict=True):
            if comp is not None:
                _advance(model, comp, st.compressors[name], start, h)
        if main is not None:
            ikeys = st.compressors["index"].entries if model.layer_kind(i) == CSA else None
            ck, cm = compressed_keys(model, i, h, q_res, pos, st.compressors["main"].entries,
                                     ikeys)
            keys, mask = torch.cat([keys, ck], dim=1), torch.cat([mask, cm], dim=1)
        x = attend_and_ffn(model, i, q, keys, mask, pos, post, comb, x, ids)
    state.length = start + ids.shape[0]
    return model.final_logits(x)


def v4_greedy(model: DeepseekV4, state: V4DecodeState, first: int, steps: int) -> list[int]:
    """Greedy decode: feed ``first`` (the prefill's next token) and each argmax after it;
    ``steps`` tokens, ``first`` included."""
    out = [first]
    while len(out) < steps:
        logits = v4_extend(model, state, torch.tensor([out[-1]], dtype=torch.long))
        out.append(int(logits[-1].argmax()))
    return out
