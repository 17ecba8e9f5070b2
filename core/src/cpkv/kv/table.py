"""The host-side page table of a pool (rules 10-12): pure Python, no tensors, no device.

Per request a logical page table (page k -> owner rank, physical slot on the owner), per page a
reference count (the requests whose tables hold it plus outside holders such as the prefix
cache), the free lists, and the reclaim hook asked to evict when a reservation does not fit.
Every rank runs the same calls in the same order, so every rank's table is the same.

A batch is reserved in one step (:meth:`PageTable.reserve`): the plan is checked against the
tables, the pages it needs (new pages, copies of shared tail pages it writes into) are taken all
or nothing, and the tables are updated; :meth:`PageTable.commit` or :meth:`PageTable.abort`
ends it. Bytes are the :class:`~cpkv.kv.store.KVStore`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType

from cpkv.contracts import CPPlan, RequestPlan, RequestSpec, cdiv

from .allocator import PageAllocator, PageRefs
from .pages import PageKey, RequestPages, Reservation

__all__ = ["PageTable", "RequestPages", "Reservation"]

class PageTable:
    """Request page tables, reference counts and free lists of one pool (every rank's alike).

    Args:
        page_size: tokens per page.
        num_ranks: allocation ranks (the CP size of a sharded pool; 1 for a replica, whose one
            free list serves every owner).
        capacity: pages per allocation rank.
    """

    def __init__(self, page_size: int, num_ranks: int, capacity: int, *, shared: bool = True
                 ) -> None:
        self.page_size, self.shared = page_size, shared
        self._requests: dict[Hashable, RequestPages] = {}
        #: every held page's references: the requests' tables and outside holders
        self._refs = PageRefs(num_ranks if shared else 1, capacity)

    @property
    def allocator(self) -> PageAllocator:
        """The free lists (read them; pages are taken and given back through the table)."""
        return self._refs.allocator

    @property
    def reclaim(self) -> Callable[[Sequence[int]], bool] | None:
        """Asked with each allocation rank's need when pages do not fit (the prefix cache
        evicts); returns whether they are free now. Same on every rank."""
        return self._refs.reclaim

    @reclaim.setter
    def reclaim(self, hook: Callable[[Sequence[int]], bool] | None) -> None:
        self._refs.reclaim = hook

    # ---- reading -------------------------------------------------------------------------------
    @property
    def requests(self) -> Mapping[Hashable, RequestPages]:
        """Every request's page table (read-only mapping; change it through the methods)."""
        return MappingProxyType(self._requests)

    def alloc_rank(self, owner: int) -> int:
        """Whose free list a page of ``owner`` comes from (the one list of a replica)."""
        return owner if self.shared else 0

    def key(self, owner: int, slot: int) -> PageKey:
        """The (allocation rank, slot) key of the page at ``slot`` on ``owner``."""
        return self.alloc_rank(owner), slot

    def refcount(self, owner: int, slot: int) -> int:
        """References to the page at ``slot`` on ``owner`` (0: free)."""
        return self._refs.count(self.key(owner, slot))

    def references(self) -> dict[PageKey, int]:
        """A copy of every held page's reference count, by (allocation rank, slot)."""
        return self._refs.snapshot()

    def logical_pages(self) -> int:
        """Distinct pages held (shared pages once)."""
        return len(self._refs)

    def request_spec(self, rid: Hashable, extend_len: int) -> RequestSpec:
        """Planner input for extending ``rid`` by ``extend_len`` tokens after what it holds."""
        rp = self._requests.get(rid)
        if rp is None:
            return RequestSpec(prefix_len=0, extend_len=extend_len)
        return RequestSpec(prefix_len=rp.valid_len, extend_len=extend_len,
                           prefix_owners=tuple(rp.owners[: cdiv(rp.valid_len, self.page_size)]))

    # ---- a batch -------------------------------------------------------------------------------
    def _check_agrees(self, rid: Hashable, req: RequestPlan, rp: RequestPages | None) -> None:
        """Raises ValueError when the plan's request ``req`` and the table's pages ``rp`` of
        ``rid`` disagree (its prefix, its tail page's owner) or ``rid`` is in an uncommitted
        batch."""
        have = 0 if rp is None else rp.valid_len
        if rp is not None and rp.pending:
            raise ValueError(f"request {rid!r} is already in an uncommitted batch")
        if req.prefix_len != have:
            raise ValueError(f"request {rid!r}: the plan's prefix is {req.prefix_len} tokens, the "
                             f"pool holds {have}")
        existing = 0 if rp is None else len(rp.slots)
        for k in range(req.prefix_len // self.page_size, existing):  # the tail page keeps its owner
            if rp is not None and req.page_owners[k] != rp.owners[k]:
                raise ValueError(f"request {rid!r}: plan says page {k} is owned by rank "
                                 f"{req.page_owners[k]}, the pool by {rp.owners[k]}")

    def _batch_needs(self, plan: CPPlan, rids: Sequence[Hashable]
                     ) -> tuple[list[int], list[tuple[Hashable, int, list[int]]],
                                list[tuple[Hashable, int]]]:
        """What the batch takes: pages per allocation rank, per request its first new logical
        page and the owners of its new pages, and the shared tail pages it writes into
        ((rid, logical page): copies on write, on the page's owner).

        Raises:
            ValueError: plan and table disagree (see :meth:`_check_agrees`)."""
        ps = self.page_size
        needs = [0] * self.allocator.num_ranks
        new: list[tuple[Hashable, int, list[int]]] = []
        cows: list[tuple[Hashable, int]] = []  # shared tail pages this batch writes into
        for rid, req in zip(rids, plan.requests, strict=True):
            rp = self._requests.get(rid)
            self._check_agrees(rid, req, rp)
            existing = 0 if rp is None else len(rp.slots)
            if rp is not None and req.prefix_len % ps:
                k = req.prefix_len // ps  # the head fragment writes into this page (rule 3)
                if self._refs.count(self.key(rp.owners[k], rp.slots[k])) > 1:
                    cows.append((rid, k))  # others still read it: copy on write, on its owner
                    needs[self.alloc_rank(rp.owners[k])] += 1
            owners: list[int] = []
            for k in range(existing, cdiv(req.end, ps)):
                o = req.page_owners[k]
                if o is None:  # the plan validates this away: pages from the prefix's tail on
                    raise ValueError(f"request {rid!r}: the plan has no owner for page {k}")
                owners.append(o)
                needs[self.alloc_rank(o)] += 1
            new.append((rid, existing, owners))
        return needs, new, cows

    def owners_to_give(self, plan: CPPlan, rids: Sequence[Hashable]
                       ) -> dict[Hashable, tuple[int, ...]]:
        """Per request of the batch, the owner rank of each page an external allocator gives
        :meth:`reserve` (``given``), in that order: first the copy of its shared tail page when
        it writes into one, then its new logical pages. Pure (nothing taken).

        Raises:
            ValueError: plan and table disagree (a request's prefix or owners, a request in an
                uncommitted batch).
        """
        _, new, cows = self._batch_needs(plan, rids)
        return {rid: tuple(o) for rid, o in self._want(cows, new).items()}

    def _want(self, cows: Sequence[tuple[Hashable, int]],
              new: Sequence[tuple[Hashable, int, list[int]]]) -> dict[Hashable, list[int]]:
        """Per request, the owners of the pages it takes: its tail copy's, then its new ones."""
        want: dict[Hashable, list[int]] = {rid: [] for rid, _, _ in new}
        for rid, k in cows:
            want[rid].append(self._requests[rid].owners[k])
        for rid, _, owners in new:
            want[rid].extend(owners)
        return want

    def reserve(self, plan: CPPlan, rids: Sequence[Hashable], *,
                given: Mapping[Hashable, Sequence[tuple[int, int]]] | None = None) -> Reservation:
        """Take the pages the batch ``plan`` of requests ``rids`` writes, all or nothing, and
        put them in the requests' tables (pending until :meth:`commit`).

        ``given`` (external allocation: an engine's own slot allocator): per request the
        (owner rank, slot) of each page it needs, in order: first the copy of its shared tail
        page when it writes into one, then its new logical pages (:meth:`owners_to_give` lists
        the owners). Each is checked against the plan (the page's owner
        must be the plan's, one page per slot, the slot free on that owner); the table takes
        exactly those slots and never asks the reclaimer.

        Raises:
            ValueError: plan and table disagree (a request's prefix or owners, a request in an
                uncommitted batch), or a given page is wrong (its owner, its slot, how many);
                nothing changed.
            PoolExhausted: not enough pages even after the reclaimer; nothing changed.
        """
        needs, new, cows = self._batch_needs(plan, rids)
        what = f"a batch of {len(rids)} requests"
        slots = (self._refs.take(needs, what) if given is None
                 else self._refs.take_given(self._given_slots(given, cows, new), what))
        # commit the reservation to the page tables (nothing can fail from here on)
        cursor = [0] * len(slots)

        def take(owner: int) -> int:
            a = self.alloc_rank(owner)
            cursor[a] += 1
            return slots[a][cursor[a] - 1]

        copies: list[tuple[Hashable, int, int, int]] = []
        for rid, k in cows:
            rp = self._requests[rid]
            old = rp.slots[k]
            # allocation may have evicted the other holders (docs/cache.md, copy on write)
            if self._refs.count(self.key(rp.owners[k], old)) == 1:
                continue
            fresh = take(rp.owners[k])
            rp.slots[k] = fresh
            rp.version += 1
            self._refs.drop([self.key(rp.owners[k], old)])  # still held by the others
            copies.append((rid, k, old, fresh))
        for rid, _existing, owners in new:
            rp = self._requests.setdefault(rid, RequestPages())
            for o in owners:
                rp.owners.append(o)
                rp.slots.append(take(o))
                rp.pending.append(len(rp.slots) - 1)
            rp.version += 1
        for a, got in enumerate(slots):  # copies that turned out unneeded: their pages go back
            self._refs.give_back(a, got[cursor[a]:])
        return Reservation(rids=tuple(rids), ends=tuple(r.end for r in plan.requests),
                           new_pages=tuple((rid, e) for rid, e, _ in new), copies=tuple(copies))

    def _given_slots(self, given: Mapping[Hashable, Sequence[tuple[int, int]]],
                     cows: Sequence[tuple[Hashable, int]],
                     new: Sequence[tuple[Hashable, int, list[int]]]) -> list[list[int]]:
        """Per allocation rank, the given slots in the order :meth:`reserve` uses them (copies
        on write, then new pages request by request), each page's owner checked.

        Raises:
            ValueError: a request's given pages do not match what it needs (naming them)."""
        want = self._want(cows, new)
        extra = [rid for rid in given if rid not in want]
        if extra:
            raise ValueError(f"given pages for requests not in the batch: {extra[:8]}")
        out: list[list[int]] = [[] for _ in range(self.allocator.num_ranks)]
        cows_of = {rid for rid, _ in cows}
        order = [(rid, True) for rid, _ in cows] + [(rid, False) for rid, _, _ in new]
        cursor: dict[Hashable, int] = {}
        for rid, _ in order:
            pages, owners = list(given.get(rid, ())), want.get(rid, [])
            if len(pages) != len(owners):
                raise ValueError(
                    f"request {rid!r} needs {len(owners)} pages (owners {owners[:16]}"
                    f"{', the first a copy of its shared tail page' if rid in cows_of else ''}"
                    f"), {len(pages)} were given")
        for rid, is_copy in order:
            owners, pages = want[rid], list(given.get(rid, ()))
            i = cursor.get(rid, 0)
            n = 1 if is_copy else len(owners) - i
            for j in range(i, i + n):
                o, slot = pages[j]
                if o != owners[j]:
                    raise ValueError(f"request {rid!r}: given page {j} is on rank {o}, the plan "
                                     f"puts it on rank {owners[j]} (one owner per page, the "
                                     f"plan's)")
                out[self.alloc_rank(o)].append(slot)
            cursor[rid] = i + n
        return out

    def commit(self, res: Reservation) -> None:
        """Mark the reserved batch's tokens valid."""
        for rid, end in zip(res.rids, res.ends, strict=True):
            rp = self._requests[rid]
            rp.valid_len = end
            rp.pending.clear()

    def abort(self, res: Reservation) -> list[PageKey]:
        """Undo :meth:`reserve`: the requests hold what they held before. Returns the pages
        that went back to the free lists ((allocation rank, slot): the reserved ones)."""
        freed: list[PageKey] = []
        for rid, k, old, fresh in res.copies:
            rp = self._requests[rid]
            self.retain([(rp.owners[k], old)])
            freed += self._refs.drop_pages([self.key(rp.owners[k], fresh)])
            rp.slots[k] = old
            rp.version += 1
        for rid, first_new in res.new_pages:
            rp = self._requests[rid]
            freed += self._refs.drop_pages(self.key(rp.owners[k], rp.slots[k])
                                           for k in range(first_new, len(rp.slots)))
            del rp.owners[first_new:], rp.slots[first_new:]
            rp.version += 1
            rp.pending.clear()
            if not rp.slots:
                del self._requests[rid]
        return freed

    # ---- requests ------------------------------------------------------------------------------
    def free(self, rid: Hashable) -> list[PageKey]:
        """Release request ``rid``'s references to its pages. Returns the pages that went back
        to the free lists ((allocation rank, slot): those nothing else held).

        Raises:
            KeyError: ``rid`` is not in the table.
        """
        rp = self._requests.pop(rid)
        return self._refs.drop_pages(self.key(o, s)
                                     for o, s in zip(rp.owners, rp.slots, strict=True))

    def truncate(self, rid: Hashable, valid_len: int) -> int:
        """Keep ``rid``'s first ``valid_len`` tokens; its pages past them lose its reference.
        Returns how many pages went back to the free lists.

        Raises:
            ValueError: ``rid`` is in an uncommitted batch, or ``valid_len`` is not in
                ``[1, valid length]``.
        """
        rp = self._requests[rid]
        if rp.pending:
            raise ValueError(f"request {rid!r} is in an uncommitted batch")
        if not 1 <= valid_len <= rp.valid_len:
            raise ValueError(f"request {rid!r} holds {rp.valid_len} tokens, cannot keep {valid_len}")
        keep = cdiv(valid_len, self.page_size)
        freed = self._refs.drop(self.key(o, s) for o, s in zip(rp.owners[keep:], rp.slots[keep:],
                                                               strict=True))
        del rp.owners[keep:], rp.slots[keep:]
        rp.version += 1
        rp.valid_len = valid_len
        return freed

    def adopt(self, rid: Hashable, pages: Sequence[tuple[int, int]], valid_len: int) -> None:
        """Start ``rid`` from ``valid_len`` tokens stored in ``pages`` ((owner, slot) of logical
        pages 0..), taking one more reference to each.

        Raises:
            ValueError: ``rid`` is in the table, ``pages`` does not cover ``valid_len``, or a
                page is not held (nothing changed).
        """
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already in the pool")
        if valid_len < 1 or len(pages) != cdiv(valid_len, self.page_size):
            raise ValueError(f"{valid_len} valid tokens need {cdiv(valid_len, self.page_size)} "
                             f"pages of {self.page_size}, got {len(pages)}")
        self.retain(pages)
        self._requests[rid] = RequestPages(owners=[o for o, _ in pages],
                                           slots=[s for _, s in pages], valid_len=valid_len)

    def extend(self, rid: Hashable, pages: Sequence[tuple[int, int]], valid_len: int) -> None:
        """Append ``pages`` ((owner, slot), held by the caller: their references pass to the
        request) to ``rid``'s table (created when new) and set its valid length (a transfer's
        publish: the pages cover ``valid_len``).

        Raises:
            ValueError: a page is not held (nothing changed).
        """
        missing = [p for p in pages if not self._refs.count(self.key(*p))]
        if missing:
            raise ValueError(f"cannot hand over pages that are not held: {missing[:8]}")
        rp = self._requests.setdefault(rid, RequestPages())
        rp.owners.extend(o for o, _ in pages)
        rp.slots.extend(s for _, s in pages)
        if pages:
            rp.version += 1
        rp.valid_len = valid_len

    # ---- pages held outside requests (the prefix cache, transfers) ----------------------------
    def retain(self, pages: Iterable[tuple[int, int]]) -> None:
        """One more reference to each (owner rank, slot) page.

        Raises:
            ValueError: a page is not held (nothing was changed).
        """
        self._refs.retain([self.key(o, s) for o, s in pages])

    def release(self, pages: Iterable[tuple[int, int]]) -> int:
        """One reference less to each (owner rank, slot) page; returns how many went back to the
        free lists."""
        return self._refs.drop(self.key(o, s) for o, s in pages)

    def release_pages(self, pages: Iterable[tuple[int, int]]) -> list[PageKey]:
        """:meth:`release`, returning the pages that went back to the free lists ((allocation
        rank, slot))."""
        return self._refs.drop_pages(self.key(o, s) for o, s in pages)

    def take_pages(self, needs: Sequence[int], what: str = "pages") -> list[list[int]]:
        """``needs[a]`` new pages on every allocation rank ``a``, all or nothing, one reference
        each (the caller's), the reclaimer asked first under pressure.

        Raises:
            PoolExhausted: not enough free pages (nothing taken).
        """
        return self._refs.take(list(needs), what)

    def allocate_pages(self, owner: int, n: int, what: str = "pages") -> list[int]:
        """``n`` new pages on ``owner``, one reference each (the caller's), the reclaimer asked
        first under pressure (:meth:`take_pages` for one owner).

        Raises:
            PoolExhausted: not enough free pages (nothing taken).
        """
        needs = [0] * self.allocator.num_ranks
        needs[self.alloc_rank(owner)] = n
        return self.take_pages(needs, what)[self.alloc_rank(owner)]
