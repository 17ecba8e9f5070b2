"""Per-rank page allocation with host metadata replicated on every rank.

Every rank runs the same sequence of allocate/release calls (driven by the same plans), so every
rank knows every page's physical slot without communication, and every rank reaches the same
exhaustion decision at the same point: the error is raised alike everywhere, before any write.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["PageAllocator", "PoolExhausted", "drop_refs", "hold_new"]


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
    freed: dict[int, list[int]] = {}
    for key in keys:
        n = refs[key] - 1
        if n:
            refs[key] = n
        else:
            del refs[key]
            freed.setdefault(key[0], []).append(key[1])
    for a, slots in freed.items():
        allocator.release(a, slots)
    return sum(len(v) for v in freed.values())
