"""A DeepSeek-V4 request's decode state and the pieces it is assembled from after a CP prefill.

Per layer (docs/models.md, "DeepSeek-V4 decode"):

* the **window ring**: the last ``W - 1`` K = V rows (positions ``L - W + 1 .. L - 1`` of a
  request of ``L`` tokens; rows before position 0 are zero and never read);
* per compressor (the main one on CSA / HCA layers, the indexer's on CSA layers): the
  **entries** so far (``L // m`` of them), the **open window**'s raw ``(kv, gate)`` projections
  (``L % m`` rows) and, on CSA's overlapping compressors, the **prior window**'s rows (the last
  complete window: its Ca half is the next entry's overlap; absent before the first entry).

After an owner-sharded prefill the entries lie on the ranks that computed them
(:class:`V4OwnedEntries`, one per rank) and the rest on the rank that computed the last token
(:class:`V4TailBundle`); :func:`assemble_v4_state` puts them together and checks that every entry
has exactly one owner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

__all__ = ["V4CompressorCarry", "V4CompressorState", "V4DecodeState", "V4LayerState",
           "V4OwnedEntries", "V4TailBundle", "V4TailLayer", "assemble_v4_state",
           "split_v4_state"]

#: the compressor names of a layer, in order (the main one, CSA's indexer)
COMPRESSOR_NAMES = ("main", "index")


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@dataclass
class V4CompressorCarry:
    """A compressor's carry state: the open window's raw rows and the prior window's."""

    rate: int
    entries: int  # complete entries so far (``length // rate``)
    open_kv: torch.Tensor  # [length % rate, w]
    open_gate: torch.Tensor  # [length % rate, w]
    prior_kv: torch.Tensor | None = None  # overlap: [rate, w] (None: no complete window yet)
    prior_gate: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.open_kv, self.open_gate, self.prior_kv, self.prior_gate)

    def equal(self, other: V4CompressorCarry) -> bool:
        """Bit-for-bit equality."""
        return (self.rate == other.rate and self.entries == other.entries
                and all(_same(getattr(self, k), getattr(other, k))
                        for k in ("open_kv", "open_gate", "prior_kv", "prior_gate")))


@dataclass
class V4CompressorState:
    """One compressor's entries ``[length // rate, d]`` and its carry state."""

    entries: torch.Tensor
    carry: V4CompressorCarry

    def equal(self, other: V4CompressorState) -> bool:
        return _same(self.entries, other.entries) and self.carry.equal(other.carry)


@dataclass
class V4LayerState:
    """One layer's window ring ``[W - 1, head_dim]`` and its compressors by name."""

    window: torch.Tensor
    compressors: dict[str, V4CompressorState] = field(default_factory=dict)

    def equal(self, other: V4LayerState) -> bool:
        return (_same(self.window, other.window)
                and self.compressors.keys() == other.compressors.keys()
                and all(c.equal(other.compressors[n]) for n, c in self.compressors.items()))


@dataclass
class V4DecodeState:
    """A request's decode state: ``length`` tokens so far and every layer's state."""

    length: int
    layers: list[V4LayerState]

    def equal(self, other: V4DecodeState) -> bool:
        """Bit-for-bit equality of every tensor (and the counts)."""
        return (self.length == other.length and len(self.layers) == len(other.layers)
                and all(a.equal(b) for a, b in zip(self.layers, other.layers, strict=True)))

    def fork(self) -> V4DecodeState:
        """A copy of the structure sharing the tensors: decode replaces a state's tensors and
        never writes into them, so the fork keeps this state as it is now (a snapshot at no
        copy cost)."""
        return V4DecodeState(length=self.length, layers=[
            V4LayerState(window=layer.window, compressors={
                n: V4CompressorState(entries=c.entries, carry=replace(c.carry))
                for n, c in layer.compressors.items()})
            for layer in self.layers])

    def check(self) -> None:
        """Raises ValueError where an entry count or an open window disagrees with ``length``."""
        for i, layer in enumerate(self.layers):
            for name, c in layer.compressors.items():
                m = c.carry.rate
                want = (self.length // m, self.length % m)
                got = (c.entries.shape[0], c.carry.open_kv.shape[0])
                if got != want or c.carry.entries != want[0]:
                    raise ValueError(f"layer {i} {name}: {got[0]} entries and {got[1]} open rows "
                                     f"(count {c.carry.entries}) for {self.length} tokens at "
                                     f"rate {m}: want {want}")


@dataclass
class V4TailLayer:
    """One layer's part of the tail bundle: the window ring and each compressor's carry."""

    window: torch.Tensor
    carry: dict[str, V4CompressorCarry] = field(default_factory=dict)


@dataclass
class V4TailBundle:
    """The tail objects of a request of ``length`` tokens, held by the rank that computed its
    last token: every layer's window ring and compressor carry state (with entry counts)."""

    length: int
    layers: list[V4TailLayer]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t.window) + sum(c.nbytes for c in t.carry.values())
                   for t in self.layers)


@dataclass
class V4OwnedEntries:
    """The compressed entries one rank owns: per ``(layer, name)`` the entry indices and the
    entries ``[n, d]`` in that order."""

    rank: int
    entries: dict[tuple[int, str], tuple[tuple[int, ...], torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for _, t in self.entries.values())


def assemble_v4_state(owned: Sequence[V4OwnedEntries], tail: V4TailBundle) -> V4DecodeState:
    """The decode state from every rank's owned entries and the tail bundle.

    Raises:
        ValueError: an entry owned twice or by nobody, a count that disagrees with the bundle.
    """
    layers = []
    for i, t in enumerate(tail.layers):
        comps = {}
        for name, carry in t.carry.items():
            parts = [(o.rank, *o.entries[(i, name)]) for o in owned if (i, name) in o.entries]
            seen = sorted(w for _, ids, _ in parts for w in ids)
            if seen != list(range(carry.entries)):
                raise ValueError(f"layer {i} {name}: entries {seen} from ranks "
                                 f"{[r for r, _, _ in parts]}; want each of 0..{carry.entries - 1}"
                                 f" exactly once")
            like = next(x for _, _, x in parts) if parts else None
            d = like.shape[1] if like is not None else carry.open_kv.shape[1]
            dt = like.dtype if like is not None else carry.open_kv.dtype
            out = torch.empty((carry.entries, d), dtype=dt, device=carry.open_kv.device)
            for _, ids, x in parts:
                if ids:
                    out[torch.tensor(ids, dtype=torch.long, device=out.device)] = x.to(out.device)
            comps[name] = V4CompressorState(entries=out, carry=carry)
        layers.append(V4LayerState(window=t.window, compressors=comps))
    state = V4DecodeState(length=tail.length, layers=layers)
    state.check()
    return state


def split_v4_state(state: V4DecodeState, owners: Mapping[int, Sequence[Sequence[int]]]
                   ) -> tuple[list[V4OwnedEntries], V4TailBundle]:
    """The inverse of :func:`assemble_v4_state`: ``owners[rate][rank]`` the entries a rank owns."""
    size = len(next(iter(owners.values()))) if owners else 1
    owned = [V4OwnedEntries(rank=r, entries={}) for r in range(size)]
    for i, layer in enumerate(state.layers):
        for name, c in layer.compressors.items():
            for r, ids in enumerate(owners[c.carry.rate]):
                sel = torch.tensor(list(ids), dtype=torch.long, device=c.entries.device)
                owned[r].entries[(i, name)] = (tuple(ids), c.entries[sel])
    tail = V4TailBundle(length=state.length, layers=[
        V4TailLayer(window=layer.window,
                    carry={n: c.carry for n, c in layer.compressors.items()})
        for layer in state.layers])
    return owned, tail
