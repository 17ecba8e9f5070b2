"""Per-rank page allocation with host metadata replicated on every rank.

Every rank runs the same sequence of allocate/release calls (driven by the same plans), so every
rank knows every page's physical slot without communication, and every rank reaches the same
exhaustion decision at the same point: the error is raised alike everywhere, before any write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["PageAllocator", "PageRefs", "PoolExhausted", "drop_pages", "drop_refs", "hold_new"]


class PoolExhausted(RuntimeError):
    """Not enough free pages for a batch. Raised before anything is allocated or written."""


class PageAllocator:
    """Free lists of physical page slots, one per rank (or one for a replicated pool).

    Slots are handed out lowest first; released slots are reused.
    """

    def __init__(self, num_ranks: int, capacity: int) -> None:
        if num_ranks < 1 or capacity < 1:
            raise ValueError(f"need num_ranks >= 1 and capacity >= 1, got {num_ranks}, {capacity}")
        self.capacity = capacity
        self._free = [list(range(capacity - 1, -1, -1)) for _ in range(num_ranks)]

    @property
    def num_ranks(self) -> int:
        return len(self._free)

    def free_pages(self, rank: int) -> int:
        return len(self._free[rank])

    def used_pages(self, rank: int) -> int:
        return self.capacity - len(self._free[rank])

    def allocate(self, needs: Sequence[int], what: str = "batch") -> list[list[int]]:
        """Take ``needs[r]`` slots on every rank r, all or nothing.

        Raises:
            PoolExhausted: some rank lacks pages; nothing was taken on any rank.
        """
        if len(needs) != self.num_ranks:
            raise ValueError(f"needs has {len(needs)} entries for {self.num_ranks} ranks")
        short = [(r, n, len(self._free[r])) for r, n in enumerate(needs) if n > len(self._free[r])]
        if short:
            detail = ", ".join(f"rank {r} needs {n} pages, has {f} free" for r, n, f in short)
            raise PoolExhausted(f"KV pool exhausted for {what}: {detail} (capacity "
                                f"{self.capacity} pages per rank); nothing was allocated")
        return [[self._free[r].pop() for _ in range(n)] for r, n in enumerate(needs)]

    def take_slots(self, slots: Sequence[Sequence[int]], what: str = "batch") -> list[list[int]]:
        """Take exactly the slots ``slots[r]`` on every rank r (an engine's own allocation), all
        or nothing.

        Raises:
            ValueError: a slot out of range, not free, or given twice; nothing was taken.
        """
        if len(slots) != self.num_ranks:
            raise ValueError(f"slots has {len(slots)} entries for {self.num_ranks} ranks")
        for r, want in enumerate(slots):
            free = set(self._free[r])
            bad = [s for s in want if not 0 <= s < self.capacity or s not in free]
            if bad or len(set(want)) != len(want):
                why = (f"slots {bad[:8]} are out of range or not free" if bad
                       else "a slot is given twice")
                raise ValueError(f"{what}: rank {r}: {why} (capacity {self.capacity}); nothing "
                                 f"was allocated")
        for r, want in enumerate(slots):
            gone = set(want)
            self._free[r] = [s for s in self._free[r] if s not in gone]
        return [list(w) for w in slots]

    def release(self, rank: int, slots: Sequence[int]) -> None:
        """Return slots to rank's free list."""
        free = self._free[rank]
        free.extend(sorted(slots, reverse=True))
        if len(free) > self.capacity:
            raise AssertionError(f"rank {rank}: released more pages than it has ({len(free)} > "
                                 f"{self.capacity}): double free")

    def snapshot(self) -> tuple[tuple[int, ...], ...]:
        """The free lists, for tests that check a failed batch changed nothing."""
        return tuple(tuple(f) for f in self._free)


#: (allocation rank, slot) -> references held to that page
Refs = dict[tuple[int, int], int]


def hold_new(refs: Refs, slots: Sequence[Sequence[int]]) -> None:
    """One reference to each newly allocated slot (``slots[a]``: allocation rank a's)."""
    for a, got in enumerate(slots):
        for s in got:
            refs[(a, s)] = 1


def drop_refs(refs: Refs, keys: Iterable[tuple[int, int]], allocator: PageAllocator) -> int:
    """One reference less to each (allocation rank, slot); slots at zero go back to
    ``allocator``'s free lists. Returns how many did (the device pool and the host tier
    count their pages alike)."""
    return len(drop_pages(refs, keys, allocator))


def drop_pages(refs: Refs, keys: Iterable[tuple[int, int]], allocator: PageAllocator
               ) -> list[tuple[int, int]]:
    """:func:`drop_refs`, returning the (allocation rank, slot) of each page whose last
    reference went (now free), in the order they went."""
    freed: dict[int, list[int]] = {}
    order: list[tuple[int, int]] = []
    for key in keys:
        n = refs[key] - 1
        if n:
            refs[key] = n
        else:
            del refs[key]
            freed.setdefault(key[0], []).append(key[1])
            order.append(key)
    for a, slots in freed.items():
        allocator.release(a, slots)
    return order


class PageRefs:
    """Reference-counted pages over a :class:`PageAllocator`: a page is taken with one
    reference, shared by more, and back on the free list when the last one is dropped.

    ``reclaim`` is asked, with each allocation rank's need, to free pages when a take does not
    fit (the prefix cache evicts); it returns whether they are free now. Same on every rank.
    """

    def __init__(self, num_ranks: int, capacity: int) -> None:
        self.allocator = PageAllocator(num_ranks, capacity)
        self._refs: Refs = {}
        self.reclaim: Callable[[Sequence[int]], bool] | None = None

    def count(self, key: tuple[int, int]) -> int:
        """References to page ``key`` (allocation rank, slot); 0: free."""
        return self._refs.get(key, 0)

    def snapshot(self) -> dict[tuple[int, int], int]:
        """A copy of every held page's count."""
        return dict(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def take(self, needs: Sequence[int], what: str) -> list[list[int]]:
        """``needs[a]`` pages on each allocation rank ``a``, all or nothing, one reference each;
        the reclaimer is asked first when they do not fit.

        Raises:
            PoolExhausted: not enough free pages even then (nothing taken).
        """
        try:
            slots = self.allocator.allocate(needs, what=what)
        except PoolExhausted:
            if self.reclaim is None or not self.reclaim(needs):
                raise
            slots = self.allocator.allocate(needs, what=what)
        hold_new(self._refs, slots)
        return slots

    def take_given(self, slots: Sequence[Sequence[int]], what: str) -> list[list[int]]:
        """Exactly ``slots[a]`` on each allocation rank ``a`` (the caller's allocation), one
        reference each.

        Raises:
            ValueError: a slot out of range, held already, or given twice (nothing taken).
        """
        got = self.allocator.take_slots(slots, what=what)
        hold_new(self._refs, got)
        return got

    def retain(self, keys: Sequence[tuple[int, int]]) -> None:
        """One more reference to each page.

        Raises:
            ValueError: a page is not held (nothing was changed).
        """
        missing = [k for k in keys if k not in self._refs]
        if missing:
            raise ValueError(f"cannot share pages that are not held: {missing[:8]}")
        for k in keys:
            self._refs[k] += 1

    def drop(self, keys: Iterable[tuple[int, int]]) -> int:
        """One reference less to each page; returns how many went back to the free lists."""
        return drop_refs(self._refs, keys, self.allocator)

    def drop_pages(self, keys: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """One reference less to each page; returns the pages that went back to the free
        lists."""
        return drop_pages(self._refs, keys, self.allocator)

    def give_back(self, rank: int, slots: Sequence[int]) -> None:
        """Slots taken by :meth:`take` and never used: dropped (one reference each)."""
        self.drop((rank, s) for s in slots)
