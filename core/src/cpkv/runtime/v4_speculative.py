"""Speculative greedy decoding of DeepSeek-V4 with its MTP draft layer on one rank.

State between steps: the target's rows ``[0, L)`` and the MTP layer's rows ``[0, L)`` (row i
from the target's streams at i and token i + 1); the last emitted token ``t_L`` is in neither;
drafts ``d_1..d_k`` guess ``t_{L+1}..``.

A step extends the target by ``[t_L, d_1, .., d_k]`` in one batch; its greedy choice ``g_j`` at
each row verifies the drafts (``d_j`` accepted while ``d_j == g_{j-1}``). With ``a`` accepted
the step emits ``g_0..g_a``; the target is cut back to ``L + a + 1`` rows
(:func:`~cpkv.runtime.v4_decode.v4_truncate`: the window rings and the compressors' open
windows, prior windows and entries as if only those rows had been appended), and the MTP layer
runs on rows ``L..L+a`` with ``g_0..g_a`` as their next tokens: its last row guesses the next
draft. With ``k > 1`` the MTP layer is chained on its own output streams and last guess, one
position further, on a fork of its window ring that is dropped after.

Every emitted token is the target's greedy choice after a prefix of emitted tokens, so the
output equals plain greedy decoding (:func:`~cpkv.runtime.v4_decode.v4_greedy`) token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpkv.kv.v4_state import V4DecodeState
from cpkv.models.deepseek_v4 import DeepseekV4

from .v4_decode import v4_draft, v4_extend_streams, v4_truncate

__all__ = ["V4SpeculationStats", "v4_speculative"]


@dataclass
class V4SpeculationStats:
    """Verify steps, drafts verified and drafts accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def v4_speculative(model: DeepseekV4, state: V4DecodeState, first: int, draft: int,
                   steps: int, k: int = 1) -> tuple[list[int], V4SpeculationStats]:
    """Decode ``steps`` tokens (``first`` included: the prefill's next token) speculatively from
    a state whose MTP rows cover its target rows; ``draft``: the MTP layer's guess at the
    prompt's last row (the first step verifies it alone). ``k``: drafts verified a step after
    the first.

    Raises:
        ValueError: a model without its MTP layer, ``k < 1``.
    """
    mtp = model.mtp_layer
    if mtp is None:
        raise ValueError("speculative decoding needs the MTP draft layer (load with mtp=True)")
    if k < 1:
        raise ValueError(f"k = {k} drafts a step: at least 1")
    out, drafts, stats = [first], [draft], V4SpeculationStats()
    dev = model.device
    while len(out) < steps:
        start = state.length
        feed = torch.tensor([out[-1], *drafts], dtype=torch.long)
        x, appended = v4_extend_streams(model, state, feed, keep=True)
        assert appended is not None
        greedy = model.final_logits(x).argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == greedy[a]:
            a += 1
        stats.steps, stats.drafted, stats.accepted = (stats.steps + 1, stats.drafted + len(drafts),
                                                      stats.accepted + a)
        v4_truncate(model, state, appended, a + 1)
        out.extend(greedy[: a + 1])
        logits, y = v4_draft(model, state, x[: a + 1],
                             torch.tensor(greedy[: a + 1], dtype=torch.long, device=dev), start)
        drafts = [int(logits[-1].argmax())]
        if k > 1 and len(out) + len(drafts) < steps:
            ring = state.fork().layers[mtp]
            h, pos = y[-1:], start + a + 1
            for _ in range(k - 1):
                logits, h = v4_draft(model, state, h,
                                     torch.tensor(drafts[-1:], dtype=torch.long, device=dev), pos)
                drafts.append(int(logits[-1].argmax()))
                pos += 1
            state.layers[mtp] = ring
    return out[:steps], stats
