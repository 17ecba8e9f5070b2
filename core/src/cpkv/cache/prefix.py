"""The CP-aware prefix cache: a radix tree of token ids over the sharded pool's pages (rule 28).

Every rank keeps one :class:`PrefixCache` over its pool's page table and feeds it the same calls,
so every rank holds the same tree and makes the same decisions (hits, evictions) without communication.
The pages themselves stay where they are: on their owner rank, in its pool (rule 11). A hit
hands the new request the cached pages (shared, reference counted by the pool); when the hit
ends inside a page, the new request's head fragment would write into a page other requests
still read, so the pool copies that page on its owner first (copy on write, in
:meth:`~cpkv.kv.ShardedKVPool.prepare`), and the fragment runs on that owner (rule 3).

Keys past a request's valid length are never read: a full view holds exactly
``[0, prefix + extend)`` of each request (the tail page's rest is masked by construction).

With a host tier (:class:`~cpkv.kv.host.HostPages`), eviction first backs a node's pages up on
their owners' host memory and keeps the node (now on the host); a hit through host nodes brings
them back into new device slots on the same owners, loaded a layer ahead of the layer loop by
the next batch. When the host tier is full its least recently used nodes are dropped.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackReason, cdiv
from cpkv.fallback import report_fallback
from cpkv.kv import PageTable, PoolExhausted
from cpkv.kv.host import HostPages
from cpkv.kv.stage import PageLoad
from cpkv.logs import get_logger

from .radix import PageRef, PrefixMatch, RadixTree, _Node

__all__ = ["CacheStats", "HostLoads", "PrefixCache"]

log = get_logger(__name__)


@dataclass
class CacheStats:
    """Counters of one cache (identical on every rank)."""

    lookups: int = 0
    hit_tokens: int = 0
    looked_up_tokens: int = 0
    inserted_tokens: int = 0
    evicted_nodes: int = 0
    #: pages whose last reference went with an eviction (their slots are free again)
    pages_evicted: int = 0
    #: tokens a rank had cached but recomputed because another rank had less (rule 29)
    recomputed_tokens: int = 0
    #: pages backed up into the host tier by evictions
    pages_saved_to_host: int = 0
    #: host pages loaded back into device slots for a hit
    pages_loaded_from_host: int = 0
    #: host pages whose last reference went when the host tier made room (least recently used)
    host_pages_dropped: int = 0
    #: nodes that left the tree under pressure without a host backup (their tokens are no longer
    #: cached): no host tier, no room in it, or dropped from it
    nodes_dropped: int = 0


class HostLoads(Protocol):
    """What the cache's host tier needs of the device bytes (a :class:`~cpkv.kv.KVStore` is
    one): back pages up into host memory, and queue their loads back into device slots."""

    @property
    def loads_pending(self) -> bool:
        """Queued or in-flight host loads (or copies) whose bytes are not all in place yet."""
        ...

    def queue_load(self, load: PageLoad) -> None:
        """Load host pages into reserved device slots with the next batch's staged work."""
        ...

    def flush_loads(self) -> None:
        """Finish every queued host load and in-flight staged work now."""
        ...

    def queued_loads(self) -> tuple[PageLoad, ...]:
        """Host loads queued and not yet handed to a batch (read by consistency checks)."""
        ...

    def save_to_host(self, host: HostPages, dev_slots: Sequence[int],
                     host_slots: Sequence[int]) -> None:
        """Copy this rank's device pages ``dev_slots`` into ``host``'s pages ``host_slots``."""
        ...


class _WeakReclaim:
    """The page table's reclaim hook to a cache it does not keep alive: the cache's
    :meth:`PrefixCache.evict_for` while the cache lives, else nothing reclaimed."""

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = weakref.ref(cache)

    def __call__(self, needs: Sequence[int]) -> bool:
        cache = self._cache()
        return cache is not None and cache.evict_for(needs)


class PrefixCache:
    """Radix prefix cache over one rank's page table (see the module docstring).

    Args:
        pages: this rank's page table (``pool.pages``); the cache registers itself as its page
            reclaimer, so a batch that does not fit evicts least recently used cached prefixes,
            then allocates (unless ``evict`` is False: then a batch that does not fit raises).
        loads: the device bytes' host loads (``pool.store``): used only with a host tier.
        group: the CP group (this rank, and the collectives of :meth:`agree`).
        host: the host tier (evicted pages are backed up there first), or None (they are gone).
        evict: whether pool pressure evicts cached prefixes.
    """

    def __init__(self, pages: PageTable, loads: HostLoads, group: CPGroup,
                 host: HostPages | None = None, *, evict: bool = True) -> None:
        if host is not None and host.allocator.num_ranks != pages.allocator.num_ranks:
            raise ValueError(f"host tier has {host.allocator.num_ranks} allocation ranks, the pool "
                             f"{pages.allocator.num_ranks}")
        self.pages, self.loads, self.group, self.host = pages, loads, group, host
        self.tree = RadixTree(pages.page_size)
        self.stats = CacheStats()
        #: nodes no eviction may take right now (a hit being attached)
        self._keep: set[_Node] = set()
        if evict:
            # weakly: the table is the cache's, so a bound method there made a reference cycle
            # that only the cyclic collector freed, with the CP group in it (at interpreter exit,
            # after Gloo's teardown: a rank aborted there)
            pages.reclaim = _WeakReclaim(self)

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``tokens``, in tokens, leaving at least the last token to
        compute (its logits are the request's output)."""
        m = self.tree.match(tokens, limit=len(tokens) - 1)
        if m.on_host:
            m = self._servable(m)
        self.stats.lookups += 1
        self.stats.looked_up_tokens += len(tokens)
        self.stats.hit_tokens += m.hit_tokens
        return m

    def _servable(self, m: PrefixMatch) -> PrefixMatch:
        """``m`` cut before the first host page whose bytes this rank lost (rule 29: the others
        then shorten their hit to this one's in :meth:`agree`)."""
        if self.host is None or not self.host.lost:
            return m
        me, hit = self.pages.alloc_rank(self.group.rank), m.hit_tokens
        ps, cut = self.page_size, None
        while True:
            for k, (node, (owner, slot)) in enumerate(self.tree.page_sources(m.path, hit)):
                if node.on_host and self.pages.alloc_rank(owner) == me and slot in self.host.lost:
                    cut = (k, slot)
                    hit = max(node.start, k * ps)  # below it, page k comes from the parent
                    break
            else:
                break
        if cut is None:
            return m
        report_fallback(op="prefix_cache", requested=f"cached prefix of {m.hit_tokens} tokens",
                        selected=f"{hit} tokens, the rest recomputed",
                        reason=FallbackReason.HOST_PAGE_MISSING,
                        detail=f"rank {self.group.rank} lost host page {cut[1]} (logical page "
                               f"{cut[0]})")
        return self.tree.prefix(m.path, hit)

    def agree(self, match: PrefixMatch) -> PrefixMatch:
        """The hit every rank can serve: the minimum over ranks (rule 29; a collective, one host
        sync per request). Ranks fed the same calls agree already; a rank that has less (it lost
        a cached page) shortens every rank's hit, reported on every rank as fallback
        ``cache_hit_shortened``, and the rest is recomputed."""
        hit, neg_most = self.group.agree_min([match.hit_tokens, -match.hit_tokens])
        if hit == -neg_most:  # every rank has the same hit
            return match
        report_fallback(op="prefix_cache", requested=f"cached prefix of up to {-neg_most} tokens",
                        selected=f"{hit} tokens (the shortest hit of any rank), the rest recomputed",
                        reason=FallbackReason.CACHE_HIT_SHORTENED,
                        detail=f"ranks could serve {hit} to {-neg_most} tokens; this rank "
                               f"{match.hit_tokens}")
        self.stats.hit_tokens -= match.hit_tokens - hit
        self.stats.recomputed_tokens += match.hit_tokens - hit
        if hit == match.hit_tokens:
            return match
        return self.tree.prefix(match.path, hit)

    def attach(self, rid: Hashable, match: PrefixMatch) -> int:
        """Start request ``rid`` from the cached prefix ``match``: its page table takes the
        cached pages (shared) and its valid length the hit. Returns the hit length; the caller
        prefills the tokens after it. A zero hit attaches nothing.

        Host nodes on the hit are brought back first: new device slots on the same owners
        (evicting other prefixes if needed), loaded by the next batch a layer ahead. When even
        that does not fit, the hit stops before the first host node (the same on every rank:
        fallback ``cache_hit_shortened``).

        Raises:
            ValueError: ``rid`` is already in the pool.
        """
        if rid in self.pages.requests:
            raise ValueError(f"request {rid!r} is already in the pool")
        if match.on_host:
            match = self._bring_back(match)
        if match.hit_tokens == 0:
            return 0
        self.pages.adopt(rid, match.pages, match.hit_tokens)
        self.tree.touch(match)
        return match.hit_tokens

    def _bring_back(self, match: PrefixMatch) -> PrefixMatch:
        """Load the host nodes of ``match`` back into device slots (see :meth:`attach`)."""
        assert self.host is not None
        hit, host = match.hit_tokens, self.host
        last = match.path[-1]
        if last.on_host and hit < last.end:  # only the hit comes back
            host.retain(self._hkey(r) for r in self.tree.split(last, hit))
            assert last.parent is not None  # the upper part of the split: [start, hit)
            match = self.tree.prefix((*match.path[:-1], last.parent), hit)
        nodes = match.on_host
        refs = [(n, k, r) for n in nodes for k, r in sorted(n.pages.items())]
        needs = [0] * self.pages.allocator.num_ranks
        for _, _, (owner, _) in refs:
            needs[self.pages.alloc_rank(owner)] += 1
        self._keep = set(match.path)
        try:
            slots = self.pages.take_pages(needs, f"{len(refs)} host pages of a cached prefix")
        except PoolExhausted as exc:
            short = nodes[0].start
            report_fallback(op="prefix_cache", requested=f"cached prefix of {hit} tokens",
                            selected=f"{short} tokens (the device part), the rest recomputed",
                            reason=FallbackReason.CACHE_HIT_SHORTENED,
                            detail=f"no room to load {len(refs)} host pages: {exc}")
            self.stats.hit_tokens -= hit - short
            return self.tree.prefix(match.path, short)
        finally:
            self._keep = set()
        cursor = [0] * len(slots)
        moves: list[tuple[int, int, int]] = []
        for node in nodes:
            dev: dict[int, PageRef] = {}
            for k, (owner, hslot) in sorted(node.pages.items()):
                a = self.pages.alloc_rank(owner)
                dev[k] = (owner, slots[a][cursor[a]])
                cursor[a] += 1
                moves.append((owner, hslot, dev[k][1]))
            node.pages, node.on_host = dev, False  # the load holds the host references now
        self.loads.queue_load(PageLoad(host, tuple(moves)))
        self.stats.pages_loaded_from_host += len(moves)
        return self.tree.prefix(match.path, hit)

    def _hkey(self, ref: PageRef) -> tuple[int, int]:
        return self.pages.alloc_rank(ref[0]), ref[1]

    def insert(self, rid: Hashable, tokens: Sequence[int]) -> int:
        """Cache request ``rid``'s tokens: ``tokens`` are its token ids from position 0 (at least
        its valid length). The tree references its pages; the request keeps its own references
        until it is freed. Returns the tokens inserted (its valid length).

        Raises:
            ValueError: fewer tokens than the request's valid length, or it has an uncommitted
                batch.
        """
        rp = self.pages.requests[rid]
        if rp.pending:
            raise ValueError(f"request {rid!r} has an uncommitted batch; insert after commit")
        n = rp.valid_len
        if len(tokens) < n:
            raise ValueError(f"request {rid!r} holds {n} tokens, {len(tokens)} token ids given")
        pages: list[PageRef] = [(rp.owners[k], rp.slots[k]) for k in range(cdiv(n, self.page_size))]
        added = self.tree.insert(tokens[:n], pages)
        self.pages.retain(added.device)
        if added.host:
            assert self.host is not None
            self.host.retain(self._hkey(r) for r in added.host)
        for node in self.tree.match(tokens[:n]).on_host:  # the request holds these tokens now
            dev = {k: pages[k] for k in node.pages}
            self.pages.retain(dev.values())
            self._release_host(node)  # the device copy replaces it
            node.pages, node.on_host = dev, False
        self.stats.inserted_tokens += n
        return n

    def _release_host(self, node: _Node) -> int:
        """Drop ``node``'s host references; the host pages that freed."""
        assert self.host is not None
        return self.host.release(self._hkey(r) for r in node.pages.values())

    def _evictable(self) -> list[int]:
        """Per allocation rank: pages that only the tree holds (what evicting everything frees)."""
        held: Counter[PageRef] = Counter(p for n in self.tree.nodes()
                                         if not n.on_host and n not in self._keep
                                         for p in n.pages.values())
        out = [0] * self.pages.allocator.num_ranks
        for (owner, slot), n in held.items():
            if self.pages.refcount(owner, slot) == n:
                out[self.pages.alloc_rank(owner)] += 1
        return out

    def _evict_one(self) -> int | None:
        """Evict the least recently used device prefix (to the host tier when there is one and
        it has room, else out of the tree); the device pages it freed, or None when none is
        left."""
        node = self.tree.lru(on_host=False, keep=self._keep)
        if node is None:
            return None
        dev = list(node.pages.values())
        if not self._save(node):
            self.stats.host_pages_dropped += self._remove(node)
        freed = self.pages.release(dev)
        self.stats.evicted_nodes += 1
        self.stats.pages_evicted += freed
        return freed

    def _save(self, node: _Node) -> bool:
        """Back ``node``'s pages up into the host tier (each owner copies its own) and mark it a
        host node; False when there is no host tier or no room even after dropping its least
        recently used nodes."""
        host = self.host
        if host is None:
            return False
        needs = [0] * host.allocator.num_ranks
        for owner, _ in node.pages.values():
            needs[self.pages.alloc_rank(owner)] += 1
        if any(n > host.capacity for n in needs):
            return False
        while any(host.free_pages(a) < n for a, n in enumerate(needs)):
            victim = self.tree.lru(on_host=True, keep=self._keep)
            if victim is None:
                return False
            self.stats.host_pages_dropped += self._remove(victim)
        if self.loads.loads_pending:
            self.loads.flush_loads()  # a page saved now may still be waiting for its load
        slots = host.take(needs)
        me = self.pages.alloc_rank(self.group.rank)
        cursor = [0] * len(slots)
        saved: dict[int, PageRef] = {}
        dev_mine: list[int] = []
        host_mine: list[int] = []
        for k, (owner, dslot) in sorted(node.pages.items()):
            a = self.pages.alloc_rank(owner)
            saved[k] = (owner, slots[a][cursor[a]])
            cursor[a] += 1
            if a == me:
                dev_mine.append(dslot)
                host_mine.append(saved[k][1])
        if dev_mine:
            self.loads.save_to_host(host, dev_mine, host_mine)
        node.pages, node.on_host = saved, True
        self.stats.pages_saved_to_host += len(saved)
        return True

    def _remove(self, node: _Node) -> int:
        """Take ``node`` and its subtree out of the tree, releasing their host references (the
        device references of ``node`` itself are the caller's to release); the host pages that
        freed."""
        dropped = 0
        for n in self.tree.remove(node):
            self.stats.nodes_dropped += 1
            if n.on_host:
                dropped += self._release_host(n)
            elif n is not node:
                self.stats.pages_evicted += self.pages.release(n.pages.values())
        return dropped

    def evict_for(self, needs: Sequence[int]) -> bool:
        """Evict least recently used prefixes until every allocation rank has ``needs[a]`` free
        pages. Returns whether it got there (all ranks decide alike: the tree is the same). When
        even evicting everything would not make room, evicts nothing and returns False: the
        caller's error then leaves the cache as it was."""
        alloc = self.pages.allocator
        room = self._evictable()
        if any(alloc.free_pages(a) + room[a] < n for a, n in enumerate(needs)):
            return False
        while any(alloc.free_pages(a) < n for a, n in enumerate(needs)):
            if self._evict_one() is None:
                return False
        return True

    def evict(self, nodes: int) -> int:
        """Evict up to ``nodes`` least recently used prefixes; returns the pages freed."""
        freed = 0
        for _ in range(nodes):
            n = self._evict_one()
            if n is None:
                break
            freed += n
        return freed

    def clear(self) -> None:
        """Drop every cached prefix, host tier included (pages no request holds go back to the
        free lists)."""
        for node in list(self.tree.root.children.values()):
            for n in self.tree.remove(node):
                if n.on_host:
                    self.stats.host_pages_dropped += self._release_host(n)
                else:
                    self.stats.pages_evicted += self.pages.release(n.pages.values())
                self.stats.evicted_nodes += 1

    def check_agreement(self) -> None:
        """Debug: every rank's tree is the same (a collective; syncs).

        Raises:
            RuntimeError: on every rank, when the trees differ.
        """
        if not self.group.all_equal(self.tree.signature()):
            raise RuntimeError("debug: CP ranks' prefix caches disagree")
