"""Per-layer page work that must precede a layer's first read or write of a batch.

Two kinds, both on the page's owner: host pages loaded back into their new device slots (the
prefix cache's host tier), then shared tail pages copied before the batch writes into them (copy
on write; a copied page may itself have just been loaded, hence the order). A
:class:`PageStage` does a layer's work once: ahead of time on the pool's side stream
(:meth:`issue`, from the pool's ``prefetch``, so the copies overlap the previous layer's
compute) or inline on the current stream (:meth:`ready`, from ``write`` and ``materialize``,
which also make the current stream wait for work issued ahead). On CPU everything is inline.

Host pages being read hold a reference until the stage is :meth:`finish`\\ ed (commit, abort or a
flush), so no save reuses a host slot before its load has read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .host import HostPages

if TYPE_CHECKING:
    from cpkv.ops import OpTable

__all__ = ["PageLoad", "PageStage"]


@dataclass(frozen=True)
class PageLoad:
    """Host pages to load back into device slots (bookkeeping of every rank; bytes move only on
    the owner). ``pages``: (owner rank, host slot, device slot) per page; the load holds one
    reference to each host page until it is finished."""

    host: HostPages
    pages: tuple[tuple[int, int, int], ...]


class PageStage:
    """One batch's per-layer page work on this rank (see the module docstring).

    Args:
        regions: the pool's storage, per layer its page regions (uint8 [pages, bytes] views,
            ``KVStore.regions``).
        loads: host pages to load back; the stage releases their host references when finished.
        copies: (source slot, destination slot) of this rank's copies on write.
        alloc_rank: whose allocation rank a page of an owner rank is (the pool's).
        me: this rank's allocation rank (a page is stored here when its owner maps to it).
        ops: the op table.
        device: the pool's device.
        side: the pool's side stream (None on CPU).
    """

    def __init__(self, regions: Sequence[tuple[torch.Tensor, ...]], loads: Sequence[PageLoad],
                 copies: Sequence[tuple[int, int]], alloc_rank: Callable[[int], int], me: int,
                 ops: OpTable, device: torch.device, side: torch.cuda.Stream | None) -> None:
        self.regions, self.ops, self.device, self.side = regions, ops, device, side
        self.loads = list(loads)
        self._alloc_rank = alloc_rank
        #: per load: this rank's host slots and their device slots (index tensors, once)
        self._mine: list[tuple[HostPages, torch.Tensor, torch.Tensor]] = []
        for load in self.loads:
            own = [(h, d) for o, h, d in load.pages if alloc_rank(o) == me]
            if own:
                self._mine.append((load.host, load.host.index([h for h, _ in own]),
                                   load.host.index([d for _, d in own])))
        self._copy: tuple[torch.Tensor, torch.Tensor] | None = None
        if copies:
            src = torch.tensor([s for s, _ in copies], dtype=torch.int64).to(device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.int64).to(device)
            self._copy = (src, dst)
        self._done: set[int] = set()
        self._events: dict[int, torch.cuda.Event] = {}
        self._finished = False

    @property
    def empty(self) -> bool:
        """Nothing to do on this rank and no host references to give back."""
        return not self.loads and self._copy is None

    @property
    def pages_loaded(self) -> int:
        """Host pages this stage loads back (every rank's count: the bookkeeping's)."""
        return sum(len(load.pages) for load in self.loads)

    def _run(self, layer: int) -> None:
        regions = self.regions[layer]
        for host, src, dst in self._mine:
            host.load(layer, regions, src, dst, self.ops)
        if self._copy is not None:
            src, dst = self._copy
            for buf in regions:
                self.ops.page_copy(buf, dst, buf, src)

    def issue(self, layer: int) -> None:
        """Start ``layer``'s work on the side stream (inline on CPU), once."""
        if layer in self._done or self.empty:
            return
        self._done.add(layer)
        if self.side is None:
            self._run(layer)
            return
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.side):
            self.side.wait_stream(main)  # earlier users of the slots are done with them
            for _, src, dst in self._mine:
                src.record_stream(self.side)
                dst.record_stream(self.side)
            if self._copy is not None:
                for t in self._copy:
                    t.record_stream(self.side)
            self._run(layer)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self.side)
        self._events[layer] = ev

    def ready(self, layer: int) -> None:
        """``layer``'s work is done before anything queued next on the current stream."""
        if self.empty:
            return
        if layer not in self._done:
            self._done.add(layer)
            self._run(layer)  # inline, on the current stream
            return
        ev = self._events.get(layer)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def finish(self) -> None:
        """Every layer's work done (ordered before what the current stream does next); the host
        pages read are released. Idempotent."""
        if self._finished:
            return
        for layer in range(len(self.regions)):
            self.ready(layer)
        self._finished = True
        for load in self.loads:
            load.host.release((self._alloc_rank(o), h) for o, h, _ in load.pages)
