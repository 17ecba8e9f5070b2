"""DeepSeek-V4 context-parallel prefill of one prompt on the torch reference ops (contract
rules 33-40; docs/models.md, "DeepSeek-V4").

The plan cuts the prompt on ownership-unit boundaries (:meth:`DeepseekV4Config.ownership_unit`),
so every compression window lies inside one rank's segment. Per layer each rank:

1. computes its rows' query, window rows (K = V) and compressor inputs;
2. **halo**, one collective: every segment's last ``W - 1`` window rows and, on a CSA layer,
   its last window's compressor rows (main and indexer; their Ca half is the next segment's
   first entry's overlap) are all-gathered; each segment takes its predecessor's (rule 35);
3. compresses the windows it owns (the windows ending inside its segments), with the halo;
4. **full view**, one collective: the compressed entries (main, and CSA's index keys) are
   all-gathered and laid out in entry order (rule 40: entries only, never raw rows);
5. runs the indexer over the causal index keys and the stable top-k (rule 39), attention over
   window rows + selected (CSA) / all causal (HCA) entries + sink, and the rest per row.

A plan that cannot meet the unit (a zigzag prompt of fewer than 2C units) is re-planned
interleaved, which always meets it, through the fallback choke point. The window must fit in
a unit (``sliding_window - 1 <= unit``: true at V4's 128 and 256) so that a halo comes from one
predecessor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackReason, RequestPlan, RequestSpec, SplitMode
from cpkv.fallback import report_fallback
from cpkv.models.deepseek_v4 import DeepseekV4, V4Compressor, stable_topk
from cpkv.models.v4_config import CSA
from cpkv.models.v4_objects import v4_objects
from cpkv.models.v4_reference import gather_keys, window_rows
from cpkv.planning import plan_batch

__all__ = ["V4Carry", "V4Layout", "V4SegmentRows", "v4_kv_bytes", "v4_layout",
           "v4_prefill_logits"]


@dataclass(frozen=True)
class V4Layout:
    """Host-side layout of one chunk of a prompt on the group, computed once per batch."""

    plan: RequestPlan
    unit: int
    #: per rank: its segments ``(start, end)`` in position order
    segments: tuple[tuple[tuple[int, int], ...], ...]
    #: per rank, per segment: the gathered halo row of its predecessor (-1: starts at 0)
    halo_src: tuple[tuple[int, ...], ...]
    max_segments: int
    #: per rate: per rank the entries it owns (earlier chunks' first); max per rank; entry
    #: order -> gathered row
    entries: dict[int, tuple[tuple[int, ...], ...]]
    max_entries: dict[int, int]
    entry_perm: dict[int, tuple[int, ...]]
    max_rows: int
    #: this chunk's positions in order -> gathered row
    row_perm: tuple[int, ...]
    #: the rank holding the request's tail objects before this chunk (-1: no prefix)
    carry_rank: int

    @property
    def tail_rank(self) -> int:
        """The rank that computes the chunk's last token: it holds the tail objects after."""
        return self.plan.segments[-1].rank


def _plan(length: int, cp_size: int, page_size: int, unit: int, mode: SplitMode | str,
          prefix: V4Layout | None) -> RequestPlan:
    p = 0 if prefix is None else prefix.plan.prefix_len + prefix.plan.extend_len
    owners = () if prefix is None else tuple(
        r for r in prefix.plan.page_owners[: -(-p // page_size)] if r is not None)
    spec = RequestSpec(prefix_len=p, extend_len=length, prefix_owners=owners)
    rp = plan_batch([spec], cp_size, page_size, mode, unit=unit).requests[0]
    if not rp.page_aligned:
        report_fallback(op="v4_split_plan", requested=f"{SplitMode(mode).value} on units of {unit}",
                        selected="interleave on units", reason=FallbackReason.SHORT_EXTEND,
                        detail=f"{length} tokens are fewer than 2C={2 * cp_size} units of {unit}")
        rp = plan_batch([spec], cp_size, page_size, SplitMode.INTERLEAVE, unit=unit).requests[0]
    return rp


def v4_layout(model: DeepseekV4, length: int, cp_size: int, page_size: int,
              mode: SplitMode | str, prefix: V4Layout | None = None) -> V4Layout:
    """Plan ``length`` tokens (after ``prefix``, the previous chunk's layout) and derive the
    halo and full-view layouts.

    Raises:
        ValueError: a sliding window wider than the ownership unit; a prefix that does not end
            on a unit boundary (rule 37).
    """
    c = model.config
    unit = c.ownership_unit(page_size)
    if c.sliding_window - 1 > unit:
        raise ValueError(f"sliding_window={c.sliding_window} spans more than one ownership unit "
                         f"({unit} tokens): a halo would come from several segments")
    start = 0 if prefix is None else prefix.plan.prefix_len + prefix.plan.extend_len
    if start % unit:
        raise ValueError(f"a chunk boundary at {start} is not on an ownership unit boundary "
                         f"(unit {unit} tokens)")
    rp = _plan(length, cp_size, page_size, unit, mode, prefix)
    carry_rank = -1 if prefix is None else prefix.tail_rank
    segs: list[list[tuple[int, int]]] = [[] for _ in range(cp_size)]
    where: dict[int, tuple[int, int]] = {}  # segment end -> (rank, local index)
    merged: list[list[int]] = []  # adjacent segments of one rank as one (a C = 1 zigzag)
    for s, t, r in rp.segments:
        if merged and merged[-1][2] == r and merged[-1][1] == s:
            merged[-1][1] = t
        else:
            merged.append([s, t, r])
    for s, t, r in merged:
        where[t] = (r, len(segs[r]))
        segs[r].append((s, t))
    if carry_rank >= 0:  # the carried tail: one more halo row of the previous tail holder
        where[start] = (carry_rank, len(segs[carry_rank]))
    max_seg = max(len(x) + (r == carry_rank) for r, x in enumerate(segs))
    halo = tuple(tuple(-1 if s == 0 else where[s][0] * max_seg + where[s][1] for s, _ in x)
                 for x in segs)
    end = start + length
    entries: dict[int, tuple[tuple[int, ...], ...]] = {}
    max_e: dict[int, int] = {}
    perm: dict[int, tuple[int, ...]] = {}
    for m in c.rates:
        before = prefix.entries[m] if prefix is not None else ((),) * cp_size
        per = tuple(before[r] + tuple(w for s, t in x for w in range(-(-s // m), t // m))
                    for r, x in enumerate(segs))
        entries[m] = per
        max_e[m] = max(1, max(len(p) for p in per))
        slot = {w: r * max_e[m] + i for r, p in enumerate(per) for i, w in enumerate(p)}
        perm[m] = tuple(slot[w] for w in range(end // m))
    max_rows = max(sum(t - s for s, t in x) for x in segs)
    row_slot = {}
    for r, x in enumerate(segs):
        i = 0
        for s, t in x:
            for pos in range(s, t):
                row_slot[pos] = r * max_rows + i
                i += 1
    return V4Layout(plan=rp, unit=unit, segments=tuple(tuple(x) for x in segs), halo_src=halo,
                    max_segments=max_seg, entries=entries, max_entries=max_e, entry_perm=perm,
                    max_rows=max_rows, row_perm=tuple(row_slot[p] for p in range(start, end)),
                    carry_rank=carry_rank)


def v4_kv_bytes(model: DeepseekV4, lay: V4Layout, elem_bytes: int = 4
                ) -> tuple[list[int], int]:
    """``(per-rank bytes, replicated entry bytes)`` of one request after the forward: each
    rank holds the entries it computed (one owner each: the sum over ranks is the replicated
    entry bytes) and the tail holder (the rank of the last token) also the window rows and
    the carry state."""
    length = lay.plan.prefix_len + lay.plan.extend_len
    per = [0] * len(lay.segments)
    replicated = 0
    tail = lay.plan.segments[-1].rank
    for obj in v4_objects(model.config, elem_bytes):
        if obj.kind == "entries":
            replicated += obj.bytes_for(length)
            for r, owned in enumerate(lay.entries[obj.rate]):
                per[r] += len(owned) * obj.row_bytes
        else:
            per[tail] += obj.bytes_for(length)
    return per, replicated


def _halo_parts(model: DeepseekV4, layer: int) -> list[V4Compressor]:
    main, index = model.compressors(layer)
    return [x for x in (main, index) if x is not None and x.overlap]


@dataclass
class V4Carry:
    """What one rank keeps of a request between chunks (rule 37): the compressed entries it
    owns per ``(layer, "main" | "index")``, in the order of ``V4Layout.entries[rate][rank]``
    (its pages), and on the tail holder the tail objects: per layer the packed halo row (the
    last ``W - 1`` window rows and CSA's last window's compressor rows, whose Ca half is the
    next entry's overlap). A chunk boundary is on a unit boundary, so no window is open."""

    owned: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    tail: dict[int, torch.Tensor] = field(default_factory=dict)
    #: the last chunk's layout, and on its tail holder per layer the rows of its last segment
    #: (what the decode state's tail bundle is cut from: :mod:`cpkv.runtime.v4_state`)
    layout: V4Layout | None = None
    last_rows: dict[int, V4SegmentRows] = field(default_factory=dict)


@dataclass
class V4SegmentRows:
    """What the tail holder keeps of its last segment ``[start, end)`` at one layer (copies,
    so the layer's tensors are freed): the last ``W - 1`` window rows (the halo's before the
    segment's own), per compressor name the ``(kv, gate)`` projections of the segment's last
    ``min(n, m + end % m)`` rows (the open window and the complete one before it), and the
    halo's prior window rows ``(kv, gate)`` ``[m, w]`` of the overlapping compressors (absent
    at position 0)."""

    start: int
    end: int
    window: torch.Tensor
    inputs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    priors: dict[str, tuple[torch.Tensor, torch.Tensor]]


class _Rank:
    """One rank's per-batch state: its rows, segment bounds and the permutations as tensors
    (built once per batch, reused by every layer: rule 16, 22)."""

    def __init__(self, model: DeepseekV4, ids: torch.Tensor, group: CPGroup,
                 lay: V4Layout, carry: V4Carry) -> None:
        self.model, self.group, self.lay, self.carry = model, group, lay, carry
        self.next_tail: dict[int, torch.Tensor] = {}
        dev = model.device
        self.segs = lay.segments[group.rank]
        self.halo_src = lay.halo_src[group.rank]
        self.pos = (torch.cat([torch.arange(s, t) for s, t in self.segs]).to(dev) if self.segs
                    else torch.empty(0, dtype=torch.long, device=dev))
        self.ids = ids.to(dev)[self.pos - lay.plan.prefix_len]
        self.bounds = [0]
        for s, t in self.segs:
            self.bounds.append(self.bounds[-1] + t - s)
        self.entry_perm = {m: torch.tensor(p, dtype=torch.long, device=dev)
                           for m, p in lay.entry_perm.items()}
        self.row_perm = torch.tensor(lay.row_perm, dtype=torch.long, device=dev)
        self.halo_w = model.config.sliding_window - 1

    def halo(self, layer: int, kv: torch.Tensor,
             inputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
             overlap: list[V4Compressor]) -> torch.Tensor:
        """Step 2: one collective of every segment's last ``W - 1`` window rows and its last
        window's compressor rows (CSA), and the carried tail of the previous chunk;
        ``[C * max_segments, width]``, rank-major."""
        tails = []
        for j in range(len(self.segs)):
            a, b = self.bounds[j], self.bounds[j + 1]
            part = [_tail(kv[a:b], self.halo_w)]
            for comp in overlap:
                ckv, cg = inputs[id(comp)]
                part += [_tail(ckv[a:b], comp.rate), _tail(cg[a:b], comp.rate)]
            tails.append(torch.cat([p.reshape(-1) for p in part]))
        if tails and self.group.rank == self.lay.tail_rank:  # its last segment ends the chunk
            self.next_tail[layer] = tails[-1]
        if self.group.rank == self.lay.carry_rank:
            tails.append(self.carry.tail[layer])
        width = self.halo_w * kv.shape[1] + sum(4 * comp.rate * comp.dim for comp in overlap)
        send = torch.stack(tails) if tails else kv.new_zeros((0, width))
        return self.group.all_gather_rows(send, self.lay.max_segments)

    def windows_and_entries(self, layer: int, kv: torch.Tensor, halos: torch.Tensor,
                            inputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
                            overlap: list[V4Compressor]
                            ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Steps 1 and 3: each row's window keys and mask ``[N, W, D]``, and the entries this
        rank owns per compressor (the windows ending in its segments, the halo as prior)."""
        model, hw, d = self.model, self.halo_w, kv.shape[1]
        window = model.config.sliding_window
        comps = [x for x in model.compressors(layer) if x is not None]
        keys, masks = [], []
        own: dict[int, list[torch.Tensor]] = {id(x): [] for x in comps}
        for j, (s, _) in enumerate(self.segs):
            a, b = self.bounds[j], self.bounds[j + 1]
            src = self.halo_src[j]
            row = halos[src] if src >= 0 else None
            prev = row[: hw * d].view(hw, d) if row is not None else kv.new_zeros((hw, d))
            rows = torch.cat([prev, kv[a:b]])
            k, m = window_rows(rows, self.pos[a:b], s - hw, window)
            keys.append(k)
            masks.append(m)
            off, priors = hw * d, {}
            for comp in overlap:
                n = comp.rate * 2 * comp.dim
                if row is not None:
                    priors[id(comp)] = (row[off:off + n].view(comp.rate, -1),
                                        row[off + n:off + 2 * n].view(comp.rate, -1))
                off += 2 * n
            if j == len(self.segs) - 1 and self.group.rank == self.lay.tail_rank:
                names = dict(zip((id(x) for x in model.compressors(layer)), ("main", "index"),
                                 strict=True))
                keep = {id(x): min(b - a, x.rate + (s + b - a) % x.rate) for x in comps}
                self.carry.last_rows[layer] = V4SegmentRows(
                    start=s, end=s + b - a, window=rows[rows.shape[0] - hw:].clone(),
                    inputs={names[i]: (x[b - keep[i]:b].clone(), g[b - keep[i]:b].clone())
                            for i, (x, g) in inputs.items()},
                    priors={names[i]: (p[0].clone(), p[1].clone()) for i, p in priors.items()})
            for comp in comps:  # s is on a unit boundary: a window boundary at every rate
                ckv, cg = inputs[id(comp)]
                own[id(comp)].append(model.compress(comp, ckv[a:b], cg[a:b], s // comp.rate,
                                                    priors.get(id(comp))))
        out_k = torch.cat(keys) if keys else kv.new_zeros((0, window, d))
        out_m = (torch.cat(masks) if masks
                 else torch.zeros(0, window, dtype=torch.bool, device=kv.device))
        return out_k, out_m, {id(x): _cat(own[id(x)], x.dim, kv) for x in comps}

    def full_view(self, layer: int, main: V4Compressor, index: V4Compressor | None,
                  own: dict[int, torch.Tensor]) -> torch.Tensor:
        """Step 4: one collective of the owned entries (earlier chunks' and this one's; main
        ++ index key), in entry order."""
        parts = []
        for name, comp in (("main", main), ("index", index)):
            if comp is None:
                continue
            before = self.carry.owned.get((layer, name))
            mine = own[id(comp)] if before is None else torch.cat([before, own[id(comp)]])
            self.carry.owned[(layer, name)] = mine
            parts.append(mine)
        gathered = self.group.all_gather_rows(torch.cat(parts, dim=1),
                                              self.lay.max_entries[main.rate])
        return gathered[self.entry_perm[main.rate]]

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """One decoder layer on this rank's rows (streams ``[N, n, hidden]``)."""
        model, c, pos = self.model, self.model.config, self.pos
        post, comb, collapsed = model.hc_pre(i, "attn", x)
        h = model.attn_norm(i, collapsed)
        q, q_res = model.query(i, h, pos)
        kv = model.window_kv(i, h, pos)
        main, index = model.compressors(i)
        inputs = {id(comp): model.compressor_inputs(comp, h)
                  for comp in (main, index) if comp is not None}
        overlap = _halo_parts(model, i)
        halos = self.halo(i, kv, inputs, overlap)
        keys, mask, own = self.windows_and_entries(i, kv, halos, inputs, overlap)
        if main is not None:
            full = self.full_view(i, main, index, own)
            selected = None
            if model.layer_kind(i) == CSA:
                ikeys = full[:, c.head_dim:]
                scores = model.index_scores(i, h, q_res, pos, ikeys)
                selected = stable_topk(scores, min(c.index_topk, ikeys.shape[0]))
            ck, cm = gather_keys(model, i, full[:, : c.head_dim], pos, selected)
            keys, mask = torch.cat([keys, ck], dim=1), torch.cat([mask, cm], dim=1)
        o = model.attend(i, q, keys, mask)
        x = model.hc_post(post, comb, model.attention_output(i, o, pos), x)
        post, comb, collapsed = model.hc_pre(i, "ffn", x)
        return model.hc_post(post, comb, model.moe(i, collapsed, self.ids), x)


def v4_prefill_logits(model: DeepseekV4, ids: torch.Tensor, group: CPGroup, *,
                      page_size: int = 64, mode: SplitMode | str = SplitMode.ZIGZAG,
                      chunks: Sequence[int] | None = None,
                      carry: V4Carry | None = None) -> torch.Tensor:
    """Logits ``[T, vocab]`` float32 of prompt ``ids`` ``[T]``, computed context-parallel on
    ``group`` (every rank returns all of them).

    ``chunks``: prefill in pieces of these lengths (summing to T), each a batch of its own, the
    entries and the tail objects carried between them (:class:`V4Carry`); every piece but the
    last a multiple of the ownership unit. Any chunking equals the one-piece prefill.
    ``carry``: a fresh :class:`V4Carry` to fill (this rank's owned entries and, on the tail
    holder, the last segment's rows), kept for the decode state; or one with a ``layout`` (an
    earlier prefill of the request's first tokens, or a prefix rebuilt from the prefix cache):
    ``ids`` then continue after it, as the next chunk would.

    Raises:
        ValueError: a sliding window wider than the ownership unit; chunks that do not sum to
            T or end off a unit boundary.
    """
    sizes = list(chunks) if chunks is not None else [ids.shape[0]]
    if sum(sizes) != ids.shape[0] or min(sizes) < 1:
        raise ValueError(f"chunks {sizes} do not split a prompt of {ids.shape[0]} tokens")
    carry = V4Carry() if carry is None else carry
    lay, start, out = carry.layout, 0, []
    for n in sizes:
        lay = v4_layout(model, n, group.size, page_size, mode, prefix=lay)
        carry.layout, carry.last_rows = lay, {}
        rank = _Rank(model, ids[start:start + n], group, lay, carry)
        x = model.embed(rank.ids)
        for i in range(model.num_layers):
            x = rank.layer(i, x)
        carry.tail = rank.next_tail  # the tail objects move to this chunk's last rank
        out.append(group.all_gather_rows(model.final_logits(x), lay.max_rows)[rank.row_perm])
        start += n
    return torch.cat(out)


def _cat(parts: list[torch.Tensor], dim: int, like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros((0, dim))


def _tail(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` rows (zero-padded at the front when fewer)."""
    if rows.shape[0] >= n:
        return rows[rows.shape[0] - n:]
    return torch.cat([rows.new_zeros((n - rows.shape[0], *rows.shape[1:])), rows])
