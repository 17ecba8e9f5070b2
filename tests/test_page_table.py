"""The host-side page table (cpkv.kv.table) alone: no tensors, no device, hypothesis only.

A state machine drives reservations (committed or aborted; from the table's free lists or from
an external allocator's slots, ``given`` in the order ``owners_to_give`` asks), adopt / truncate
/ free, pages held outside requests (retain / release / take, as the prefix cache does) and a
reclaim hook that drops those outside holds under pressure; after every step the reference
counts must equal the holders, no count is below one, every slot is either free exactly once or
held, and a request's pages are where the plan put them; ``free`` / ``release_pages`` /
``abort`` return exactly the pages that became free (what an external allocator takes back)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Hashable, Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cpkv.contracts import SplitMode, cdiv
from cpkv.fallback import recording
from cpkv.kv.allocator import PoolExhausted
from cpkv.kv.table import PageTable
from cpkv.planning import plan_batch

PS = 4


class PageTableMachine(RuleBasedStateMachine):
    """Random page-table traffic against a model of who holds which page."""

    @initialize(cp=st.integers(1, 3), capacity=st.integers(4, 14), shared=st.booleans())
    def start(self, cp: int, capacity: int, shared: bool) -> None:
        self.cp, self.capacity = cp, capacity
        self.table = PageTable(PS, cp, capacity, shared=shared)
        #: pages held outside any request (the "cache"), as (owner, slot), one entry per ref
        self.outside: list[tuple[int, int]] = []
        self.next_rid = 0
        self.table.reclaim = self._reclaim

    def _reclaim(self, needs: Sequence[int]) -> bool:
        """The cache's eviction: drop every outside hold, say whether the pages fit now."""
        self.table.release(self.outside)
        self.outside = []
        alloc = self.table.allocator
        return all(alloc.free_pages(a) >= n for a, n in enumerate(needs))

    def _state(self) -> tuple[object, ...]:
        reqs = {rid: (tuple(rp.owners), tuple(rp.slots), rp.valid_len, tuple(rp.pending))
                for rid, rp in self.table.requests.items()}
        return reqs, self.table.references(), sorted(map(sorted, self.table.allocator.snapshot()))

    def _rids(self) -> list[Hashable]:
        return sorted(self.table.requests, key=str)

    def _free(self) -> set[tuple[int, int]]:
        return {(a, s) for a, free in enumerate(self.table.allocator.snapshot()) for s in free}

    def _given(self, plan: object, rids: list[Hashable]
               ) -> dict[Hashable, list[tuple[int, int]]] | None:
        """An external allocator's slots for the batch (the highest free slot of each page's
        owner), or None when they do not fit."""
        from cpkv.contracts import CPPlan

        assert isinstance(plan, CPPlan)
        free = [sorted(f) for f in self.table.allocator.snapshot()]
        given: dict[Hashable, list[tuple[int, int]]] = {}
        for rid, owners in self.table.owners_to_give(plan, rids).items():
            given[rid] = []
            for o in owners:
                a = self.table.alloc_rank(o)
                if not free[a]:
                    return None
                given[rid].append((o, free[a].pop()))
        return given

    # ---- a batch -------------------------------------------------------------------------------
    @rule(data=st.data(), n_new=st.integers(0, 2), commit=st.booleans(),
          mode=st.sampled_from(list(SplitMode)), external=st.booleans())
    def batch(self, data: st.DataObject, n_new: int, commit: bool, mode: SplitMode,
              external: bool) -> None:
        old = data.draw(st.lists(st.sampled_from(self._rids()), unique=True, max_size=2)
                        if self.table.requests else st.just([]))
        rids: list[Hashable] = [*old]
        for _ in range(n_new if old else max(1, n_new)):
            rids.append(f"r{self.next_rid}")
            self.next_rid += 1
        specs = [self.table.request_spec(r, data.draw(st.integers(1, 3 * PS))) for r in rids]
        with recording():  # short extends are reported fallbacks of the planner
            plan = plan_batch(specs, self.cp, PS, mode)
        outside_before = Counter(self.outside)
        before = self._state()
        given = self._given(plan, rids) if external else None
        if external and given is None:
            return
        try:
            res = self.table.reserve(plan, rids, given=given)
        except PoolExhausted:
            # the reclaimer may have dropped the outside holds; nothing else changed
            if Counter(self.outside) == outside_before:
                assert self._state() == before
            return
        for rid, req in zip(rids, plan.requests, strict=True):
            rp = self.table.requests[rid]
            n = cdiv(req.end, PS)
            assert len(rp.slots) == len(rp.owners) == n
            # every page of the extend on the owner the plan gave it (rule 10)
            assert rp.owners[req.prefix_len // PS:] == list(req.page_owners[req.prefix_len // PS:n])
        for rid, k, old_slot, fresh in res.copies:  # copies on write left the others' page alone
            assert self.table.requests[rid].slots[k] == fresh != old_slot
            assert self.table.refcount(self.table.requests[rid].owners[k], old_slot) >= 1
        if given is not None:  # exactly the given slots: the tail copy first, then new pages
            for rid, first_new in res.new_pages:
                rp = self.table.requests[rid]
                cow = [(rp.owners[k], f) for r, k, _, f in res.copies if r == rid]
                assert cow + list(zip(rp.owners[first_new:], rp.slots[first_new:],
                                      strict=True)) == given[rid]
        if commit:
            self.table.commit(res)
            for rid, req in zip(rids, plan.requests, strict=True):
                assert self.table.requests[rid].valid_len == req.end
                assert not self.table.requests[rid].pending
        else:
            free_before = self._free()
            freed = self.table.abort(res)
            assert set(freed) == self._free() - free_before and len(set(freed)) == len(freed)
            if Counter(self.outside) == outside_before:
                assert self._state() == before

    # ---- requests ------------------------------------------------------------------------------
    @precondition(lambda self: bool(self.table.requests))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._rids()))
        rp = self.table.requests[rid]
        keep = data.draw(st.integers(1, rp.valid_len))
        held = len(rp.slots)
        self.table.truncate(rid, keep)
        assert len(self.table.requests[rid].slots) == cdiv(keep, PS) <= held

    @precondition(lambda self: bool(self.table.requests))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        before = self._free()
        freed = self.table.free(data.draw(st.sampled_from(self._rids())))
        assert sorted(freed) == sorted(self._free() - before)

    @precondition(lambda self: bool(self.table.requests))
    @rule(data=st.data())
    def adopt_prefix(self, data: st.DataObject) -> None:
        """A new request starts from another's first pages (a prefix-cache hit)."""
        src = self.table.requests[data.draw(st.sampled_from(self._rids()))]
        n = data.draw(st.integers(1, len(src.slots)))
        valid = data.draw(st.integers((n - 1) * PS + 1, min(n * PS, src.valid_len)))
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self.table.adopt(rid, list(zip(src.owners[:n], src.slots[:n], strict=True)), valid)

    # ---- pages held outside requests ----------------------------------------------------------
    @precondition(lambda self: bool(self.table.requests))
    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        rp = self.table.requests[data.draw(st.sampled_from(self._rids()))]
        pages = list(zip(rp.owners, rp.slots, strict=True))
        self.table.retain(pages)
        self.outside += pages

    @precondition(lambda self: bool(self.outside))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.outside) - 1))
        before = self._free()
        freed = self.table.release_pages([self.outside.pop(i)])
        assert freed == sorted(self._free() - before)

    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        ranks = self.table.allocator.num_ranks
        needs = data.draw(st.lists(st.integers(0, 3), min_size=ranks, max_size=ranks))
        try:
            got = self.table.take_pages(needs)
        except PoolExhausted:
            return
        for a, slots in enumerate(got):  # a replica's one list serves owner 0
            self.outside += [(a, s) for s in slots]

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def references_equal_holders(self) -> None:
        if not hasattr(self, "table"):
            return
        t = self.table
        holders: Counter[tuple[int, int]] = Counter(t.key(o, s) for o, s in self.outside)
        for rp in t.requests.values():
            holders.update(t.key(o, s) for o, s in zip(rp.owners, rp.slots, strict=True))
        refs = t.references()
        assert all(n >= 1 for n in refs.values())  # never zero or negative: freed at zero
        assert refs == dict(holders)
        assert t.logical_pages() == len(refs)

    @invariant()
    def every_slot_free_once_or_held(self) -> None:
        if not hasattr(self, "table"):
            return
        t = self.table
        refs = t.references()
        for a, free in enumerate(t.allocator.snapshot()):
            assert len(set(free)) == len(free), f"rank {a}: a slot is free twice"
            held = {s for r, s in refs if r == a}
            assert not held & set(free)
            assert len(free) + len(held) == t.allocator.capacity

    @invariant()
    def pages_on_their_owner(self) -> None:
        if not hasattr(self, "table"):
            return
        for rp in self.table.requests.values():
            assert all(0 <= o < self.cp for o in rp.owners)
            assert len(rp.owners) == len(rp.slots) == cdiv(rp.valid_len, PS)
            if self.table.shared and self.cp > 1:  # each page keyed on its owner's free list
                assert all(self.table.key(o, s)[0] == o for o, s in zip(rp.owners, rp.slots,
                                                                       strict=True))


TestPageTable = PageTableMachine.TestCase
TestPageTable.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_page_table_imports_no_torch() -> None:
    """The page table and its records load without torch (the kv package itself imports it,
    so the modules are loaded under a bare stand-in package)."""
    code = (
        "import pathlib, sys, types, cpkv\n"
        "pkg = types.ModuleType('cpkv.kv')\n"
        "pkg.__path__ = [str(pathlib.Path(cpkv.__file__).parent / 'kv')]\n"
        "sys.modules['cpkv.kv'] = pkg\n"
        "import cpkv.kv.table\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
