"""DeepSeek-V4 prefill through the prefix cache (:mod:`cpkv.cache.v4_prefix`; contract rule 38).

A request's hit is served from its snapshot boundary B: the state at B is rebuilt from the
cached units and the snapshot, and only tokens ``[B, L)`` are computed, in pieces cut at the
request's snapshot points (every ``interval`` tokens, and its last unit boundary) and its
chunks; after each piece that ends on a snapshot point the tail objects there are kept; at the
end the request's units and snapshots go into the cache.

* :func:`v4_serve`: one rank, the lean step (:func:`~cpkv.runtime.v4_decode.v4_extend`) from
  the rebuilt :class:`~cpkv.kv.v4_state.V4DecodeState`;
* :func:`v4_prefill_cached`: context parallel (:func:`~cpkv.runtime.v4_prefill.v4_prefill_logits`
  continuing from a :class:`~cpkv.runtime.v4_prefill.V4Carry` rebuilt from the cache: each rank
  its own units, the snapshot's holder the packed halo row). :func:`plan_cached` is its
  host-side plan, which a decode rank computes too (the same tree, no tensors).

The rows after B equal a prefill without the cache bit for bit on the torch path, in one piece
or cut at :attr:`V4Served.cuts` (each row's math is independent of the rows beside it: rule 37).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cpkv.cache.v4_prefix import V4Hit, V4PrefixCache, V4Snapshot, V4Unit, copy_tail
from cpkv.comm import CPGroup
from cpkv.contracts import RequestPlan, Segment, SplitMode
from cpkv.kv.v4_state import COMPRESSOR_NAMES, V4DecodeState, V4TailBundle, V4TailLayer
from cpkv.models.deepseek_v4 import DeepseekV4

from .v4_decode import v4_empty_state, v4_extend_all
from .v4_prefill import V4Carry, V4Layout, v4_layout, v4_prefill_logits
from .v4_state import tail_bundle

__all__ = ["V4CachePlan", "V4Served", "insert_metadata", "plan_cached", "prefix_layout",
           "v4_prefill_cached", "v4_serve"]


@dataclass
class V4Served:
    """One request served through the cache: the logits of tokens ``[boundary, L)``, the hit,
    the piece boundaries its state went through (before B: the snapshot's; then B; then this
    request's), and its state at the end (one rank)."""

    logits: torch.Tensor
    hit: V4Hit
    cuts: tuple[int, ...]
    state: V4DecodeState | None = None


def _pieces(start: int, end: int, points: Sequence[int], chunk: int) -> list[int]:
    """The ends of the pieces of ``[start, end)``: the snapshot points, every ``chunk`` tokens
    after ``start`` (0: none) and ``end``."""
    ends = set(points) | {end}
    if chunk:
        ends.update(range(start + chunk, end, chunk))
    return sorted(e for e in ends if start < e <= end)


def _names(model: DeepseekV4, layer: int) -> list[tuple[str, int]]:
    return [(n, c.rate) for n, c in zip(COMPRESSOR_NAMES, model.compressors(layer), strict=True)
            if c is not None]


def _tail_of(state: V4DecodeState) -> V4TailBundle:
    return copy_tail(V4TailBundle(length=state.length, layers=[
        V4TailLayer(window=layer.window, carry={n: c.carry for n, c in layer.compressors.items()})
        for layer in state.layers]))


def v4_serve(model: DeepseekV4, cache: V4PrefixCache, ids: torch.Tensor,
             chunk: int = 0) -> V4Served:
    """Serve prompt ``ids`` ``[L]`` on one rank through ``cache`` (rank 0, holding everything):
    the logits of ``[B, L)`` and the state at ``L`` (to decode from)."""
    tokens = [int(t) for t in ids.tolist()]
    hit = cache.match(tokens)
    cache.use(hit, tokens)
    b, length, u = hit.boundary, len(tokens), cache.unit
    state = cache.state(hit) if b else v4_empty_state(model)
    points = cache.snapshot_points(b, length)
    cuts, out, snaps, prev = list(hit.cuts), [], [], b
    for end in _pieces(b, length, points, chunk):
        out.append(v4_extend_all(model, state, ids[prev:end],
                                 tokens[end] if end < length else None))
        if end in points:
            snaps.append(V4Snapshot(boundary=end, holder=cache.rank, cuts=tuple(cuts),
                                    tail=_tail_of(state)))
        if end < length:
            cuts.append(end)
        prev = end
    units: dict[int, V4Unit] = {}
    for k in range(length // u):
        units[k] = {(i, n): st.entries[k * u // st.carry.rate:(k + 1) * u // st.carry.rate].clone()
                    for i, layer in enumerate(state.layers)
                    for n, st in layer.compressors.items()}
    cache.insert(tokens, [cache.rank] * -(-length // u), units, snaps)
    return V4Served(logits=torch.cat(out), hit=hit, cuts=tuple(cuts), state=state)


# ---- context parallel ----------------------------------------------------------------------------
def prefix_layout(model: DeepseekV4, boundary: int, unit_owners: Sequence[int], cp_size: int,
                  page_size: int) -> V4Layout:
    """The layout of a cached prefix of ``boundary`` tokens whose unit k is owned by
    ``unit_owners[k]``, as the layout of a chunk ending at the boundary (what the next chunk's
    :func:`~cpkv.runtime.v4_prefill.v4_layout` reads: the owners, the tail holder, the entries
    each rank owns)."""
    u = model.config.ownership_unit(page_size)
    segs: list[Segment] = []
    for k, r in enumerate(unit_owners):
        if segs and segs[-1].rank == r:
            segs[-1] = Segment(segs[-1].start, (k + 1) * u, r)
        else:
            segs.append(Segment(k * u, (k + 1) * u, r))
    plan = RequestPlan(prefix_len=0, extend_len=boundary, segments=tuple(segs), page_aligned=True,
                       page_owners=tuple(unit_owners[p * page_size // u]
                                         for p in range(boundary // page_size)))
    entries = {m: tuple(tuple(w for k, o in enumerate(unit_owners) if o == r
                              for w in range(k * u // m, (k + 1) * u // m))
                        for r in range(cp_size)) for m in model.config.rates}
    return V4Layout(plan=plan, unit=u, segments=((),) * cp_size, halo_src=((),) * cp_size,
                    max_segments=1, entries=entries,
                    max_entries={m: max(1, *(len(x) for x in e)) for m, e in entries.items()},
                    entry_perm={}, max_rows=0, row_perm=(), carry_rank=-1)


@dataclass
class V4CachePlan:
    """A request's host-side plan through the cache (equal on every rank): the hit, the piece
    ends, each piece's layout, the snapshot points and every unit's owner."""

    hit: V4Hit
    ends: list[int]
    layouts: list[V4Layout]
    points: list[int]
    owners: list[int] = field(default_factory=list)

    @property
    def layout(self) -> V4Layout:
        return self.layouts[-1]


def plan_cached(model: DeepseekV4, cache: V4PrefixCache, tokens: Sequence[int], cp_size: int,
                page_size: int, mode: SplitMode | str, chunk: int = 0) -> V4CachePlan:
    """Match ``tokens`` (counting the hit) and plan the pieces after its boundary."""
    hit = cache.match(tokens)
    cache.use(hit, tokens)
    b, length, u = hit.boundary, len(tokens), cache.unit
    owners = [o for o, _ in hit.units]
    lay = prefix_layout(model, b, owners, cp_size, page_size) if b else None
    points = cache.snapshot_points(b, length)
    ends, layouts, prev = _pieces(b, length, points, chunk), [], b
    for end in ends:
        lay = v4_layout(model, end - prev, cp_size, page_size, mode, prefix=lay)
        layouts.append(lay)
        for k in range(prev // u, -(-end // u)):
            if k >= len(owners):
                p = lay.plan.page_owners[k * u // page_size]
                assert p is not None
                owners.append(p)
        prev = end
    return V4CachePlan(hit=hit, ends=ends, layouts=layouts, points=points, owners=owners)


def _restore(model: DeepseekV4, cache: V4PrefixCache, plan: V4CachePlan, rank: int,
             page_size: int, cp_size: int) -> V4Carry:
    """This rank's carry at the hit's boundary: its units' entries, and on the snapshot's holder
    the packed halo row of every layer (the window ring, then per overlapping compressor the
    prior window's kv and gate rows: :class:`~cpkv.runtime.v4_prefill.V4Carry`)."""
    hit = plan.hit
    if not hit.boundary:
        return V4Carry()
    assert hit.snapshot is not None
    carry = V4Carry(layout=prefix_layout(model, hit.boundary, [o for o, _ in hit.units], cp_size,
                                         page_size))
    assert carry.layout is not None and carry.layout.tail_rank == hit.snapshot.holder
    for i in range(model.num_layers):
        for name, _ in _names(model, i):
            got = cache.owned(hit, (i, name))
            if got is not None:
                carry.owned[(i, name)] = got.clone()
    tail = hit.snapshot.tail
    if rank == hit.snapshot.holder:
        assert tail is not None
        for i, t in enumerate(tail.layers):
            parts = [t.window.reshape(-1)]
            for name, comp in zip(COMPRESSOR_NAMES, model.compressors(i), strict=True):
                if comp is not None and comp.overlap:
                    c = t.carry[name]
                    assert c.prior_kv is not None and c.prior_gate is not None
                    parts += [c.prior_kv.reshape(-1), c.prior_gate.reshape(-1)]
            carry.tail[i] = torch.cat(parts)
    return carry


def _owned_units(model: DeepseekV4, carry: V4Carry, rank: int, owners: Sequence[int],
                 length: int, unit: int) -> dict[int, V4Unit]:
    """This rank's complete units, cut out of the entries it owns after the prefill."""
    lay = carry.layout
    assert lay is not None
    out: dict[int, V4Unit] = {k: {} for k in range(length // unit) if owners[k] == rank}
    for i in range(model.num_layers):
        for name, m in _names(model, i):
            row = {w: j for j, w in enumerate(lay.entries[m][rank])}
            mine = carry.owned.get((i, name))
            for k, unit_entries in out.items():
                sel = [row[w] for w in range(k * unit // m, (k + 1) * unit // m)]
                assert mine is not None
                unit_entries[(i, name)] = mine[torch.tensor(sel, dtype=torch.long,
                                                            device=mine.device)]
    return out


def v4_prefill_cached(model: DeepseekV4, ids: torch.Tensor, group: CPGroup,
                      cache: V4PrefixCache, *, page_size: int = 64,
                      mode: SplitMode | str = SplitMode.ZIGZAG, chunk: int = 0
                      ) -> tuple[torch.Tensor, V4CachePlan, V4Carry]:
    """CP prefill of ``ids`` ``[L]`` through ``cache`` (every rank of ``group`` holds one, fed
    the same calls): ``(logits of [B, L), the plan, this rank's carry)``; the carry gives the
    decode state's parts (:func:`~cpkv.runtime.v4_state.owned_entries`,
    :func:`~cpkv.runtime.v4_state.tail_bundle`)."""
    tokens = [int(t) for t in ids.tolist()]
    plan = plan_cached(model, cache, tokens, group.size, page_size, mode, chunk)
    carry = _restore(model, cache, plan, group.rank, page_size, group.size)
    cuts, out, snaps, prev = list(plan.hit.cuts), [], [], plan.hit.boundary
    for end in plan.ends:
        out.append(v4_prefill_logits(model, ids[prev:end], group, page_size=page_size, mode=mode,
                                     carry=carry,
                                     next_token=tokens[end] if end < len(tokens) else None))
        if end in plan.points:
            assert carry.layout is not None
            holder = carry.layout.tail_rank
            snaps.append(V4Snapshot(boundary=end, holder=holder, cuts=tuple(cuts),
                                    tail=tail_bundle(model, carry) if group.rank == holder
                                    else None))
        if end < len(tokens):
            cuts.append(end)
        prev = end
    units = _owned_units(model, carry, group.rank, plan.owners, len(tokens), cache.unit)
    cache.insert(tokens, plan.owners, units, snaps)
    return torch.cat(out), plan, carry


def insert_metadata(cache: V4PrefixCache, tokens: Sequence[int], plan: V4CachePlan) -> None:
    """What a rank that holds none of the request's pieces (a decode rank) inserts: the same
    tree and snapshot metadata as the prefill ranks."""
    cuts, snaps = list(plan.hit.cuts), []
    for end, lay in zip(plan.ends, plan.layouts, strict=True):
        if end in plan.points:
            snaps.append(V4Snapshot(boundary=end, holder=lay.tail_rank, cuts=tuple(cuts)))
        if end < len(tokens):
            cuts.append(end)
    cache.insert(tokens, plan.owners, {}, snaps)
