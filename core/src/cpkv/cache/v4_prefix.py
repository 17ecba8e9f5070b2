"""The DeepSeek-V4 prefix cache: token-valid hits, served from the last snapshot boundary at or
before them (contract rule 38; docs/cache.md, "DeepSeek-V4: snapshots").

A V4 request's state is its compressed entries (page-owned, prefix-addressable: entry w of rate
m depends only on tokens ``[0, (w + 1) m)``) and its tail objects (the window rows and each
compressor's carry state), which exist only at the request's current length. So:

* the **radix tree** (:class:`~cpkv.cache.radix.RadixTree`, its pages being ownership units of
  ``u`` tokens) holds every cached token sequence; a node's page reference ``(owner rank, slot)``
  names one unit's entries (every layer and compressor), stored once per prefix on the owner;
* a **snapshot** at boundary ``B`` (a unit boundary: no window is open at any rate) holds the
  tail objects at ``B`` (:class:`~cpkv.kv.v4_state.V4TailBundle`: the last ``W - 1`` window rows
  of every layer and each compressor's carry) on the rank that computed token ``B - 1`` (the
  owner of the unit ending at ``B``). It is keyed by that unit's reference and dropped with the
  node that holds the unit up to ``B``;
* a **hit** is the longest cached prefix in tokens (capped at ``len - 1``: the last token is
  always computed) and its **boundary** the last snapshot at or before it; units ``0 .. B/u - 1``
  and the snapshot rebuild the state at ``B`` and the tokens after ``B`` are recomputed.

Snapshots are taken sparsely (:meth:`V4PrefixCache.snapshot_points`): every ``interval`` tokens
(a multiple of the unit) and at a request's end (its last unit boundary). Every rank of a CP group
(and a decode rank) holds the same tree, fed the same calls: the metadata agrees everywhere and
each rank stores only the units it owns and the snapshots it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from cpkv.kv.v4_state import (
    V4DecodeState,
    V4OwnedEntries,
    V4TailBundle,
    V4TailLayer,
    assemble_v4_state,
)

from .radix import PageRef, RadixTree

__all__ = ["V4CacheStats", "V4Hit", "V4PrefixCache", "V4Snapshot", "V4Unit", "copy_tail"]

#: one unit's entries: per ``(layer, compressor name)`` the ``u // m`` entries ``[u // m, d]``
V4Unit = dict[tuple[int, str], torch.Tensor]


@dataclass(frozen=True)
class V4Snapshot:
    """The tail objects of a prefix of ``boundary`` tokens.

    Attributes:
        boundary: B, a multiple of the ownership unit.
        holder: the rank holding ``tail`` (the owner of the unit ending at B).
        cuts: the piece boundaries (``0 < c < B``) the state at B was computed through: a
            prefill without the cache cut at these and at B computes the same bits.
        tail: the window rows and carry state at B (on the holder; None elsewhere).
    """

    boundary: int
    holder: int
    cuts: tuple[int, ...]
    tail: V4TailBundle | None = None


@dataclass(frozen=True)
class V4Hit:
    """A request's hit: ``hit_tokens`` matched (token-valid, may end inside a window) and the
    snapshot it is served from (``boundary`` 0 and no snapshot: recompute from the start)."""

    hit_tokens: int
    boundary: int
    #: the units ``0 .. boundary // u - 1`` (owner rank, slot)
    units: tuple[PageRef, ...] = ()
    snapshot: V4Snapshot | None = None

    @property
    def cuts(self) -> tuple[int, ...]:
        """The piece boundaries before ``boundary`` (and ``boundary`` itself when > 0)."""
        if self.snapshot is None:
            return ()
        return (*self.snapshot.cuts, self.boundary)


@dataclass
class V4CacheStats:
    hits: int = 0
    hit_tokens: int = 0
    reused_tokens: int = 0  # the boundaries served from
    recomputed_tokens: int = 0  # hit tokens past the boundary, computed again
    snapshots: int = 0
    units_stored: int = 0
    evicted_nodes: int = 0
    units_freed: int = 0
    snapshots_dropped: int = 0


@dataclass
class _Slots:
    """Unit slots of one owner: reference counts and (on the owner) the entries."""

    next: int = 0
    refs: dict[int, int] = field(default_factory=dict)
    data: dict[int, V4Unit] = field(default_factory=dict)


class V4PrefixCache:
    """One rank's V4 prefix cache (see the module docstring).

    Args:
        unit: the ownership unit in tokens (:meth:`DeepseekV4Config.ownership_unit`).
        rank: this rank (units and snapshots of other ranks are metadata only here).
        interval: snapshot every this many tokens (rounded up to a multiple of ``unit``;
            0: only at request ends).
    """

    def __init__(self, unit: int, rank: int = 0, interval: int = 0) -> None:
        if unit < 1 or interval < 0:
            raise ValueError(f"unit={unit}, interval={interval}: want unit >= 1, interval >= 0")
        self.unit, self.rank = unit, rank
        self.interval = -(-interval // unit) * unit
        self.tree = RadixTree(unit)
        self.stats = V4CacheStats()
        self._slots: dict[int, _Slots] = {}
        self._snaps: dict[PageRef, V4Snapshot] = {}

    # ---- where snapshots go --------------------------------------------------------------------
    def snapshot_points(self, start: int, end: int, final: bool = True) -> list[int]:
        """The snapshot boundaries in ``(start, end]`` of a request computing tokens
        ``[start, end)``: the multiples of the interval and, when ``final`` (the request ends
        at ``end``), its last unit boundary."""
        out: set[int] = set()
        if self.interval:
            out.update(range((start // self.interval + 1) * self.interval, end + 1,
                             self.interval))
        if final:
            last = end // self.unit * self.unit
            if last > start:
                out.add(last)
        return sorted(out)

    # ---- lookup ----------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> V4Hit:
        """The hit of ``tokens`` and the last snapshot at or before it."""
        m = self.tree.match(tokens, limit=len(tokens) - 1)
        h = m.hit_tokens
        for k in range(h // self.unit, 0, -1):
            snap = self._snaps.get(m.pages[k - 1])
            if snap is not None and snap.boundary == k * self.unit:
                return V4Hit(hit_tokens=h, boundary=k * self.unit, units=m.pages[:k],
                             snapshot=snap)
        return V4Hit(hit_tokens=h, boundary=0)

    def use(self, hit: V4Hit, tokens: Sequence[int]) -> None:
        """Count ``hit`` and mark its path used now (least recently used goes first)."""
        m = self.tree.match(tokens, limit=hit.hit_tokens)
        self.tree.touch(m)
        s = self.stats
        s.hits += hit.hit_tokens > 0
        s.hit_tokens += hit.hit_tokens
        s.reused_tokens += hit.boundary
        s.recomputed_tokens += hit.hit_tokens - hit.boundary

    def owned(self, hit: V4Hit, key: tuple[int, str]) -> torch.Tensor | None:
        """This rank's entries of ``key`` in the hit's units, in unit order (None: it owns none)."""
        parts = [self._slots[o].data[s][key] for o, s in hit.units if o == self.rank]
        return torch.cat(parts) if parts else None

    def state(self, hit: V4Hit) -> V4DecodeState:
        """The decode state at the hit's boundary, on one rank that holds every unit and the
        snapshot (copies: extending it leaves the cache alone).

        Raises:
            ValueError: no snapshot, or a unit or the snapshot held elsewhere.
        """
        snap = hit.snapshot
        if snap is None or snap.tail is None or any(o != self.rank for o, _ in hit.units):
            raise ValueError(f"the state at {hit.boundary} is not all on rank {self.rank}")
        entries = {}
        for i, layer in enumerate(snap.tail.layers):
            for name in layer.carry:
                got = self.owned(hit, (i, name))
                assert got is not None
                entries[(i, name)] = (tuple(range(got.shape[0])), got.clone())
        return assemble_v4_state([V4OwnedEntries(rank=self.rank, entries=entries)],
                                 copy_tail(snap.tail))

    # ---- insertion -----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], owners: Sequence[int], units: Mapping[int, V4Unit],
               snapshots: Sequence[V4Snapshot]) -> None:
        """Cache a request's ``tokens``: ``owners[k]`` the owner rank of unit k (every unit,
        the last one possibly partial), ``units[k]`` the entries of the complete units this
        rank owns, ``snapshots`` taken during its prefill (tails on their holder only). Units
        the tree already holds keep the tree's; a snapshot at a boundary that already has one
        keeps the old.

        Raises:
            ValueError: an owner per unit missing.
        """
        u = self.unit
        n = -(-len(tokens) // u)
        if len(owners) != n:
            raise ValueError(f"{len(tokens)} tokens span {n} units of {u}; got {len(owners)} "
                             f"owners")
        refs: list[PageRef] = []
        for o in owners:
            slots = self._slots.setdefault(o, _Slots())
            refs.append((o, slots.next))
            slots.next += 1
        added = self.tree.insert(tokens, refs)
        for o, s in added.device:
            slots = self._slots[o]
            slots.refs[s] = slots.refs.get(s, 0) + 1
        kept = {r for r in refs if r[1] in self._slots[r[0]].refs}
        for k, r in enumerate(refs):
            if r in kept and r[0] == self.rank and (k + 1) * u <= len(tokens) and k in units:
                self._slots[r[0]].data[r[1]] = units[k]
                self.stats.units_stored += 1
        for snap in snapshots:
            m = self.tree.match(tokens, limit=snap.boundary)
            key = m.pages[snap.boundary // u - 1]
            if key not in self._snaps:
                self._snaps[key] = snap if snap.holder == self.rank else V4Snapshot(
                    boundary=snap.boundary, holder=snap.holder, cuts=snap.cuts)
                self.stats.snapshots += 1

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, nodes: int) -> int:
        """Evict up to ``nodes`` least recently used leaves with their snapshots; returns the
        units freed (their last reference gone)."""
        freed = 0
        for _ in range(nodes):
            node = self.tree.lru(on_host=False)
            if node is None:
                break
            for n in self.tree.remove(node):
                self.stats.evicted_nodes += 1
                for ref in n.pages.values():
                    snap = self._snaps.get(ref)
                    if snap is not None and n.start < snap.boundary <= n.end:
                        del self._snaps[ref]
                        self.stats.snapshots_dropped += 1
                    freed += self._release(ref)
        self.stats.units_freed += freed
        return freed

    def _release(self, ref: PageRef) -> int:
        slots = self._slots[ref[0]]
        slots.refs[ref[1]] -= 1
        if slots.refs[ref[1]]:
            return 0
        del slots.refs[ref[1]]
        slots.data.pop(ref[1], None)
        self._snaps.pop(ref, None)
        return 1

    # ---- accounting ----------------------------------------------------------------------------
    def units_held(self) -> int:
        """Distinct units the tree references (every owner)."""
        return sum(len(s.refs) for s in self._slots.values())

    def snapshot_boundaries(self) -> list[int]:
        return sorted(s.boundary for s in self._snaps.values())

    def nbytes(self) -> int:
        """Bytes this rank stores: its units' entries and the snapshots it holds."""
        units = sum(t.numel() * t.element_size() for s in self._slots.values()
                    for unit in s.data.values() for t in unit.values())
        return units + sum(s.tail.nbytes for s in self._snaps.values() if s.tail is not None)

    def signature(self) -> str:
        """The tree and the snapshots' metadata as text (equal on every rank fed the same
        calls)."""
        snaps = sorted((r, s.boundary, s.holder, s.cuts) for r, s in self._snaps.items())
        return f"{self.tree.signature()}\n{snaps}"


def copy_tail(tail: V4TailBundle) -> V4TailBundle:
    """A deep copy of a tail bundle (the decode step replaces the carry's tensors in place of
    the objects it is given)."""
    return V4TailBundle(length=tail.length, layers=[
        V4TailLayer(window=t.window.clone(),
                    carry={n: replace(c, open_kv=c.open_kv.clone(), open_gate=c.open_gate.clone(),
                                      prior_kv=None if c.prior_kv is None else c.prior_kv.clone(),
                                      prior_gate=None if c.prior_gate is None
                                      else c.prior_gate.clone())
                           for n, c in t.carry.items()})
        for t in tail.layers])
