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
from cpkv.models.deepseek_v4 import DeepseekV4, V4Compressor
from cpkv.models.v4_config import CSA
from cpkv.models.v4_objects import v4_objects
from cpkv.models.v4_reference import entry_index, window_index
from cpkv.planning import plan_batch

__all__ = ["V4Carry", "V4Layout", "V4SegmentRows", "v4_kv_bytes", "v4_layout", "v4_layouts",
           "v4_prefill_batch", "v4_prefill_logits"]


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


def _spec(length: int, page_size: int, prefix: V4Layout | None) -> RequestSpec:
    p = 0 if prefix is None else prefix.plan.prefix_len + prefix.plan.extend_len
    owners = () if prefix is None else tuple(
        r for r in prefix.plan.page_owners[: -(-p // page_size)] if r is not None)
    return RequestSpec(prefix_len=p, extend_len=length, prefix_owners=owners)


def _plan(specs: list[RequestSpec], cp_size: int, page_size: int, unit: int,
          mode: SplitMode | str) -> list[RequestPlan]:
    """One plan of the batch; a request that cannot meet the unit re-planned interleaved."""
    # the short requests' fallback is this function's (re-planned interleaved, reported below)
    plans = list(plan_batch(specs, cp_size, page_size, mode, unit=unit,
                            report_short=False).requests)
    short = [j for j, rp in enumerate(plans) if not rp.page_aligned]
    if short:
        report_fallback(op="v4_split_plan",
                        requested=f"{SplitMode(mode).value} on units of {unit}",
                        selected="interleave on units", reason=FallbackReason.SHORT_EXTEND,
                        detail=f"{len(short)} of {len(specs)} requests are fewer than "
                               f"2C={2 * cp_size} units of {unit} tokens: " + ", ".join(
                                   f"#{j} ({specs[j].extend_len} tokens)" for j in short))
        for j in short:
            plans[j] = plan_batch([specs[j]], cp_size, page_size, SplitMode.INTERLEAVE,
                                  unit=unit).requests[0]
    return plans


def v4_layout(model: DeepseekV4, length: int, cp_size: int, page_size: int,
              mode: SplitMode | str, prefix: V4Layout | None = None) -> V4Layout:
    """Plan ``length`` tokens (after ``prefix``, the previous chunk's layout) and derive the
    halo and full-view layouts: :func:`v4_layouts` of one request.

    Raises:
        ValueError: a sliding window wider than the ownership unit; a prefix that does not end
            on a unit boundary (rule 37).
    """
    return v4_layouts(model, [length], cp_size, page_size, mode, [prefix])[0]


def v4_layouts(model: DeepseekV4, lengths: Sequence[int], cp_size: int, page_size: int,
               mode: SplitMode | str, prefixes: Sequence[V4Layout | None] | None = None
               ) -> list[V4Layout]:
    """Plan a batch: request j's ``lengths[j]`` tokens after ``prefixes[j]`` (its previous
    chunk's layout, or None), in one plan (rule 7), and derive each request's halo and
    full-view layouts.

    Raises:
        ValueError: a sliding window wider than the ownership unit; a prefix that does not end
            on a unit boundary (rule 37).
    """
    c = model.config
    unit = c.ownership_unit(page_size)
    if c.sliding_window - 1 > unit:
        raise ValueError(f"sliding_window={c.sliding_window} spans more than one ownership unit "
                         f"({unit} tokens): a halo would come from several segments")
    before = list(prefixes) if prefixes is not None else [None] * len(lengths)
    specs = [_spec(n, page_size, pre) for n, pre in zip(lengths, before, strict=True)]
    for spec in specs:
        if spec.prefix_len % unit:
            raise ValueError(f"a chunk boundary at {spec.prefix_len} is not on an ownership "
                             f"unit boundary (unit {unit} tokens)")
    plans = _plan(specs, cp_size, page_size, unit, mode)
    return [_derive(model, rp, unit, cp_size, pre)
            for rp, pre in zip(plans, before, strict=True)]


def _derive(model: DeepseekV4, rp: RequestPlan, unit: int, cp_size: int,
            prefix: V4Layout | None) -> V4Layout:
    """One request's halo and full-view layouts from its plan."""
    c = model.config
    start, length = rp.prefix_len, rp.extend_len
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
    for obj in v4_objects(model.config, elem_bytes, mtp=model.mtp_layer is not None):
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
    #: with the MTP draft layer: its logits ``[rows, vocab]`` float32 of each piece prefilled
    #: (every rank: gathered, as the target's); row i guesses token i + 2
    draft_logits: list[torch.Tensor] = field(default_factory=list)


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
        # each row's window as indices into the per-layer buffer of [halo, segment] blocks: the
        # same at every layer (positions only), so once per batch
        window, idx, base = model.config.sliding_window, [], 0
        for j, (s, _) in enumerate(self.segs):
            a, b = self.bounds[j], self.bounds[j + 1]
            idx.append(window_index(self.pos[a:b], s - self.halo_w, window, base))
            base += self.halo_w + b - a
        self.window_idx = (torch.cat(idx) if idx
                           else torch.zeros(0, window, dtype=torch.long, device=dev))

    def halo(self, layer: int, kv: torch.Tensor,
             inputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
             overlap: list[V4Compressor]) -> torch.Tensor:
        """Step 2 alone: :meth:`halo_rows` all-gathered, ``[C * max_segments, width]``,
        rank-major (a batch gathers every request's in one collective: :func:`_gather_parts`)."""
        return self.group.all_gather_rows(self.halo_rows(layer, kv, inputs, overlap),
                                          self.lay.max_segments)

    def halo_rows(self, layer: int, kv: torch.Tensor,
                  inputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  overlap: list[V4Compressor]) -> torch.Tensor:
        """Step 2's rows this rank sends: every segment's last ``W - 1`` window rows and its
        last window's compressor rows (CSA), and the carried tail of the previous chunk;
        ``[<= max_segments, width]``."""
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
        return torch.stack(tails) if tails else kv.new_zeros((0, width))

    def windows_and_entries(self, layer: int, kv: torch.Tensor, halos: torch.Tensor,
                            inputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
                            overlap: list[V4Compressor]
                            ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Steps 1 and 3: the window rows' buffer (per segment its halo rows, then its own)
        and each row's window as indices into it ``[N, W]``, and the entries this rank owns
        per compressor (the windows ending in its segments, the halo as prior)."""
        model, hw, d = self.model, self.halo_w, kv.shape[1]
        comps = [x for x in model.compressors(layer) if x is not None]
        bufs = []
        own: dict[int, list[torch.Tensor]] = {id(x): [] for x in comps}
        for j, (s, _) in enumerate(self.segs):
            a, b = self.bounds[j], self.bounds[j + 1]
            src = self.halo_src[j]
            row = halos[src] if src >= 0 else None
            prev = row[: hw * d].view(hw, d) if row is not None else kv.new_zeros((hw, d))
            rows = torch.cat([prev, kv[a:b]])
            bufs.append(rows)
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
        buf = torch.cat(bufs) if bufs else kv.new_zeros((0, d))
        return buf, self.window_idx, {id(x): _cat(own[id(x)], x.dim, kv) for x in comps}

    def full_view(self, layer: int, main: V4Compressor, index: V4Compressor | None,
                  own: dict[int, torch.Tensor]) -> torch.Tensor:
        """Step 4 alone: :meth:`owned_rows` all-gathered, in entry order (a batch gathers
        every request's in one collective: :func:`_gather_parts`)."""
        gathered = self.group.all_gather_rows(self.owned_rows(layer, main, index, own),
                                              self.lay.max_entries[main.rate])
        return gathered[self.entry_perm[main.rate]]

    def owned_rows(self, layer: int, main: V4Compressor, index: V4Compressor | None,
                   own: dict[int, torch.Tensor]) -> torch.Tensor:
        """Step 4's rows this rank sends: the entries it owns (earlier chunks' and this one's;
        main ++ index key), ``[<= max_entries, width]``."""
        parts = []
        for name, comp in (("main", main), ("index", index)):
            if comp is None:
                continue
            before = self.carry.owned.get((layer, name))
            mine = own[id(comp)] if before is None else torch.cat([before, own[id(comp)]])
            self.carry.owned[(layer, name)] = mine
            parts.append(mine)
        return torch.cat(parts, dim=1)

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """One decoder layer on this rank's rows (streams ``[N, n, hidden]``): a batch of one
        (:func:`_layer`)."""
        return _layer([self], i, [x])[0]

    def attention_inputs(self, i: int, x: torch.Tensor) -> _AttnInputs:
        """Step 1: the rows' mHC collapse, query, window rows and compressor inputs."""
        model = self.model
        post, comb, collapsed = model.hc_pre(i, "attn", x)
        h = model.attn_norm(i, collapsed)
        q, q_res = model.query(i, h, self.pos)
        kv = model.window_kv(i, h, self.pos)
        main, index = model.compressors(i)
        inputs = {id(comp): model.compressor_inputs(comp, h)
                  for comp in (main, index) if comp is not None}
        return _AttnInputs(x, post, comb, h, q, q_res, kv, inputs, _halo_parts(model, i))

    def attend_and_ffn(self, i: int, a: _AttnInputs, buf: torch.Tensor, indices: torch.Tensor,
                       full: torch.Tensor | None) -> torch.Tensor:
        """Step 5: the indexer and top-k (CSA), attention over the window rows and the
        compressed entries (one buffer: the window rows', then the full view's entries), the
        output projection, the MoE; -> the new streams."""
        model, c, pos = self.model, self.model.config, self.pos
        kv = buf
        if full is not None:
            selected = None
            if model.layer_kind(i) == CSA:
                selected = model.select(i, a.h, a.q_res, pos, full[:, c.head_dim:])
            ci = entry_index(model, full.shape[0], pos, selected, buf.shape[0])
            kv = torch.cat([buf, full[:, : c.head_dim]])
            indices = torch.cat([indices, ci], dim=1)
        o = model.attend(i, a.q, kv, indices)
        x = model.hc_post(a.post, a.comb, model.attention_output(i, o, pos), a.x)
        post, comb, collapsed = model.hc_pre(i, "ffn", x)
        return model.hc_post(post, comb, model.moe(i, collapsed, self.ids), x)


@dataclass
class _AttnInputs:
    """What step 1 computed for a layer on one rank's rows of one request."""

    x: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    h: torch.Tensor
    q: torch.Tensor
    q_res: torch.Tensor
    kv: torch.Tensor
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]]
    overlap: list[V4Compressor]


def _gather_parts(group: CPGroup, parts: list[torch.Tensor], maxes: list[int]
                  ) -> list[torch.Tensor]:
    """One collective for a batch: each rank's part of request j padded to ``maxes[j]`` rows,
    all-gathered at once; per request the rank-major ``[C * maxes[j], ...]`` rows a lone
    ``all_gather_rows(parts[j], maxes[j])`` would return."""
    if len(parts) == 1:
        return [group.all_gather_rows(parts[0], maxes[0])]
    total = sum(maxes)
    send = parts[0].new_zeros((total, *parts[0].shape[1:]))
    off = 0
    for part, m in zip(parts, maxes, strict=True):
        send[off:off + part.shape[0]] = part
        off += m
    got = group.all_gather_rows(send, total).view(group.size, total, *parts[0].shape[1:])
    out, off = [], 0
    for m in maxes:
        out.append(got[:, off:off + m].reshape(group.size * m, *parts[0].shape[1:]))
        off += m
    return out


def _layer(ranks: list[_Rank], i: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One decoder layer of a batch on this rank (one :class:`_Rank` per request): one halo
    collective and, on a compressed layer, one full-view collective for every request."""
    group = ranks[0].group
    ins = [r.attention_inputs(i, x) for r, x in zip(ranks, xs, strict=True)]
    halos = _gather_parts(group, [r.halo_rows(i, a.kv, a.inputs, a.overlap)
                                  for r, a in zip(ranks, ins, strict=True)],
                          [r.lay.max_segments for r in ranks])
    windows = [r.windows_and_entries(i, a.kv, halo, a.inputs, a.overlap)
               for r, a, halo in zip(ranks, ins, halos, strict=True)]
    main, index = ranks[0].model.compressors(i)
    fulls: list[torch.Tensor | None] = [None] * len(ranks)
    if main is not None:
        gathered = _gather_parts(group, [r.owned_rows(i, main, index, own)
                                         for r, (_, _, own) in zip(ranks, windows, strict=True)],
                                 [r.lay.max_entries[main.rate] for r in ranks])
        fulls = [g[r.entry_perm[main.rate]] for r, g in zip(ranks, gathered, strict=True)]
    return [r.attend_and_ffn(i, a, buf, idx, full)
            for r, a, (buf, idx, _), full in zip(ranks, ins, windows, fulls, strict=True)]


def v4_prefill_logits(model: DeepseekV4, ids: torch.Tensor, group: CPGroup, *,
                      page_size: int = 64, mode: SplitMode | str = SplitMode.ZIGZAG,
                      chunks: Sequence[int] | None = None,
                      carry: V4Carry | None = None, next_token: int | None = None
                      ) -> torch.Tensor:
    """Logits ``[T, vocab]`` float32 of prompt ``ids`` ``[T]``, computed context-parallel on
    ``group`` (every rank returns all of them): :func:`v4_prefill_batch` of one prompt.

    ``chunks``: prefill in pieces of these lengths (summing to T), each a batch of its own, the
    entries and the tail objects carried between them (:class:`V4Carry`); every piece but the
    last a multiple of the ownership unit. Any chunking equals the one-piece prefill.
    ``carry``: a fresh :class:`V4Carry` to fill (this rank's owned entries and, on the tail
    holder, the last segment's rows), kept for the decode state; or one with a ``layout`` (an
    earlier prefill of the request's first tokens, or a prefix rebuilt from the prefix cache):
    ``ids`` then continue after it, as the next chunk would. ``next_token``: with the MTP
    layer, the token after ``ids`` when they are not the prompt's end (a piece of a longer
    prompt; None: the target's argmax at the last row).

    Raises:
        ValueError: a sliding window wider than the ownership unit; chunks that do not sum to
            T or end off a unit boundary.
    """
    return v4_prefill_batch(model, [ids], group, page_size=page_size, mode=mode,
                            chunks=None if chunks is None else [chunks],
                            carries=None if carry is None else [carry],
                            next_tokens=[next_token])[0]


def v4_prefill_batch(model: DeepseekV4, prompts: Sequence[torch.Tensor], group: CPGroup, *,
                     page_size: int = 64, mode: SplitMode | str = SplitMode.ZIGZAG,
                     chunks: Sequence[Sequence[int] | None] | None = None,
                     carries: Sequence[V4Carry] | None = None,
                     next_tokens: Sequence[int | None] | None = None) -> list[torch.Tensor]:
    """Logits ``[T_j, vocab]`` float32 of each prompt ``ids`` ``[T_j]``, the prompts prefilled
    context-parallel as one batch: one plan, and per layer one halo collective and one
    full-view collective for all of them (every rank returns every prompt's logits). Each
    prompt's logits equal its prefill alone bit for bit (every row's math is independent of
    the rows beside it).

    ``chunks``: per prompt its piece lengths (None: one piece); step k prefills the k-th piece
    of every prompt that has one, as one batch, each prompt's entries and tail objects carried
    (:class:`V4Carry`); every piece but a prompt's last a multiple of the ownership unit.
    ``carries``: per prompt a :class:`V4Carry` that keeps, after the call, what this rank holds
    of it (its owned entries; on the tail holder the tail objects); one that already holds a
    prefix (its ``layout`` set: an earlier prefill, or a prefix-cache hit rebuilt) is continued
    after it; None: new ones.

    A model loaded with its MTP draft layer runs it after each piece (a sliding-only layer:
    its window rows are tail objects; its logits go to ``V4Carry.draft_logits``). Its row at a
    prompt's last position takes ``next_tokens[j]`` as the next token (a prompt continued by a
    later call: the first token of the rest), or the target's argmax there (None: the prompt
    ends).

    Raises:
        ValueError: a sliding window wider than the ownership unit; chunks that do not sum to
            their prompt's length or end off a unit boundary; not a carry per prompt.
    """
    pieces = []
    for j, ids in enumerate(prompts):
        sizes = list(chunks[j] or [ids.shape[0]]) if chunks is not None else [ids.shape[0]]
        if sum(sizes) != ids.shape[0] or min(sizes) < 1:
            raise ValueError(f"chunks {sizes} do not split a prompt of {ids.shape[0]} tokens")
        pieces.append(sizes)
    if carries is None:
        carries = [V4Carry() for _ in prompts]
    elif len(carries) != len(prompts):
        raise ValueError(f"{len(carries)} carries for {len(prompts)} prompts")
    # a carry that went through a prefill continues it (the next chunk, or a prefix-cache hit)
    lays: list[V4Layout | None] = [c.layout for c in carries]
    starts = [0] * len(prompts)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    for k in range(max(len(p) for p in pieces)):
        todo = [j for j, p in enumerate(pieces) if k < len(p)]
        new = v4_layouts(model, [pieces[j][k] for j in todo], group.size, page_size, mode,
                         [lays[j] for j in todo])
        ranks = []
        for j, lay in zip(todo, new, strict=True):
            lays[j] = lay
            carries[j].layout, carries[j].last_rows = lay, {}
            n = pieces[j][k]
            ranks.append(_Rank(model, prompts[j][starts[j]:starts[j] + n], group, lay,
                               carries[j]))
            starts[j] += n
        xs = [model.embed(r.ids) for r in ranks]
        for i in range(model.num_layers):
            xs = _layer(ranks, i, xs)
        maxes = [r.lay.max_rows for r in ranks]
        gathered = _gather_parts(group, [model.final_logits(x) for x in xs], maxes)
        for r, j, g in zip(ranks, todo, gathered, strict=True):
            out[j].append(g[r.row_perm])
        if model.mtp_layer is not None:
            after = [None] * len(prompts) if next_tokens is None else list(next_tokens)
            _draft_layer(model, ranks, xs, [prompts[j] for j in todo],
                         [starts[j] - pieces[j][k] for j in todo], [out[j][-1] for j in todo],
                         [after[j] for j in todo])
        for r, j in zip(ranks, todo, strict=True):
            carries[j].tail = r.next_tail  # the tail objects move to this piece's last rank
    return [torch.cat(o) for o in out]


def _draft_layer(model: DeepseekV4, ranks: list[_Rank], xs: list[torch.Tensor],
                 prompts: list[torch.Tensor], firsts: list[int], logits: list[torch.Tensor],
                 after: list[int | None]) -> None:
    """The MTP draft layer over a batch's piece (a sliding-only layer: one halo collective):
    row i from the target's streams and token i + 1 (the prompt's; after its last token
    ``after`` or, None, the target's argmax there); its gathered logits go to each request's
    carry."""
    assert model.mtp_layer is not None
    ins = []
    for r, x, ids, first, lg, nxt in zip(ranks, xs, prompts, firsts, logits, after, strict=True):
        end = (lg[-1:].argmax(-1) if nxt is None else torch.tensor([nxt]))
        ext = torch.cat([ids.to(r.pos.device), end.to(device=r.pos.device, dtype=ids.dtype)])
        nxt = ext[r.pos - r.lay.plan.prefix_len + first + 1]
        ins.append(model.draft_input(x, nxt))
    ys = _layer(ranks, model.mtp_layer, ins)
    got = _gather_parts(ranks[0].group, [model.draft_logits(y) for y in ys],
                        [r.lay.max_rows for r in ranks])
    for r, g in zip(ranks, got, strict=True):
        r.carry.draft_logits.append(g[r.row_perm])


def _cat(parts: list[torch.Tensor], dim: int, like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros((0, dim))


def _tail(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` rows (zero-padded at the front when fewer)."""
    if rows.shape[0] >= n:
        return rows[rows.shape[0] - n:]
    return torch.cat([rows.new_zeros((n - rows.shape[0], *rows.shape[1:])), rows])
